"""summon_full_params: master-dtype values under mixed precision, writeback, rank0_only, with_grads,
offload_to_cpu; and the collectives it issues (one all-gather of each unit's flat shard, one more of its
gradient shard with ``with_grads``)."""

from __future__ import annotations

import torch

import flatshard
from flatshard import testing
from flatshard.testing import shard_ranges
from tests.helpers.cases import PER_RANK, build
from tests.helpers.dist import run_distributed


def summon_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision

    out = {}
    ref, model, batch, loss_fn = build(
        "frozen_nested_manual", "FULL_SHARD", mixed_precision=MixedPrecision(param_dtype=torch.bfloat16)
    )
    x, y = batch(0, world * PER_RANK)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss_fn(model(x[local]), y[local]).backward()
    loss_fn(ref(x), y).backward()
    shards = [t.clone() for t in testing.flat_shards(model)]
    ranges = shard_ranges(model)
    shard_grads = {n: (ranges[id(p)], None if p.grad is None else p.grad.clone()) for n, p in model.named_parameters()}

    # the fp32 masters, not the bf16 compute copy; full gradients whose every rank's piece is its shard's
    with model.record_comms() as rec, FSDP.summon_full_params(model, with_grads=True):
        refs = dict(ref.named_parameters())
        for name, p in model.named_parameters():
            assert p.dtype == torch.float32 and p.shape == refs[name].shape and torch.equal(p, refs[name]), name
            (a, b), g = shard_grads[name]
            assert (p.grad is None) == (g is None) == (refs[name].grad is None), name  # the frozen trunk has none
            if g is not None:
                assert p.grad.shape == p.shape and torch.equal(p.grad.reshape(-1)[a:b], g), name
                torch.testing.assert_close(p.grad, refs[name].grad, rtol=0.05, atol=1e-3, msg=name)  # bf16 compute
    gathers = rec.wire_bytes("all_gather")
    flat_bytes = sum(u.shard_numel * 4 * (world - 1) for u in flatshard.units(model))
    assert gathers == 2 * flat_bytes, (gathers, flat_bytes)  # parameters and gradients, in fp32
    assert all(map(torch.equal, shards, testing.flat_shards(model))), "writeback without edits changed the masters"

    # an edit below bf16's resolution survives writeback exactly
    tiny = 1.0 + 2.0**-20
    with FSDP.summon_full_params(model), torch.no_grad():
        for _, p in model.named_parameters():
            p.fill_(tiny)
    assert all(bool((p == tiny).all()) for p in model.parameters())

    # rank0_only: full parameters on rank 0 only, the other ranks keep their 1-D shard views
    full_shapes = {n: r.shape for n, r in ref.named_parameters()}
    with FSDP.summon_full_params(model, rank0_only=True, writeback=False):
        shapes = {n: p.shape for n, p in model.named_parameters()}
    out["rank0_only_full"] = shapes == full_shapes
    try:
        with FSDP.summon_full_params(model, rank0_only=True):
            pass
        out["rank0_writeback"] = "no error"
    except ValueError as e:
        out["rank0_writeback"] = str(e)

    # offload_to_cpu: the same values, and the context leaves the shard views in place
    with FSDP.summon_full_params(model, offload_to_cpu=True, writeback=False):
        out["offload_values"] = all(p.device.type == "cpu" and bool((p == tiny).all()) for p in model.parameters())
    out["views_back"] = all(p.dim() == 1 for p in model.parameters())
    return out


def test_summon_full_params_options():
    for world in (3,):  # odd: padding in every unit
        for rank, out in enumerate(run_distributed(summon_worker, world, timeout=120)):
            assert out["rank0_only_full"] == (rank == 0), (rank, out)
            assert "rank0_only=True, writeback=True" in out["rank0_writeback"], out
            assert out["offload_values"] and out["views_back"], out
