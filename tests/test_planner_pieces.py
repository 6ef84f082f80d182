"""The planner's optimizer state across replicas (PlanInputs.optimizer_across_replicas, the "+OptR" plans):
hand-computed memory, bytes, crossing bytes and step schedule ([Note: planner memory model], [Note: planner
communication model], [Note: planner step schedule]); which plans have it, the table, the JSON and the
recommendation; and against the engine's shard_optimizer_across_replicas=True at W = 4, F = 2, one spawn:
every rank's steady bytes equal the planner's for its owner rank (rank 0's the planner's ``steady``), the
bytes and calls of every collective by phase and group equal the planner's (``CommEstimate.by_collective``),
and the measured peak is at most the planner's and at least 95% of it (the planner's peak is what a rank
must have free; the recorder samples at unit transitions), on one node and as two nodes of two ranks, where the
reduce-scatters across replicas stay in flight to the end of backward (and the planner counts what they
hold). In the style of tests/test_planner_engine.py: AdamW, zero_grad(set_to_none=False), the third step
measured."""

from __future__ import annotations

import json

import pytest
import torch

import flatshard
from flatshard.planner import Links, PlanError, PlanInputs, notes, plan, plan_strategy
from flatshard.planner.cli import main as plan_main
from tests.helpers.cases import third_step
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

T = 999  # elements of each unit: pieces of ceil(999 / 4) = 250 at W = 4, the last owner's holding 249
B = 4  # fp32


def inputs(**kw) -> PlanInputs:
    """W = 4 as 2 nodes of 2 (replicate groups {0, 2}, {1, 3} cross), two units of T, no root, AdamW."""
    kw = {"unit_elements": (T, T), "gpus_per_node": 2, "optimizer_across_replicas": True, **kw}
    return PlanInputs(world_size=4, **kw)


# ------------------------------------------------------------------ memory
def test_memory_parameters_1_over_F_gradients_and_optimizer_state_1_over_W():
    p = plan_strategy(inputs(), "HYBRID_SHARD", 2)
    plain = plan_strategy(inputs(optimizer_across_replicas=False), "HYBRID_SHARD", 2)
    assert p.optimizer_across_replicas and p.label == "HYBRID_SHARD+OptR" and plain.label == "HYBRID_SHARD"
    m = p.memory  # flat shard S = R * 250 = 500 per unit (padded to W * 250 = 1000), piece 250
    assert (m.params, m.grads, m.optimizer, m.steady) == (2 * 500 * B, 2 * 250 * B, 2 * 250 * 8, 10_000)
    assert plain.memory.steady == 2 * 500 * 16  # 16 bytes per shard element
    assert m.steady_per_rank == (10_000, 10_000, 10_000, 10_000 - 2 * 8)  # owner 3's pieces hold 249 elements
    # backward at the first unit (forward order), the second's reduce-scatter across replicas in flight to the
    # end of backward: its S + P = 750 elements held beside the gathered unit and its gradient (1000 + 1000)
    assert m.held_reductions == 2 * 750 * B and m.backward_peak == 10_000 + (1000 + 1000 + 750) * B
    assert m.forward_peak == 10_000 + 1000 * B and m.peak == m.backward_peak
    # on one node (or without inter_node_in_flight) each is finished before the next unit: nothing held
    for other in (inputs(gpus_per_node=4), inputs(inter_node_in_flight=False)):
        q = plan_strategy(other, "HYBRID_SHARD", 2).memory
        assert q.held_reductions == 0 and q.peak == 10_000 + 2000 * B
    # _HYBRID_SHARD_ZERO2: every unit gathered by the end of forward; the second unit's backward holds both
    # gathered and its gradient (3000 elements), the first unit's then its own two and the second's 750 in flight
    z = plan_strategy(inputs(), "_HYBRID_SHARD_ZERO2", 2).memory
    assert z.steady == 10_000 and z.backward_peak == 10_000 + max(2000 + 1000, 1000 + 1000 + 750) * B
    z3 = plan_strategy(inputs(unit_elements=(T, T, T)), "_HYBRID_SHARD_ZERO2", 2).memory
    assert z3.backward_peak == 15_000 + max(3000 + 1000, 2000 + 1000 + 750, 1000 + 1000 + 2 * 750) * B


def test_pieces_cut_as_the_engine_lays_them_out():
    """S = R * ceil(T / W), which can exceed ceil(T / F): T = 5 at W = 4, F = 2 is pieces of 2 and flat shards of 4
    (not 3), the unsharded flat 8 elements (FlatLayout(..., replicas=R))."""
    p = plan_strategy(PlanInputs(world_size=4, unit_elements=(5,), optimizer_across_replicas=True), "HYBRID_SHARD", 2)
    assert p.memory.params == 4 * B and p.memory.grads == 2 * B and p.memory.gather_buffer == 8 * B
    assert p.comm.by_collective["forward/all_gather/shard"] == (1, 4 * B)


# ------------------------------------------------------------------ communication
def test_bytes_by_group_and_phase_and_what_crosses():
    c = plan_strategy(inputs(exchange="direct"), "HYBRID_SHARD", 2).comm
    plain = plan_strategy(inputs(exchange="direct", optimizer_across_replicas=False), "HYBRID_SHARD", 2).comm
    assert c.by_collective == {
        "forward/all_gather/shard": (2, 2 * 500 * B),
        "backward/all_gather/shard": (2, 2 * 500 * B),
        "backward/reduce_scatter/shard": (2, 2 * 500 * B),
        "backward/reduce_scatter/replicate": (2, 2 * 250 * B),  # (R - 1) P per unit, reduce dtype
        "forward/all_gather/replicate": (2, 2 * 250 * B),  # (R - 1) P per unit, master dtype
    }
    assert plain.by_collective["backward/all_reduce/replicate"] == (2, 2 * 500 * B)  # 2 (R - 1) / R S
    assert (c.all_gather, c.reduce_scatter, c.all_reduce) == (5000 * B // 2, 3000 * B // 2, 0)
    assert (c.counts.all_gather_forward, c.counts.all_gather_backward) == (4, 2)
    assert (c.counts.reduce_scatter_backward, c.counts.all_reduce_backward) == (4, 0)
    # the same bytes cross as the all-reduce's, half of them in the next forward; the shard groups stay inside
    assert c.total == plain.total and c.node_link == plain.node_link == 4 * 2 * 250 * B
    assert c.inter_node == 4 * 250 * B and c.intra_node == c.total - c.inter_node
    ring = plan_strategy(inputs(), "HYBRID_SHARD", 2).comm  # a ring of 2: the same hop, one chunk
    assert ring.node_link == c.node_link and ring.inter_node == c.inter_node


def test_a_piece_collective_on_a_shared_link():
    """One replicate reduce-scatter (or pieces' all-gather) over {0, 2}: one chunk of P bytes crosses per rank,
    two per node: alpha + max(P / inter_bw, 2 P / node_bw)."""
    for node_bw, slowest in ((None, 1.0), (1500.0, 2 * 1000 / 1500)):
        links = Links(intra_bandwidth=1e18, inter_bandwidth=1000, inter_latency_s=0.25, inter_node_bandwidth=node_bw)
        c = plan_strategy(inputs(unit_elements=(1000, 1000), links=links, exchange="direct"), "HYBRID_SHARD", 2).comm
        assert c.units[0].all_reduce_s == pytest.approx(0.25 + slowest)
        assert c.units[0].pieces_gather_s == pytest.approx(0.25 + slowest)
        assert c.first_forward_s == pytest.approx(c.units[0].all_gather_s + c.units[0].pieces_gather_s)


# ------------------------------------------------------------------ step schedule
def test_step_schedule():
    """Two units of 1000 elements, links that make each collective inside a node free and each piece collective
    1 s (the all-reduce 2 s); compute 1 s forward, 2 s backward; optimizer 0.4 s for the whole model."""
    links = Links(intra_bandwidth=1e18, inter_bandwidth=1000, intra_latency_s=0, inter_latency_s=0)
    kw = dict(unit_elements=(1000, 1000), links=links, exchange="direct", compute_time_s=3.0, optimizer_time_s=0.4)
    t = plan_strategy(inputs(**kw), "HYBRID_SHARD", 2).time
    plain = plan_strategy(inputs(optimizer_across_replicas=False, **kw), "HYBRID_SHARD", 2).time
    # a rank steps 1/W of the model, not 1/F
    assert (t.optimizer_s, plain.optimizer_s) == pytest.approx((0.1, 0.2))
    # forward: both pieces' all-gathers issued at once, done at 1 s and 2 s; unit 0 waits to 1 s, computes to 1.5,
    # unit 1 waits to 2 s, computes to 2.5; backward: unit 1 computes to 3.5 and leaves its reduce-scatter across
    # replicas on the link (to 4.5), unit 0 computes to 4.5 and leaves its own (to 5.5)
    assert t.scheduled_s == pytest.approx(5.5 + 0.1) and t.expected_s == t.scheduled_s
    assert plain.scheduled_s == pytest.approx(1.0 + 1.0 + 1.0 + 2.0 + 2.0 - 1.0 + 0.2)  # all-reduces to 6 s
    assert t.serial_s == pytest.approx(3.0 + 4.0 + 0.1) and plain.serial_s == pytest.approx(3.0 + 4.0 + 0.2)
    # without inter_node_in_flight backward is serial, the pieces' all-gathers still overlap forward
    off = plan_strategy(inputs(inter_node_in_flight=False, **kw), "HYBRID_SHARD", 2).time
    assert off.scheduled_s == pytest.approx(2.5 + 4.0 + 0.1)
    # prefetch: forward = the root-less first unit's pieces and gather (1 s) + max(compute 1, the rest 1)
    d1 = plan_strategy(inputs(prefetch_depth=1, **kw), "HYBRID_SHARD", 2).time
    assert d1.expected_s == d1.overlapped_s == pytest.approx(2.0 + 1.0 + 2.0 + 0.1)


# ------------------------------------------------------------------ plans, table, JSON, recommendation
def test_plan_lists_the_OptR_plans_beside_the_plain_ones():
    r = plan(PlanInputs.from_params(8 * 10**9, 32, 8, gpus_per_node=4, optimizer_across_replicas=True))
    assert [p.label for p in r.plans if p.sharding_factor == 4] == [
        "HYBRID_SHARD",
        "_HYBRID_SHARD_ZERO2",
        "HYBRID_SHARD+OptR",
        "_HYBRID_SHARD_ZERO2+OptR",
    ]
    assert not any(p.optimizer_across_replicas for p in r.plans if p.sharding_factor in (1, 8))
    assert r.plan_for("HYBRID_SHARD", 4).memory.steady == 16 * 2 * 10**9
    assert r.plan_for("HYBRID_SHARD", 4, optimizer_across_replicas=True).memory.steady == 2 * 10**9 * 4 + 10**9 * 12
    # plan_strategy follows the field for a hybrid at 1 < F < W only; off, every figure is as before
    assert plan_strategy(r.inputs, "FULL_SHARD", 8) == plan_strategy(
        r.inputs.replace(optimizer_across_replicas=False), "FULL_SHARD", 8
    )
    assert plan(r.inputs.replace(optimizer_across_replicas=False)).plans == tuple(
        p for p in r.plans if not p.optimizer_across_replicas
    )


def test_the_recommendation_takes_an_OptR_plan_and_says_why():
    """40 GB, 7B on one node of 16 ranks: at F = 2 only HYBRID_SHARD+OptR fits (the plain hybrid holds 16 bytes
    per element of P/2), so F = 2 is the smallest F that fits."""
    base = PlanInputs.from_params(
        7 * 10**9, 32, 16, gpus_per_node=16, device_memory_bytes=40 * 10**9, optimizer_across_replicas=True
    )
    rec = plan(base).recommendation
    assert (rec.strategy.value, rec.sharding_factor, rec.optimizer_across_replicas) == ("HYBRID_SHARD", 2, True)
    assert "HYBRID_SHARD+OptR peaks at" in rec.why and "shard_optimizer_across_replicas=True" in rec.why
    assert "than HYBRID_SHARD, which peaks at" in rec.why and "does not fit" in rec.why
    without = plan(base.replace(optimizer_across_replicas=False)).recommendation
    assert without.sharding_factor == 4 and not without.optimizer_across_replicas
    # F = W only: no +OptR plan, and the why says so
    full = plan(base.replace(device_memory_bytes=20 * 10**9, sharding_factors=(16,))).recommendation
    assert "no +OptR plan at F=16" in full.why


def test_cli_rows_and_json(capsys):
    args = ["--params", "7B", "--units", "32", "--world", "16", "--gpu-mem", "40GB", "--optimizer-across-replicas"]
    assert plan_main(args) == 0
    out = capsys.readouterr().out
    assert "HYBRID_SHARD+OptR" in out and "_HYBRID_SHARD_ZERO2+OptR" in out and "note: +OptR:" in out
    assert plan_main([*args, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["inputs"]["optimizer_across_replicas"] is True and doc["recommendation"]["optimizer_across_replicas"]
    optr = [p for p in doc["plans"] if p["optimizer_across_replicas"]]
    assert {(p["strategy"], p["sharding_factor"]) for p in optr} == {
        (s, f) for s in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") for f in (2, 4, 8)
    }
    for p in optr:
        by = p["comm_bytes_by_collective"]
        assert "backward/all_reduce/replicate" not in by and p["comm_bytes_per_step"]["all_reduce"] == 0
        assert by["backward/reduce_scatter/replicate"] == by["forward/all_gather/replicate"]  # fp32: equal bytes
    # with --offload the +OptR plans have none (not built together), and the offload recommendation skips them
    assert plan_main([*args, "--json", "--offload"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert all((p["offload"] is None) == p["optimizer_across_replicas"] for p in doc["plans"])
    assert "+OptR" not in doc["offload_recommendation"]["why"]
    # without the flag: no new keys
    assert plan_main(args[:-1] + ["--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (
        "optimizer_across_replicas" not in doc["plans"][0] and "optimizer_across_replicas" not in doc["recommendation"]
    )


def test_auto_chooses_among_the_hybrid_factors_only():
    """choose_sharding_factor (sharding_factor="auto") with the optimizer state across replicas picks among
    1 < F < W, the plans that have it; where W has no such F it says so."""
    from flatshard.planner import choose_sharding_factor

    wide = PlanInputs(world_size=8, unit_elements=(T, T), gpus_per_node=4, optimizer_across_replicas=True)
    f, why = choose_sharding_factor(wide.replace(device_memory_bytes=10**9, headroom=0.0))
    assert f == 2 and why.startswith("F=2 (HYBRID_SHARD+OptR) is the smallest"), why
    # a budget only F = 4 fits: F = 8 (FULL_SHARD) would fit too, but it is not a hybrid
    f4 = plan_strategy(wide, "HYBRID_SHARD", 4).memory.peak
    f2 = plan_strategy(wide, "HYBRID_SHARD", 2).memory.peak
    assert f4 < f2
    f, why = choose_sharding_factor(wide.replace(device_memory_bytes=f4, headroom=0.0))
    assert f == 4 and "F=4 (HYBRID_SHARD+OptR)" in why, why
    z4 = plan_strategy(wide, "_HYBRID_SHARD_ZERO2", 4).memory.peak
    assert z4 < plan_strategy(wide, "_HYBRID_SHARD_ZERO2", 2).memory.peak
    f, why = choose_sharding_factor(wide.replace(device_memory_bytes=z4, headroom=0.0), reshard_after_forward=False)
    assert f == 4 and "F=4 (_HYBRID_SHARD_ZERO2+OptR)" in why, why
    with pytest.raises(PlanError, match=r"optimizer_across_replicas needs 1 < F < W; W=2 has no such F"):
        choose_sharding_factor(PlanInputs(world_size=2, unit_elements=(T,), optimizer_across_replicas=True))


def test_refused_where_the_engine_refuses():
    with pytest.raises(PlanError, match="shard_boundaries='rows'"):
        inputs(shard_boundaries="rows")
    assert (
        plan_main(["--params", "1B", "--world", "4", "--optimizer-across-replicas", "--shard-boundaries", "rows"]) == 2
    )
    # no hybrid F at W = 2: the plans are the plain ones, and a note says why there is no +OptR plan
    r = plan(PlanInputs(world_size=2, unit_elements=(T,), optimizer_across_replicas=True))
    assert not any(p.optimizer_across_replicas for p in r.plans)
    assert any(n.startswith("no +OptR plan") for n in notes(r.inputs))


CONFIGS = [(s, nodes) for s in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") for nodes in (1, 2)]


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=61, dim=24, heads=2, layers=3, block=8)


def pieces_worker(rank: int, world: int) -> list:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.planner import PlanInputs, plan_strategy
    from flatshard.wrap import ModuleWrapPolicy

    rows = []
    for strategy, nodes in CONFIGS:
        per_node = world // nodes
        model = FSDP(
            _gpt(),
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_factor=2,
            shard_optimizer_across_replicas=True,
            ranks_per_node=per_node,
            backward_prefetch=None,
        )
        # the third step: its forward gathers the pieces the second step's optimizer wrote
        mem, now, rec = third_step(model, rank)
        inputs = PlanInputs.from_module(
            _gpt(), [Block], world, gpus_per_node=per_node, headroom=0.0, optimizer_across_replicas=True
        )
        planned = plan_strategy(inputs, strategy, 2)
        unit = flatshard.units(model)[0]
        owner = unit.shard_rank * unit.replicate_size + unit.replicate_rank
        measured = {k: (v["count"], v["wire_bytes"]) for k, v in rec.summary().items() if "order_check" not in k}
        rows.append(
            {
                "config": (strategy, nodes),
                "across": planned.optimizer_across_replicas,
                "steady": now["params"] + now["grads"] + now["optimizer"],
                "planned_steady": planned.memory.steady_per_rank[owner],
                "largest_steady": planned.memory.steady,
                "peak": (mem.peak_total, planned.memory.peak),
                "held": planned.memory.held_reductions,
                "collectives": (measured, dict(planned.comm.by_collective)),
                "totals": {
                    k: (rec.wire_bytes(k), float(getattr(planned.comm, k)))
                    for k in ("all_gather", "reduce_scatter", "all_reduce")
                },
            }
        )
    return rows


def test_planned_bytes_equal_the_engines():
    results = run_distributed(pieces_worker, 4, timeout=300)
    for k, config in enumerate(CONFIGS):
        mine = [r[k] for r in results]
        what = f"W=4 F=2 {config}"
        for rank, row in enumerate(mine):
            assert row["across"], what
            assert row["steady"] == row["planned_steady"], (what, rank, row["steady"], row["planned_steady"])
            measured, planned = row["collectives"]
            assert measured == planned, (what, rank, measured, planned)
            for kind, (m, p) in row["totals"].items():
                assert m == p, (what, rank, kind, m, p)
        assert mine[0]["steady"] == mine[0]["largest_steady"], what  # rank 0 owns the fullest pieces
        # in flight across nodes the planner counts the reduce-scatters' buffers; on one node nothing is held
        assert (mine[0]["held"] > 0) == (config[1] == 2), (what, mine[0]["held"])
        peak, predicted = max(m["peak"][0] for m in mine), mine[0]["peak"][1]
        print(f"{what}: peak measured {peak} predicted {predicted} ({peak / predicted:.3f})")
        assert 0.95 * predicted <= peak <= predicted, f"{what}: peak measured {peak} predicted {predicted}"
