"""``shard_boundaries``: "rows" cuts only between rows, "params" keeps every parameter whole on one rank.

In-process: the layouts (bounds, balance, view shapes). Multi-process: parity with the single-process
reference every step for both modes (odd shapes, tied weights, a frozen unit, W = 2, 3, 4, hybrid),
with prefetch, bf16, clip and no_sync; Muon + AdamW and Adafactor on ``owned_named_parameters`` equal to
the single-process run with no collective inside ``optimizer.step()``; state dicts and checkpoints
that move between boundary modes and world sizes."""

from __future__ import annotations

import collections
import math
import os

import pytest
import torch

from flatshard.testing import count_dist_calls
from tests.helpers.cases import PER_RANK, build, make_optimizer, run_case, shared_references
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT
from tests.helpers.util import assert_params_match


# ---- the layouts, in process ---------------------------------------------------------------------------
def _infos(shapes):
    from flatshard.runtime.layout import ParamInfo

    out, offset = [], 0
    for i, shape in enumerate(shapes):
        numel = math.prod(shape)
        out.append(ParamInfo(f"p{i}", torch.Size(shape), numel, offset, True, ()))
        offset += numel
    return out


SHAPES = [(7, 15), (15,), (3, 15), (3,), (1,), (), (33, 4, 2)]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_layout_bounds_and_views(world):
    from flatshard.runtime.layout import FlatLayout

    infos = _infos(SHAPES)
    total = sum(i.numel for i in infos)
    for mode in ("rows", "params"):
        layout = FlatLayout(infos, world, mode)
        assert layout.bounds[0] == 0 and layout.bounds[-1] == total == layout.padded, (mode, layout.bounds)
        assert all(a <= b for a, b in zip(layout.bounds, layout.bounds[1:])), layout.bounds
        assert sorted(i.name for i in layout.infos) == sorted(i.name for i in infos)
        seen = {i.name: 0 for i in layout.infos}
        for rank in range(world):
            for info, (lo, hi), (a, b) in zip(layout.infos, layout.local_slices(rank), layout.param_ranges(rank)):
                seen[info.name] += hi - lo
                assert b - a == hi - lo
                shape = layout.local_shape(info, lo, hi)
                assert math.prod(shape) == hi - lo, (mode, info.shape, shape)
                if mode == "params":
                    assert hi - lo in (0, info.numel), "a parameter is whole on one rank or absent"
                if len(info.shape) >= 2 and hi > lo:
                    assert len(shape) == len(info.shape) and tuple(shape[1:]) == tuple(info.shape[1:]), shape
        assert all(seen[i.name] == i.numel for i in infos), (mode, seen)  # every element on exactly one rank
    # "params" deals largest first to the least loaded rank: no rank holds more than the ideal plus the largest
    layout = FlatLayout(infos, world, "params")
    assert max(layout.shard_sizes) <= total / world + max(i.numel for i in infos)
    flat = FlatLayout(infos, world, "flat")
    assert flat.uniform and flat.padded == world * math.ceil(total / world)


def test_unknown_boundaries_are_refused():
    from flatshard.runtime.layout import FlatLayout

    with pytest.raises(ValueError, match="shard_boundaries must be one of"):
        FlatLayout(_infos(SHAPES), 2, "blocks")


# ---- parity --------------------------------------------------------------------------------------------
def parity_worker(rank: int, world: int) -> int:
    with shared_references():  # [Note: one reference per trajectory], tests/helpers/cases.py
        return _parity(rank, world)


def _parity(rank: int, world: int) -> int:
    import torch.distributed as dist

    cases = 0
    for mode in ("rows", "params"):
        for kind in ("odd_mlp", "gpt_tie_across_units", "frozen_nested_manual"):
            for opt in ("sgd_momentum", "adamw"):
                model = run_case(rank, world, kind, "FULL_SHARD", opt, shard_boundaries=mode)
                views = [p for p in model.parameters() if p.numel()]
                if mode == "rows":  # a rank's piece of a matrix is a block of rows: the parameter's ndim
                    assert all(p.dim() == len(p.orig_shape) or len(p.orig_shape) == 0 for p in views)
                else:
                    assert all(tuple(p.shape) == tuple(p.orig_shape) or p.orig_shape == () for p in views)
                cases += 1
    if world == 4:
        for mode in ("rows", "params"):
            run_case(rank, world, "gpt_tie_in_root", "HYBRID_SHARD", "adamw", shard_boundaries=mode, sharding_factor=2)
            cases += 1
    dist.barrier()
    return cases


# W = 3 in make test, the other worlds in make test-slow ([Note: two tiers], tests/conftest.py)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3, pytest.param(4, marks=pytest.mark.slow)])
def test_parity_rows_and_params(world):
    assert run_distributed(parity_worker, world, timeout=400) == [12 + (2 if world == 4 else 0)] * world


def features_worker(rank: int, world: int) -> dict:
    """Prefetch, bf16, clip, no_sync and summon on both modes."""
    from flatshard import BackwardPrefetch, MixedPrecision
    from flatshard import FullyShardedDataParallel as FSDP

    out = {}
    for mode in ("rows", "params"):
        run_case(
            rank,
            world,
            "gpt_tie_across_units",
            "FULL_SHARD",
            "adamw",
            shard_boundaries=mode,
            backward_prefetch=BackwardPrefetch.BACKWARD_POST,
            forward_prefetch=True,
        )
        ref, model, batch, loss_fn = build("gpt_tie_in_root", "FULL_SHARD", shard_boundaries=mode)
        x, y = batch(0, world * PER_RANK)
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_fn(ref(x), y).backward()
        xs, ys = x[local], y[local]
        with model.no_sync():  # the first micro-batch accumulates unreduced; the second reduces the sum
            (loss_fn(model(xs[:1]), ys[:1]) / PER_RANK).backward()
        (loss_fn(model(xs[1:]), ys[1:]) * (PER_RANK - 1) / PER_RANK).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        torch.testing.assert_close(model.clip_grad_norm_(0.05), ref_norm)
        with FSDP.summon_full_params(model):
            full = dict(model.named_parameters())
            assert all(torch.equal(full[n], p) for n, p in ref.named_parameters())
        _, bf, batch, loss_fn = build(
            "gpt_tie_in_root", "FULL_SHARD", shard_boundaries=mode, mixed_precision=MixedPrecision(torch.bfloat16)
        )
        with bf.record_comms() as rec:
            loss_fn(bf(x[local]), y[local]).backward()
        out[mode] = rec.count("all_gather") > 0 and all(
            p.grad.dtype == torch.float32 for p in bf.parameters() if p.grad is not None
        )
    return out


def test_prefetch_bf16_clip_no_sync_and_summon_under_both_modes():
    assert run_distributed(features_worker, 3, timeout=300) == [{"rows": True, "params": True}] * 3


# ---- whole-matrix optimizers -------------------------------------------------------------------------------
def _split(params):
    matrices = [p for p in params if len(getattr(p, "orig_shape", p.shape)) == 2]
    rest = [p for p in params if len(getattr(p, "orig_shape", p.shape)) != 2]
    return matrices, rest


def _optimizers(recipe: str, params: list) -> list:
    if recipe == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)] if params else []
    matrices, rest = _split(params)  # a rank may own no matrix, or nothing else: no optimizer for it
    return [o(ps, lr=1e-2) for o, ps in ((torch.optim.Muon, matrices), (torch.optim.AdamW, rest)) if ps]


def whole_worker(rank: int, world: int) -> dict:
    """Adafactor: the run equals the single-process run on the global batch (fp32 tolerances). Muon runs
    Newton-Schulz in bf16, so two runs whose gradients differ by rounding (a sum in another order) part
    by ~1e-4 whatever runs them; so for Muon every step restarts the single-process reference from
    flatshard's parameters and checks the gradients against it (fp32 tolerances), and checks the step
    itself against Muon on one process given the same gradients, bitwise (a mirror model beside it)."""
    import copy

    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy
    from tests.helpers.util import assert_grads_match

    out = {}
    for recipe in ("muon+adamw", "adafactor"):
        torch.manual_seed(0)
        ref = TinyGPT(dim=16, heads=2)
        mirror = copy.deepcopy(ref)
        torch.manual_seed(0)
        model = FSDP(TinyGPT(dim=16, heads=2), auto_wrap_policy=ModuleWrapPolicy({Block}), shard_boundaries="params")
        owned = [p for _, p in flatshard.owned_named_parameters(model)]
        ref_opts, opts = _optimizers(recipe, list(ref.parameters())), _optimizers(recipe, owned)
        mirror_opts = _optimizers(recipe, list(mirror.parameters()))
        optimizer_comms = collections.Counter()
        for step in range(5):
            what = f"{recipe} W={world} step {step}"
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 37, (world * PER_RANK, 8), generator=g)
            local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            loss = torch.nn.functional.cross_entropy
            if recipe != "adafactor":  # Muon: the reference restarts from flatshard's parameters every step
                with FSDP.summon_full_params(model, writeback=False), torch.no_grad():
                    for (_, p), r in zip(model.named_parameters(), ref.parameters()):
                        r.copy_(p)
            loss(ref(x).flatten(0, 1), x.flatten()).backward()
            loss(model(x[local]).flatten(0, 1), x[local].flatten()).backward()
            assert_grads_match(model, ref, what)
            with FSDP.summon_full_params(model, with_grads=True, writeback=False), torch.no_grad():
                for (_, p), m in zip(model.named_parameters(), mirror.parameters()):
                    m.copy_(p)
                    m.grad = p.grad.clone()  # Muon on one process, given flatshard's own gradients
            with count_dist_calls() as seen:  # at torch.distributed: anyone's communication, not only flatshard's
                for o in opts:
                    o.step()
            for o in opts:
                o.zero_grad()
            optimizer_comms += seen.calls + seen.ops
            for o in (*ref_opts, *mirror_opts):
                o.step()
                o.zero_grad()
            if recipe == "adafactor":
                assert_params_match(model, ref, what)
            else:
                assert_params_match(model, mirror, what, atol=0, rtol=0)
        out[recipe] = dict(optimizer_comms)
    out["flat_error"] = ""
    try:
        list(flatshard.owned_named_parameters(FSDP(TinyGPT())))
    except ValueError as e:
        out["flat_error"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_muon_and_adafactor_on_owned_parameters_match_a_single_process(world):
    for out in run_distributed(whole_worker, world, timeout=300):
        assert out["muon+adamw"] == {} and out["adafactor"] == {}, f"communication inside optimizer.step(): {out}"
        assert out["flat_error"].startswith("owned_named_parameters needs every unit built with"), out


# ---- state dicts and checkpoints across modes and world sizes ---------------------------------------------
def save_worker(rank: int, world: int, path: str) -> list:
    from flatshard import checkpoint

    _, model, batch, loss_fn = build("gpt_tie_across_units", "FULL_SHARD", shard_boundaries="rows")
    opt = make_optimizer("adamw", model)
    x, y = batch(0, PER_RANK)
    loss_fn(model(x), y).backward()
    opt.step()
    checkpoint.save(path, model, opt, step=1)
    return _full(model)


def _full(model):
    from flatshard import FullyShardedDataParallel as FSDP

    with FSDP.summon_full_params(model, writeback=False):
        return [p.detach().clone() for p in model.parameters()]


def load_worker(rank: int, world: int, path: str, mode: str) -> list:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType, checkpoint

    _, model, batch, loss_fn = build("gpt_tie_across_units", "FULL_SHARD", shard_boundaries=mode)
    opt = make_optimizer("adamw", model)
    assert checkpoint.load(path, model, opt).step == 1
    loaded = _full(model)
    x, y = batch(1, PER_RANK)
    loss_fn(model(x), y).backward()
    opt.step()  # the optimizer state loaded is shaped like the shard views it belongs to
    # a SHARDED state dict of this mode round-trips into a model of "flat"
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
    _, flat, _, _ = build("gpt_tie_across_units", "FULL_SHARD")
    with FSDP.state_dict_type(flat, StateDictType.SHARDED_STATE_DICT):
        flat.load_state_dict(sd)
    assert all(map(torch.equal, _full(flat), _full(model)))
    return loaded


def test_checkpoints_move_between_boundary_modes_and_world_sizes(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 2, path, timeout=200)[0]
    for world, mode in ((3, "params"), (2, "flat"), (4, "rows")):
        for loaded in run_distributed(load_worker, world, path, mode, timeout=200):
            assert all(map(torch.equal, loaded, saved)), (world, mode)
    assert os.path.isdir(path)
