"""Activation checkpointing with PyTorch's own tools, applied before or after wrapping, or called inside
a forward: parity with the un-checkpointed single-process reference for 5 steps (fp32 defaults), no
unsharded flat left behind, one reduce-scatter per unit per backward (no gradient counted twice), no
extra all-gather for the recomputation, and the activation memory it saves, measured.

* ``before``: ``apply_activation_checkpointing`` then wrapping: the checkpoint wraps the unit, whose
  forward (with flatshard's hooks) runs again in backward.
* ``after``: wrapping then ``apply_activation_checkpointing``: the checkpoint sits inside the unit.
* ``inside``: the model's forward calls ``torch.utils.checkpoint.checkpoint`` on each block.
SGD-momentum for every (mode, strategy), AdamW under FULL_SHARD. One spawn of 2 processes runs every case."""

from __future__ import annotations

import functools
import itertools

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT
from tests.helpers.util import assert_grads_match, assert_params_match

MODES = ("before", "after", "inside")
STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
STEPS = 5  # [Note: five steps], tests/helpers/cases.py
PER_RANK = 3


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose forward checkpoints each block itself."""

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = checkpoint(b, x, use_reentrant=False)
        return self.head(self.ln_f(x))


def is_block(m) -> bool:
    return isinstance(m, Block)


def build(mode, strategy: str, prefetch="default", **sizes):
    """(reference without checkpointing, wrapped model with it; mode None: without), same initial weights.
    ``prefetch``: the backward_prefetch keyword, or "default" to leave it out."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = TinyGPT(**sizes)
    torch.manual_seed(0)
    model = (CheckpointedGPT if mode == "inside" else TinyGPT)(**sizes)
    keywords = {} if prefetch == "default" else {"backward_prefetch": prefetch}
    wrap = functools.partial(
        FSDP, sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block}), **keywords
    )
    if mode == "before":
        apply_activation_checkpointing(model, check_fn=is_block)
    model = wrap(model)
    if mode == "after":
        apply_activation_checkpointing(model, check_fn=is_block)
    return ref, model


def make_optimizer(kind: str, model):
    if kind == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def batch(step: int, n: int, vocab: int = 37, length: int = 8):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (n, length), generator=g), torch.randint(0, vocab, (n, length), generator=g)


def run_case(rank: int, world: int, mode: str, strategy: str, opt_kind: str) -> dict:
    from flatshard import testing
    from flatshard import units as unit_infos

    ref, model = build(mode, strategy)
    units = unit_infos(model)
    names = [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in model.named_parameters()] == names, "checkpoint wrappers must not show in the names"
    ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    counts = []
    for step in range(STEPS):
        what = f"{mode}/{strategy}/{opt_kind} W={world} step {step}"
        x, y = batch(step, world * PER_RANK)
        ref_out = ref(x)
        F.cross_entropy(ref_out.flatten(0, 1), y.flatten()).backward()
        with model.record_comms() as comms:
            out = model(x[local])
            torch.testing.assert_close(out, ref_out[local], msg=lambda m: f"{what}: forward output: {m}")
            F.cross_entropy(out.flatten(0, 1), y[local].flatten()).backward()
        counts.append((comms.count("all_gather", "backward"), comms.count("reduce_scatter", "backward")))
        # nothing left gathered, no full-size gradient left over, shard views back on the modules
        for u, held in zip(units, testing.gathered_bytes(model)):
            assert held == 0, f"{what}: unit {u.name} still gathered after backward"
        assert testing.units_keeping_full_grads(model) == [], f"{what}: a unit kept its full-size gradient"
        assert all(p.dim() == 1 for p in model.parameters()), f"{what}: compute views left on the modules"
        assert_grads_match(model, ref, what)  # a gradient counted twice would be twice the reference's
        ref_opt.step()
        opt.step()
        assert_params_match(model, ref, what)
        ref_opt.zero_grad()
        opt.zero_grad()
    return {"counts": counts, "units": len(units)}


def activation_peaks(mode, strategy: str, prefetch="default") -> dict:
    """One step of a larger TinyGPT under ``tracking_activations()``; mode None: no checkpointing."""
    from flatshard import units as unit_infos

    _, model = build(mode, strategy, prefetch, dim=48, heads=4, layers=4, block=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    units = unit_infos(model)
    x, y = batch(0, 8, length=64)
    with model.record_memory(opt) as mem:
        for _ in range(2):  # the second step, with optimizer state, is the one measured
            mem.reset_peak()
            with mem.tracking_activations():
                F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            opt.zero_grad()
    full = [u.padded_numel * 4 for u in units]
    return {"activations": mem.peak["activations"], "gathered": mem.peak["gathered"], "full": full}


def worker(rank: int, world: int) -> dict:
    out = {"cases": {}, "peaks": {}}
    cases = [
        *itertools.product(MODES, STRATEGIES, ["sgd_momentum"]),
        *itertools.product(MODES, ["FULL_SHARD"], ["adamw"]),
    ]
    for mode, strategy, opt_kind in cases:
        out["cases"][(mode, strategy, opt_kind)] = run_case(rank, world, mode, strategy, opt_kind)
    for strategy in STRATEGIES:
        for mode in (None, *MODES):
            out["peaks"][(mode, strategy, "default")] = activation_peaks(mode, strategy)
    for mode in (None, "before", "after"):  # one unit gathered at a time: the bound holds without prefetch
        out["peaks"][(mode, "FULL_SHARD", None)] = activation_peaks(mode, "FULL_SHARD", prefetch=None)
    return out


def test_activation_checkpointing_parity_and_memory():
    world = 2
    results = run_distributed(worker, world, timeout=300)
    for rank, out in enumerate(results):
        for (mode, strategy, _opt_kind), case in out["cases"].items():
            M = case["units"]
            for gathers, reduces in case["counts"]:
                assert reduces == M, f"{mode}/{strategy}: {reduces} reduce-scatters in one backward for {M} units"
                # the recomputation shares the backward's all-gather: none at all under SHARD_GRAD_OP, and
                # under FULL_SHARD one per unit but the root (which stays gathered from forward)
                assert gathers == (M - 1 if strategy == "FULL_SHARD" else 0), (mode, strategy, gathers)
        for (mode, strategy, prefetch), with_ac in out["peaks"].items():
            if mode is None:
                continue
            base = out["peaks"][(None, strategy, prefetch)]
            saved = 1 - with_ac["activations"] / base["activations"]
            if rank == 0:
                print(
                    f"{strategy} backward_prefetch={prefetch} checkpointing {mode} wrapping: peak activations "
                    f"{with_ac['activations']} B vs {base['activations']} B without ({saved:.0%} saved); "
                    f"peak gathered {with_ac['gathered']} B vs {base['gathered']} B"
                )
            assert saved > 0.4, (strategy, mode, prefetch, with_ac, base)
            # the recomputation gathers nothing that the un-checkpointed backward does not
            assert with_ac["gathered"] == base["gathered"], (strategy, mode, prefetch, with_ac, base)
            full = with_ac["full"]
            if prefetch is None:  # FULL_SHARD: the root and one unit (each with its full-size gradient) at a time
                assert with_ac["gathered"] <= 2 * full[0] + 2 * max(full[1:]), (mode, with_ac)
