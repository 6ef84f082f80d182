"""Hybrid sharding at W = 4: parity with the reference every step for F = 1, 2, 4; the same F named two
other ways (a mesh, a pair of process groups) bitwise the same run; F = 4 bitwise FULL_SHARD and F = 1
bitwise NO_SHARD; collectives per group; memory 16·P/F."""

from __future__ import annotations

import torch
import torch.distributed as dist

import flatshard
from tests.helpers.cases import (
    PER_RANK,
    STEPS,
    build,
    make_optimizer,
    run_case,
    shared_references,
    train_rank_batches,
)
from tests.helpers.dist import run_distributed

B = 4  # bytes per fp32 element


def groups_for(way: str, factor: int, world: int) -> dict:
    """FullyShardedDataParallel keywords that name shard groups of ``factor`` consecutive ranks."""
    if way == "sharding_factor":
        return {"sharding_factor": factor}
    if way == "device_mesh":
        from torch.distributed.device_mesh import init_device_mesh

        return {
            "device_mesh": init_device_mesh("cpu", (world // factor, factor), mesh_dim_names=("replicate", "shard"))
        }
    rank = dist.get_rank()
    shard = replicate = None
    for r in range(world // factor):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(r * factor, (r + 1) * factor)))
        shard = g if rank // factor == r else shard
    for k in range(factor):
        g = dist.new_group(list(range(k, world, factor)))
        replicate = g if rank % factor == k else replicate
    return {"process_group": (shard, replicate)}


def train_without_reference(rank: int, world: int, kind: str, strategy: str, opt_kind: str, **fsdp_kwargs):
    """The wrapped model after run_case's STEPS steps on the same batches, trained without the reference."""
    _, model, batch, loss_fn = build(kind, strategy, **fsdp_kwargs)
    train_rank_batches(model, make_optimizer(opt_kind, model), batch, loss_fn, rank, world, STEPS)
    return model


def hybrid_parity_worker(rank: int, world: int) -> dict:
    with shared_references():  # [Note: one reference per trajectory], tests/helpers/cases.py
        return _hybrid_parity(rank, world)


def _hybrid_parity(rank: int, world: int) -> dict:
    # [Note: one reference per layout] run_case checks every step against the single-process reference;
    # a case that must equal another to the bit (the same groups named another way, or an endpoint of the
    # F axis) trains without one and is compared bitwise with the checked run's final parameters, which
    # says more than a tolerance and costs a quarter of the time on these 2 cores.
    cases = [("HYBRID_SHARD", f) for f in (1, 2, 4)] + [("_HYBRID_SHARD_ZERO2", 2)]
    finals = {}
    # the tie-across-units model (13 units) once; the 3-unit GPT for the product of cases
    run_case(rank, world, "gpt_tie_across_units", "HYBRID_SHARD", "adamw", sharding_factor=2)
    for strategy, factor in cases:
        for opt_kind in ("sgd_momentum", "adamw"):
            for way in ("sharding_factor", "device_mesh", "process_group"):
                train = run_case if way == "sharding_factor" else train_without_reference
                model = train(rank, world, "gpt_tie_in_root", strategy, opt_kind, **groups_for(way, factor, world))
                root = flatshard.units(model)[0]
                assert root.shard_size == factor and root.replicate_size == world // factor
                finals[(strategy, factor, way, opt_kind)] = [p.detach().clone() for p in model.parameters()]
            checked = finals[(strategy, factor, "sharding_factor", opt_kind)]
            for way in ("device_mesh", "process_group"):
                assert all(map(torch.equal, finals[(strategy, factor, way, opt_kind)], checked)), (
                    f"{strategy} F={factor} via {way} != via sharding_factor ({opt_kind})"
                )
    # the endpoints of the F axis are the plain strategies, to the bit
    for opt_kind in ("sgd_momentum", "adamw"):
        full, none = (
            [
                p.detach().clone()
                for p in train_without_reference(rank, world, "gpt_tie_in_root", s, opt_kind).parameters()
            ]
            for s in ("FULL_SHARD", "NO_SHARD")
        )
        assert all(map(torch.equal, finals[("HYBRID_SHARD", 4, "sharding_factor", opt_kind)], full)), (
            "F=4 != FULL_SHARD"
        )
        assert all(map(torch.equal, finals[("HYBRID_SHARD", 1, "sharding_factor", opt_kind)], none)), "F=1 != NO_SHARD"
    return {"cases": len(finals)}


def test_hybrid_parity_and_endpoints():
    results = run_distributed(hybrid_parity_worker, 4, timeout=500)
    assert results == [{"cases": 24}] * 4


def hybrid_comms_worker(rank: int, world: int) -> dict:

    out = {}
    for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        for factor in (1, 2, 4):
            _, model, batch, loss_fn = build("gpt_tie_in_root", strategy, sharding_factor=factor)
            units = flatshard.units(model)
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
            R, M, root = world // factor, len(units), units[0]
            for step in range(2):  # count the second step
                x, y = batch(step, PER_RANK)
                opt.zero_grad()
                with model.record_comms() as rec:
                    loss_fn(model(x), y).backward()
                opt.step()
            padded = sum(u.padded_numel for u in units)
            S = sum(u.shard_numel for u in units)
            intra = rec.wire_bytes(group="shard")
            inter = rec.wire_bytes(group="replicate")
            assert (
                rec.count(kind="all_gather", group="replicate") == 0
                and rec.count(kind="reduce_scatter", group="replicate") == 0
            )
            assert rec.count(kind="all_reduce", group="shard") == 0
            assert rec.count(kind="all_reduce", group="replicate") == (M if R > 1 else 0), "one all-reduce per unit"
            if factor > 1:
                assert rec.count(kind="reduce_scatter", group="shard") == M
                assert rec.count(kind="all_gather", phase="forward") == M
                bwd_gathers = M - 1 if strategy == "HYBRID_SHARD" else 0
                assert rec.count(kind="all_gather", phase="backward") == bwd_gathers
            expected_intra = (3 if strategy == "HYBRID_SHARD" else 2) * padded * B * (factor - 1) / factor
            if strategy == "HYBRID_SHARD":
                expected_intra -= root.padded_numel * B * (factor - 1) / factor  # the root stays gathered
            expected_inter = 2 * S * B * (R - 1) / R  # all-reduce of each unit's shard across replicas
            assert abs(intra - expected_intra) < 1e-6 * max(1, expected_intra), (
                strategy,
                factor,
                intra,
                expected_intra,
            )
            assert abs(inter - expected_inter) < 1e-6 * max(1, expected_inter), (
                strategy,
                factor,
                inter,
                expected_inter,
            )
            now = model.memory_bytes(opt)
            P = sum(u.numel for u in units)
            steady = now["params"] + now["grads"] + now["optimizer"]
            n_params = sum(len(u.param_names) for u in units)
            pad = sum(u.padding for u in units)
            assert 16 * P / factor <= steady <= 16 * (P + pad) / factor + 4 * n_params, (
                factor,
                steady,
                16 * P / factor,
            )
            out[(strategy, factor)] = (intra, inter, steady, P)
    return out


def test_hybrid_collectives_per_group_and_memory():
    results = run_distributed(hybrid_comms_worker, 4, timeout=300)
    for r in results:  # every rank moves the same bytes on each link class
        assert {k: v[:2] for k, v in r.items()} == {k: v[:2] for k, v in results[0].items()}
    steady = {f: results[0][("HYBRID_SHARD", f)][2] for f in (1, 2, 4)}
    assert steady[1] > 1.9 * steady[2] > 1.9 * 1.9 * steady[4], steady  # 16·P/F


def hybrid_utils_worker(rank: int, world: int) -> dict:
    """clip_grad_norm_ counts each element once across replicas; no_sync reduces across both groups."""
    out = {}
    for factor in (2,):
        ref, model, batch, loss_fn = build("gpt_tie_in_root", "HYBRID_SHARD", sharding_factor=factor)
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        x, y = batch(0, world * PER_RANK)
        loss_fn(ref(x), y).backward()
        loss_fn(model(x[local]), y[local]).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        with model.record_comms(events=True) as rec:
            norm = model.clip_grad_norm_(0.05)
        torch.testing.assert_close(norm, ref_norm)
        assert rec.count() == 1 and rec.events[0].group == "shard"
        # no_sync: two micro-batches, the second synced, equal one batch of twice the size
        ref, model, batch, loss_fn = build("gpt_tie_across_units", "HYBRID_SHARD", sharding_factor=factor)
        ref_opt, opt = make_optimizer("adamw", ref), make_optimizer("adamw", model)
        from tests.helpers.util import assert_grads_match, assert_params_match

        for step in range(3):
            x, y = batch(step, world * PER_RANK * 2)
            loss_fn(ref(x), y).backward()
            mine = torch.arange(x.shape[0]).view(world, 2, PER_RANK)[rank]
            with model.no_sync():
                (loss_fn(model(x[mine[0]]), y[mine[0]]) / 2).backward()
            with model.record_comms() as rec:
                (loss_fn(model(x[mine[1]]), y[mine[1]]) / 2).backward()
            assert rec.count("reduce_scatter", group="shard") > 0 and rec.count("all_reduce", group="replicate") > 0
            assert_grads_match(model, ref, f"hybrid no_sync step {step}")
            ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
            assert_params_match(model, ref, f"hybrid no_sync step {step}")
        out["ok"] = True
    return out


def test_hybrid_clip_and_no_sync():
    assert run_distributed(hybrid_utils_worker, 4, timeout=300) == [{"ok": True}] * 4


def bad_groups_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from tests.helpers.models import OddMLP

    def err(fn):
        try:
            fn()
        except Exception as e:  # returned so the parent checks every rank
            return f"{type(e).__name__}: {e}"
        return "no error"

    pair = dist.new_group([0, 1]), dist.new_group([2, 3])
    mine = pair[0] if rank < 2 else pair[1]
    hybrid = ShardingStrategy.HYBRID_SHARD
    return {
        "not_divisor": err(lambda: FSDP(OddMLP(), sharding_strategy=hybrid, sharding_factor=3)),
        "no_groups": err(lambda: FSDP(OddMLP(), sharding_strategy=hybrid)),
        "pair_wrong_size": err(
            lambda: FSDP(OddMLP(), sharding_strategy=hybrid, process_group=(dist.group.WORLD, mine))
        ),
        "mesh_for_full_shard": err(lambda: FSDP(OddMLP(), device_mesh=init_device_mesh("cpu", (2, 2)))),
        "no_shard_factor": err(lambda: FSDP(OddMLP(), sharding_strategy=ShardingStrategy.NO_SHARD, sharding_factor=2)),
        "two_ways": err(
            lambda: FSDP(
                OddMLP(), sharding_strategy=hybrid, sharding_factor=2, device_mesh=init_device_mesh("cpu", (2, 2))
            )
        ),
    }


def test_bad_sharding_factor_is_a_clear_error_on_every_rank():
    results = run_distributed(bad_groups_worker, 4, timeout=120)
    for out in results:
        assert out["not_divisor"].startswith(
            "ValueError: sharding_factor=3 does not divide the world size 4; choose one of [1, 2, 4]"
        )
        assert out["no_groups"].startswith("ValueError: HYBRID_SHARD needs its shard groups")
        assert out["pair_wrong_size"].startswith(
            "ValueError: process_group=(shard_group, replicate_group) describes 2 replicas × 4 shards = 8 ranks"
        )
        assert out["mesh_for_full_shard"].startswith(
            "ValueError: a 2-D device_mesh (replicate, shard) is for HYBRID_SHARD"
        )
        assert out["no_shard_factor"].startswith("ValueError: NO_SHARD means sharding_factor=1")
        assert out["two_ways"].startswith("ValueError: name the shard and replicate groups one way only")
