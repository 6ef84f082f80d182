"""What a newcomer can see of the engine without reading it: a profiler trace of one step names every hook
of every unit, ``flatshard.units(model)`` describes each unit, and ``record_comms()`` sees the traffic of
summon, state dicts and checkpoints under phases of their own."""

from __future__ import annotations

import math
import os

import torch
import torch.nn.functional as F

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

UNITS = ("<root>", "blocks.0", "blocks.1")
PER_UNIT = (
    "pre_forward",
    "post_forward",
    "pre_backward",
    "post_backward",
    "post_backward_reduce",
    "all_gather",
    "reduce_scatter",
)


def _model():
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    return FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}))


def _step(model, opt):
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    model.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()


def labels_worker(rank: int, world: int) -> list[str]:
    from flatshard import FullyShardedDataParallel as FSDP

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, opt)  # the first step records the forward order
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        _step(model, opt)
        with FSDP.summon_full_params(model):
            pass
        model.state_dict()
    return sorted({e.name for e in prof.events() if e.name.startswith("flatshard::")})


def test_a_profiler_trace_names_every_hook_of_every_unit():
    for names in run_distributed(labels_worker, 2, timeout=120):
        for unit in UNITS:
            for hook in PER_UNIT:
                if hook == "all_gather" and unit == "<root>":
                    continue  # the root's backward reuses its forward gather; its forward one is labelled:
                assert f"flatshard::{hook} ({unit})" in names, (hook, unit, names)
        assert "flatshard::all_gather (<root>)" in names  # from the forward
        for entry in (
            "end_of_backward",
            "split_backward (blocks.0)",
            "clip_grad_norm_",
            "summon_full_params",
            "state_dict",
        ):
            assert f"flatshard::{entry}" in names, (entry, names)


def views_worker(rank: int, world: int, tmp: str) -> dict:
    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import checkpoint

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    infos = flatshard.units(model)
    plain = TinyGPT()
    out = {"names": [u.name for u in infos], "roots": [u.is_root for u in infos]}
    own = {"<root>": [n for n, _ in plain.named_parameters() if not n.startswith("blocks.")]}
    for b in (0, 1):
        own[f"blocks.{b}"] = [n for n, _ in plain.blocks[b].named_parameters()]
    sizes = dict(plain.named_parameters())
    for u in infos:
        full_names = own[u.name] if u.name == "<root>" else [f"{u.name}.{n}" for n in own[u.name]]
        assert list(u.param_names) == own[u.name] or u.name == "<root>", (u.name, u.param_names)
        numel = sum(sizes[n].numel() for n in full_names if n != "head.weight")  # head is tied to wte
        assert u.numel == numel, (u.name, u.numel, numel)
        assert u.shard_numel == math.ceil(u.numel / world) and u.padded_numel == u.shard_numel * world
        assert u.padding == u.padded_numel - u.numel
        assert (u.shard_size, u.replicate_size, u.shard_rank, u.replicate_rank) == (world, 1, rank, 0)
        assert u.shard_group_ranks == tuple(range(world))
        assert u.dtype == u.compute_dtype == torch.float32 and u.reshard_after_forward
    assert sum(u.local_numel for u in infos) == sum(p.numel() for p in model.parameters())
    _step(model, opt)
    counts = {}
    with model.record_comms() as rec:
        with FSDP.summon_full_params(model):
            pass
        counts["summon"] = rec.count("all_gather", phase="summon")
        model.state_dict()
        counts["state_dict"] = rec.count("all_gather", phase="state_dict")
        FSDP.optim_state_dict(model, opt)
        counts["optim_state_dict"] = rec.count(phase="state_dict") - counts["state_dict"]
        checkpoint.save(os.path.join(tmp, "ckpt"), model, opt, step=1)
        checkpoint.load(os.path.join(tmp, "ckpt"), model, opt)
        counts["checkpoint"] = rec.count(phase="checkpoint")
        counts["training"] = rec.count(phase="forward") + rec.count(phase="backward")
    out["counts"] = counts
    return out


def test_public_unit_view_and_every_collective_recorded(tmp_path):
    for out in run_distributed(views_worker, 2, str(tmp_path), timeout=120):
        assert out["names"] == list(UNITS) and out["roots"] == [True, False, False]
        counts = out["counts"]
        assert counts["summon"] == len(UNITS), counts  # one gather of each unit's flat shard
        assert counts["state_dict"] == len(UNITS), counts  # FULL: one unit gathered at a time
        assert counts["optim_state_dict"] > 0 and counts["checkpoint"] > 0, counts
        assert counts["training"] == 0, counts


def collect_worker(rank: int, world: int) -> dict:
    import gc
    import weakref

    from flatshard.testing import engine_units

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step(model, opt)
    refs = [weakref.ref(model)] + [weakref.ref(u) for u in engine_units(model)]
    del model, opt
    gc.collect()
    out = {"alive": sum(r() is not None for r in refs), "of": len(refs)}

    from flatshard import fully_shard

    torch.manual_seed(0)
    model = TinyGPT()
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    del block  # a loop variable would keep the last block, and through it every unit, alive
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step2(model, opt)
    refs = [weakref.ref(model)] + [weakref.ref(u) for u in engine_units(model)]
    del model, opt
    gc.collect()
    out["fully_shard"] = {"alive": sum(r() is not None for r in refs), "of": len(refs)}
    return out


def _step2(model, opt):
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(1))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad()


def test_a_wrapped_model_is_freed_by_a_collection():
    """Nothing but Python objects keeps a trained wrapper alive: a collection frees it and its units (so
    its process groups and their threads end while the interpreter is alive, [Note: process groups at
    exit] in examples/local_launch.py)."""
    for out in run_distributed(collect_worker, 2):
        two = out.pop("fully_shard")
        assert out["of"] > 1 and out["alive"] == 0, out
        assert two["of"] > 1 and two["alive"] == 0, ("fully_shard", two)
