"""Deferred initialisation and sync_module_states.

A model built on the meta device and wrapped must equal, parameter for parameter and buffer for
buffer (bitwise), the single-process reference ``to_empty`` + the same init applied module by module in
``model.modules()`` order, at W = 1, 2, 4 and under two wrap policies, by ``reset_parameters()`` and by
``param_init_fn``; no rank may hold more than the root unit plus one other unit at full size while it
initialises; the model then trains like the reference. ``sync_module_states=True`` makes ranks that
built the model differently (other seeds, other buffers) equal to rank 0. Errors are raised on every
rank and say how to fix them. One spawn of 4 processes runs every case, at W = 4 and on sub-groups of
2 and 1 ranks (``process_group=``)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT
from tests.helpers.util import assert_grads_match, assert_params_match, pairs

EXACT = dict(rtol=0, atol=0)


class Rotary(nn.Module):
    """A table computed from the shapes alone (a non-persistent buffer), as rotary embeddings keep."""

    def __init__(self, dim: int, length: int):
        super().__init__()
        self.dim, self.length = dim, length
        self.register_buffer("table", torch.empty(length, dim), persistent=False)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        pos = torch.arange(self.length, dtype=torch.float32, device=self.table.device)[:, None]
        freq = torch.arange(self.dim, dtype=torch.float32, device=self.table.device)[None, :]
        self.table.copy_(torch.sin(pos / (10.0 ** (freq / self.dim))))


class NormedGPT(TinyGPT):
    """TinyGPT (tied embedding/head) plus a rotary-like table and a BatchNorm's running stats."""

    def __init__(self):
        super().__init__(layers=4)
        self.rot = Rotary(12, 8)
        self.bn = nn.BatchNorm1d(8)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos) + self.rot.table[: idx.shape[1]]
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(self.bn(x)))


def init_fn(module: nn.Module) -> None:
    """A param_init_fn in the usual style: by module type, GPT-2 scales, touching only the module's own states."""
    if isinstance(module, (nn.Linear, nn.Embedding)):
        nn.init.normal_(module.weight, std=0.02)
        if getattr(module, "bias", None) is not None:
            nn.init.zeros_(module.bias)
    else:
        module.reset_parameters()  # norms, the rotary table, BatchNorm's stats


def init_fn_to_empty(module: nn.Module) -> None:
    """FSDP1's documented style: the function materialises the module itself, then initialises it."""
    module.to_empty(device="cpu", recurse=False)
    module.reset_parameters()


INITS = {"reset_parameters": None, "param_init_fn": init_fn, "param_init_fn_to_empty": init_fn_to_empty}


def reference(init) -> nn.Module:
    """The contract's single-process reference: to_empty, re-tie, init each module in modules() order."""
    torch.manual_seed(7)
    with torch.device("meta"):
        ref = NormedGPT()
    ref.to_empty(device="cpu")
    ref.head.weight = ref.wte.weight  # torch's to_empty unties shared weights
    for m in ref.modules():
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            (init or type(m).reset_parameters)(m)
    return ref


def policies():
    import functools

    from flatshard.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    return {
        "blocks": ModuleWrapPolicy({Block}),
        # embeddings and heads as units of their own (the tied weight goes to the root), blocks split by size
        "per_layer": ModuleWrapPolicy({nn.Embedding, nn.Linear, Rotary}),
        "size": functools.partial(size_based_auto_wrap_policy, min_num_params=200),
    }


def full_numel_alive(model: nn.Module) -> int:
    """Elements of real, full-size parameters (not meta, not shard views) reachable from ``model`` now."""
    seen, total = set(), 0
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None and not p.is_meta and not hasattr(p, "orig_shape") and id(p) not in seen:
                seen.add(id(p))
                total += p.numel()
    return total


def check_meta_matches_reference(group, init_name: str, policy_name: str) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import units as unit_infos

    init = INITS[init_name]
    # to_empty + reset_parameters inside the function draws what reset_parameters alone draws
    ref = reference(None if init is init_fn_to_empty else init)
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = NormedGPT()
    peak = [0]

    def watching_init(module):  # wraps the init to measure what a rank holds while initialising
        (init or type(module).reset_parameters)(module)
        peak[0] = max(peak[0], full_numel_alive(meta))

    model = FSDP(meta, group, auto_wrap_policy=policies()[policy_name], param_init_fn=watching_init if init else None)
    if init is None:  # the reset_parameters path has no hook to measure from; its result is checked
        peak[0] = -1
    what = f"W={group.size()} {init_name} {policy_name}"
    assert_params_match(model, ref, what, **EXACT)
    bufs = dict(model.named_buffers())
    assert sorted(bufs) == sorted(n for n, _ in ref.named_buffers()), what
    for name, b in ref.named_buffers():
        torch.testing.assert_close(bufs[name], b, **EXACT, msg=lambda m: f"{what}: buffer {name}: {m}")
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()]), f"{what}: something left on meta"
    units = unit_infos(model)
    biggest = max(u.numel for u in units if not u.is_root)
    return {"peak_full": peak[0], "bound": units[0].numel + biggest, "total": sum(u.numel for u in units)}


def check_trains_like_reference(group) -> None:
    """Two steps of SGD-momentum on a meta-built model (units built in init order, not children first)."""
    from flatshard import FullyShardedDataParallel as FSDP

    ref = reference(None)
    torch.manual_seed(7)
    with torch.device("meta"):
        meta = NormedGPT()
    model = FSDP(meta, group, auto_wrap_policy=policies()["per_layer"])
    rank, world = group.rank(), group.size()
    ref.eval(), model.eval()  # BatchNorm from its running stats: the local batch must not matter
    # SGD: AdamW's normalisation turns rounding-level gradient differences on the BatchNorm weight into lr-sized ones
    ref_opt, opt = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref, model))
    for step in range(2):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randint(0, 37, (2 * world, 8), generator=g), torch.randint(0, 37, (2 * world, 8), generator=g)
        F.cross_entropy(ref(x).flatten(0, 1), y.flatten()).backward()
        local = slice(2 * rank, 2 * rank + 2)
        F.cross_entropy(model(x[local]).flatten(0, 1), y[local].flatten()).backward()
        assert_grads_match(model, ref, f"meta-built step {step}")
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, ref, f"meta-built step {step}")


def check_sync_module_states(rank: int) -> dict:
    """Every rank builds the model from its own seed and perturbs its buffers; rank 0's state wins."""
    from flatshard import FullyShardedDataParallel as FSDP

    torch.manual_seed(100)  # rank 0's seed
    ref = NormedGPT()
    ref.bn.running_mean.fill_(3.0)
    torch.manual_seed(100 + rank)
    mine = NormedGPT()
    mine.bn.running_mean.fill_(3.0 + rank)
    differs = not torch.equal(mine.blocks[0].fc.weight, ref.blocks[0].fc.weight)
    model = FSDP(mine, auto_wrap_policy=policies()["blocks"], sync_module_states=True)
    assert_params_match(model, ref, f"sync_module_states rank {rank}", **EXACT)
    bufs = dict(model.named_buffers())
    for name, b in ref.named_buffers():
        assert torch.equal(bufs[name], b), f"sync_module_states: buffer {name} differs from rank 0's"
    # without it, a rank keeps its own values (the check above can fail)
    torch.manual_seed(100 + rank)
    unsynced = FSDP(NormedGPT(), auto_wrap_policy=policies()["blocks"])
    same = all(torch.equal(p, r) for _, p, r, _ in pairs(unsynced, ref))
    return {"differed_before": differs, "unsynced_equal": same}


def errors(rank: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    def raised(fn) -> str:
        try:
            fn()
        except Exception as e:
            return f"{type(e).__name__}: {e}"
        return "no error"

    class Scaled(nn.Module):  # a parameter of its own and no reset_parameters
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self.scale = nn.Parameter(torch.ones(3))

    def meta(cls):
        with torch.device("meta"):
            return cls()

    return {
        "no_reset": raised(lambda: FSDP(meta(Scaled))),
        "not_callable": raised(lambda: FSDP(meta(Scaled), param_init_fn="normal")),
        "left_on_meta": raised(
            lambda: FSDP(meta(Scaled), param_init_fn=lambda m: m.to_empty(device="meta", recurse=False))
        ),
        "custom_fn_ok": raised(
            lambda: FSDP(meta(Scaled), param_init_fn=lambda m: [nn.init.ones_(p) for p in m.parameters(recurse=False)])
        ),
    }


def worker(rank: int, world: int) -> dict:
    import torch.distributed as dist

    groups = {}
    for size in (4, 2, 1):  # every rank creates every group, in the same order
        for start in range(0, world, size):
            g = dist.new_group(list(range(start, start + size)))
            if start <= rank < start + size:
                groups[size] = g
    out = {"cases": {}}
    for size, group in groups.items():
        for init_name in INITS:
            for policy_name in ("blocks", "per_layer") if size != 2 else ("blocks", "per_layer", "size"):
                out["cases"][(size, init_name, policy_name)] = check_meta_matches_reference(
                    group, init_name, policy_name
                )
        check_trains_like_reference(group)
    out["sync"] = check_sync_module_states(rank)
    out["errors"] = errors(rank)
    return out


def test_meta_model_equals_reference_and_trains():
    results = run_distributed(worker, 4, timeout=300)
    for rank, out in enumerate(results):
        assert {size for size, _, _ in out["cases"]} == {1, 2, 4}
        for case, figures in out["cases"].items():
            if figures["peak_full"] >= 0:  # never the whole model at full size: the root and one unit at most
                assert 0 < figures["peak_full"] <= figures["bound"] < figures["total"], (rank, case, figures)
        e = out["errors"]
        assert e["no_reset"].startswith("ValueError: the model is on the meta device"), e["no_reset"]
        assert "'<root>' (Scaled)" in e["no_reset"] and "param_init_fn" in e["no_reset"], e["no_reset"]
        assert e["not_callable"].startswith("TypeError: param_init_fn must be a callable"), e["not_callable"]
        assert e["left_on_meta"].startswith("RuntimeError: after initialising module"), e["left_on_meta"]
        assert "still on the meta device" in e["left_on_meta"], e["left_on_meta"]
        assert e["custom_fn_ok"] == "no error", e["custom_fn_ok"]
        assert out["sync"]["differed_before"] == (rank != 0), (
            "ranks must start different for the sync check to mean anything"
        )
        assert out["sync"]["unsynced_equal"] == (rank == 0), "without sync_module_states ranks keep their own values"
