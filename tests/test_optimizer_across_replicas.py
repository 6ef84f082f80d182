"""shard_optimizer_across_replicas=True ([Note: optimizer state across replicas], runtime/across_replicas.py) at
W = 4 as 2 shard groups of F = 2: parity with the single-process reference every step (SGD-momentum and
AdamW; HYBRID_SHARD and _HYBRID_SHARD_ZERO2; odd shapes, ties, a frozen unit); bytes per group and phase
against the formulas (the replicate reduce-scatter and the pieces' all-gather move together what
HYBRID_SHARD's all-reduce moves); parameters T/F and gradients and optimizer state T/W per rank; clip,
summon, FULL / SHARDED (DCP) state dicts and flatshard.checkpoint, the last loaded at W = 2; bad
combinations refused on every rank alike."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

import flatshard
from tests.helpers.cases import (
    PER_RANK,
    assert_state_equal,
    build,
    full_osd,
    full_sd,
    make_optimizer,
    run_case,
    shared_references,
    train_rank_batches,
)
from tests.helpers.dist import run_distributed

ON = {"shard_optimizer_across_replicas": True, "sharding_factor": 2}
B = 4  # bytes per fp32 element


def parity_worker(rank: int, world: int) -> int:
    cases = [
        (kind, strategy, opt)
        for kind in ("gpt_tie_in_root", "odd_mlp")
        for strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        for opt in ("sgd_momentum", "adamw")
    ]
    cases += [("frozen_nested_manual", "HYBRID_SHARD", "adamw"), ("gpt_tie_across_units", "HYBRID_SHARD", "adamw")]
    with shared_references():  # [Note: one reference per trajectory], tests/helpers/cases.py
        for kind, strategy, opt in cases:
            model = run_case(rank, world, kind, strategy, opt, **ON)
            units = flatshard.units(model)
            assert all(u.shard_size == 2 and u.replicate_size == 2 for u in units)
            # what the shard views hold is this rank's piece: the "flat" shard over all W ranks
            for u in units:
                assert u.local_numel <= math.ceil(u.numel / world), (u.name, u.local_numel, u.numel)
    return len(cases)


def test_parity_with_the_single_process_reference():
    assert run_distributed(parity_worker, 4, timeout=400) == [10] * 4


def bytes_memory_worker(rank: int, world: int) -> dict:
    out = {}
    for on in (False, True):
        kwargs = {"sharding_factor": 2, **({"shard_optimizer_across_replicas": True} if on else {})}
        _, model, batch, loss_fn = build("gpt_tie_in_root", "HYBRID_SHARD", **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for step in range(3):  # count the third step: the pieces of the second step's update travel in it
            x, y = batch(step, PER_RANK)
            with model.record_comms() as rec:
                loss_fn(model(x), y).backward()
                opt.step()
            opt.zero_grad(set_to_none=False)
        units = flatshard.units(model)
        totals = {k: (v["count"], v["wire_bytes"]) for k, v in rec.summary().items() if "order_check" not in k}
        out["on" if on else "off"] = {
            "totals": totals,
            "shards": [u.shard_numel for u in units],
            "local": sum(u.local_numel for u in units),  # the elements this rank's shard views hold
            "numel": sum(u.numel for u in units),
            "padded": [u.padded_numel for u in units],
            "memory": model.memory_bytes(opt),
            "moments": sum(s["exp_avg"].numel() + s["exp_avg_sq"].numel() for s in opt.state.values()),
        }
    return out


def test_bytes_and_memory_against_the_formulas():
    results = run_distributed(bytes_memory_worker, 4, timeout=300)
    for rank, r in enumerate(results):
        off, on = r["off"], r["on"]
        shards, padded = on["shards"], on["padded"]
        piece = [s // 2 for s in shards]  # S_w = S / R
        assert [p * 4 for p in piece] == padded, "a flat shard is R pieces of the 'flat' shard over W"
        units = len(shards)
        # inside the shard group nothing changes: the same gathers and reduce-scatters as HYBRID_SHARD
        shard_keys = {k for k in off["totals"] if k.endswith("/shard")}
        assert {k: on["totals"][k] for k in shard_keys} == {k: off["totals"][k] for k in shard_keys}, rank
        # across replicas: HYBRID_SHARD all-reduces S per unit (2·(R-1)/R·S elements sent); here a reduce-scatter
        # of S to S/R in backward and an all-gather of the pieces in the next forward, (R-1)·S/R elements each
        assert off["totals"]["backward/all_reduce/replicate"] == (units, sum(2 * s // 2 * B for s in shards))
        assert on["totals"]["backward/reduce_scatter/replicate"] == (units, sum(p * B for p in piece))
        assert on["totals"]["forward/all_gather/replicate"] == (units, sum(p * B for p in piece))
        assert not any(k.endswith("/replicate") and "all_reduce" in k for k in on["totals"]), on["totals"]
        # memory: parameters T/F as HYBRID_SHARD, gradients and AdamW's two moments T/W
        m_on, m_off = on["memory"], off["memory"]
        assert m_on["params"] == m_off["params"] == sum(shards) * B
        assert m_on["grads"] == sum(piece) * B and m_off["grads"] == sum(shards) * B
        assert on["moments"] == 2 * on["local"] and off["moments"] == 2 * off["local"]
        assert 0 <= m_on["optimizer"] - 2 * on["local"] * B <= 4 * 26  # and AdamW's 26 step counters
    # every element is owned once over the W ranks with pieces, once per replica without
    assert sum(r["on"]["local"] for r in results) == results[0]["on"]["numel"]
    assert sum(r["off"]["local"] for r in results) == 2 * results[0]["off"]["numel"]


def features_worker(rank: int, world: int, tmp: str) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType, checkpoint

    # clip: the same norm and gradients as torch's utility on the reference
    ref, model, batch, loss_fn = build("odd_mlp", "HYBRID_SHARD", **ON)
    ref_opt, opt = make_optimizer("adamw", ref), make_optimizer("adamw", model)
    train_rank_batches(model, opt, batch, loss_fn, rank, world, 2, ref=ref, ref_opt=ref_opt)
    x, y = batch(7, world * PER_RANK)
    loss_fn(ref(x), y).backward()
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    loss_fn(model(x[local]), y[local]).backward()
    for norm_type in (2.0, math.inf):
        want = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type=norm_type)
        got = model.clip_grad_norm_(0.05, norm_type=norm_type)
        torch.testing.assert_close(got, want)
    ref_opt.step(), opt.step()
    ref_opt.zero_grad(), opt.zero_grad()
    # summon: the whole parameters, also those another replica updated
    with FSDP.summon_full_params(model):
        for (name, p), q in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(p, q, msg=lambda m, name=name: f"summon {name}: {m}")
    # FULL state dicts equal a HYBRID_SHARD model's trained alike, bitwise
    _, plain, _, _ = build("odd_mlp", "HYBRID_SHARD", sharding_factor=2)
    plain_opt = make_optimizer("adamw", plain)
    torch.manual_seed(0)
    ref2, model2, batch, loss_fn = build("odd_mlp", "HYBRID_SHARD", **ON)
    opt2 = make_optimizer("adamw", model2)
    train_rank_batches(model2, opt2, batch, loss_fn, rank, world, 3)
    train_rank_batches(plain, plain_opt, batch, loss_fn, rank, world, 3)
    assert_state_equal(full_sd(model2), full_sd(plain), "FULL model state")
    assert_state_equal(full_osd(model2, opt2), full_osd(plain, plain_opt), "FULL optimizer state")
    # SHARDED through DCP: saved with pieces, loaded into a plain HYBRID_SHARD model
    import torch.distributed.checkpoint as dcp

    with FSDP.state_dict_type(model2, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model2.state_dict()}, checkpoint_id=f"{tmp}/dcp")
    _, other, _, _ = build("odd_mlp", "FULL_SHARD")
    with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": other.state_dict()}
        dcp.load(sd, checkpoint_id=f"{tmp}/dcp")
        other.load_state_dict(sd["model"])
    assert_state_equal(full_sd(other), full_sd(plain), "DCP round trip")
    # flatshard.checkpoint: saved with pieces at W = 4 (loaded at W = 2 by the next test), and a FULL_SHARD
    # checkpoint loaded into pieces, which then train on as the reference does
    checkpoint.save(f"{tmp}/ckpt", model2, opt2, step=3)
    if rank == 0:
        save_file(full_sd(model2), f"{tmp}/want.safetensors")
    else:
        full_sd(model2)
    _, full, _, _ = build("odd_mlp", "FULL_SHARD")
    full_opt = make_optimizer("adamw", full)
    train_rank_batches(full, full_opt, batch, loss_fn, rank, world, 3)
    checkpoint.save(f"{tmp}/full", full, full_opt, step=3)
    _, back, _, _ = build("odd_mlp", "HYBRID_SHARD", **ON)
    back_opt = make_optimizer("adamw", back)
    checkpoint.load(f"{tmp}/full", back, back_opt)
    assert_state_equal(full_osd(back, back_opt), full_osd(full, full_opt), "checkpoint into pieces")
    a = train_rank_batches(back, back_opt, batch, loss_fn, rank, world, 2, start=3)
    b = train_rank_batches(full, full_opt, batch, loss_fn, rank, world, 2, start=3)
    assert a == b, (a, b)
    return {"ok": True}


def load_at_two_worker(rank: int, world: int, tmp: str) -> bool:
    from flatshard import checkpoint

    _, model, _, _ = build("odd_mlp", "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    checkpoint.load(f"{tmp}/ckpt", model, opt)
    want = load_file(f"{tmp}/want.safetensors")
    got = full_sd(model)
    assert_state_equal(dict(sorted(got.items())), dict(sorted(want.items())), "W = 4 pieces checkpoint at W = 2")
    return True


def test_clip_summon_state_dicts_and_checkpoints(tmp_path):
    assert run_distributed(features_worker, 4, str(tmp_path), timeout=300) == [{"ok": True}] * 4
    assert run_distributed(load_at_two_worker, 2, str(tmp_path), timeout=120) == [True, True]


def auto_worker(rank: int, world: int) -> dict:
    _, model, _, _ = build(
        "odd_mlp", "HYBRID_SHARD", shard_optimizer_across_replicas=True, sharding_factor="auto", memory_budget=10**9
    )
    units = flatshard.units(model)
    return {"sizes": sorted({(u.shard_size, u.replicate_size) for u in units}), "why": model.sharding_decision[1]}


def test_auto_picks_among_the_factors_that_split_the_optimizer_state():
    """sharding_factor="auto" with the optimizer state across replicas picks among 1 < F < W (the planner's
    "+OptR" plans): at W = 4 that is F = 2, although F = 1 fits the budget."""
    for out in run_distributed(auto_worker, 4, timeout=60):
        assert out["sizes"] == [(2, 2)], out
        assert "F=2 (HYBRID_SHARD+OptR)" in out["why"], out["why"]


def refused_worker(rank: int, world: int, kwargs: dict) -> str:
    try:
        build("odd_mlp", kwargs.pop("strategy"), shard_optimizer_across_replicas=True, **kwargs)
    except (ValueError, flatshard.NotBuiltError) as exc:
        return f"{type(exc).__name__}: {exc}"
    return "accepted"


@pytest.mark.parametrize(
    "kwargs, expect",
    [
        ({"strategy": "FULL_SHARD"}, "ValueError: shard_optimizer_across_replicas=True splits a hybrid"),
        ({"strategy": "HYBRID_SHARD", "sharding_factor": 4}, "ValueError: shard_optimizer_across_replicas=True"),
        (
            {"strategy": "HYBRID_SHARD", "sharding_factor": 2, "shard_boundaries": "rows"},
            "NotBuiltError: shard_optimizer_across_replicas=True is not built with shard_boundaries='rows'",
        ),
    ],
)
def test_combinations_it_cannot_serve_are_refused_alike(kwargs, expect):
    messages = run_distributed(functools.partial(refused_worker, kwargs=kwargs), 4, timeout=60)
    assert len(set(messages)) == 1 and messages[0].startswith(expect), messages
