"""The planner's link model ([Note: planner communication model]) and step schedule ([Note: planner step
schedule]): the time and the crossing bytes of each collective, ring and direct, with a NIC per rank and
with one link per node; what the engine leaves in flight; the optimizer step; sharding_factor="auto" by
time; and the flags of ``flatshard plan`` that set them. All in-process, by hand-computed figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flatshard.planner import (
    Links,
    PlanError,
    PlanInputs,
    choose_sharding_factor,
    links_from_calibration,
    plan_strategy,
    read_calibration,
)
from flatshard.planner.cli import main as plan_main
from flatshard.planner.comm import spread

ROOT = Path(__file__).resolve().parents[1]
T = 1000  # elements of each unit in the hand-computed cases (fp32: 4 bytes each)


def inputs(world=4, g=2, units=(T, T), **kw) -> PlanInputs:
    return PlanInputs(world_size=world, unit_elements=units, gpus_per_node=g, **kw)


# ------------------------------------------------------------------ where the groups lie
def test_spread_of_groups_across_nodes():
    # 2 nodes x 2: the full shard group has 2 ranks on each node; each rank sends 2 chunks off its node
    assert spread(4, 2, 4, replicate=False) == spread(4, 2, 4, False)
    s = spread(4, 2, 4, False)
    assert (s.size, s.link, s.local, s.remote, s.node_sends, s.hops_out) == (4, "inter_node", 2, 2, 4, 1)
    r = spread(4, 2, 2, True)  # replicate groups {0, 2}, {1, 3}: one rank per node, two rings leave each node
    assert (r.size, r.link, r.local, r.remote, r.node_sends, r.hops_out) == (2, "inter_node", 1, 1, 2, 2)
    assert spread(4, 2, 2, False).link == "intra_node" and spread(4, 2, 4, True).link == "none"
    u = spread(12, 6, 4, False)  # groups [0-3] on node 0, [4-7] split 2 + 2, [8-11] on node 1
    assert (u.local, u.remote, u.node_sends, u.hops_out) == (4, 2, 4, 1)


# ------------------------------------------------------------------ one collective
def test_defaults_keep_the_classic_ring_figures():
    """A NIC per rank (inter_node_bandwidth None) and exchange="ring": (n-1) alpha + V / inter_bw."""
    links = Links(intra_bandwidth=100e9, inter_bandwidth=10e9, intra_latency_s=1e-5, inter_latency_s=2e-5)
    p = plan_strategy(inputs(world=16, g=8, units=(8 * T,), links=links), "HYBRID_SHARD", 8)
    v = 2 * 1 * T * 4 / 2  # the 1000-element shard all-reduced over R = 2
    assert p.comm.all_reduce_s == pytest.approx(2 * 2e-5 + v / 10e9, rel=1e-12)
    full = plan_strategy(inputs(world=16, g=8, units=(16 * T,), links=links), "FULL_SHARD", 16).comm
    assert full.first_forward_s == pytest.approx(15 * 2e-5 + 15 * T * 4 / 10e9, rel=1e-12)
    assert full.inter_node == full.total and full.intra_node == 0
    assert full.node_link == 3 * 15 * T * 4 * 1  # one hop of the ring leaves each node, per collective


def test_direct_exchange_across_a_shared_link():
    """FULL_SHARD over 2 nodes x 2, one unit of 4T elements (chunk c = 4T bytes): each rank sends 2 chunks
    off its node and 1 on it; the node's link carries 4 chunks per collective."""
    links = Links(intra_bandwidth=4e9, inter_bandwidth=2e6, intra_latency_s=1e-4, inter_latency_s=1e-3)
    c = T * 4
    for node_bw, slowest in ((None, 2 * c / 2e6), (3e6, 4 * c / 3e6)):
        shared = Links(**{**links.__dict__, "inter_node_bandwidth": node_bw})
        p = plan_strategy(inputs(units=(4 * T,), links=shared, exchange="direct"), "SHARD_GRAD_OP", 4).comm
        assert p.first_forward_s == pytest.approx(3 * 1e-3 + c / 4e9 + slowest)
        assert p.backward_s == pytest.approx(p.first_forward_s)  # the reduce-scatter moves the same
        assert (p.inter_node, p.intra_node, p.node_link) == (2 * 2 * c, 2 * c, 2 * 4 * c)
        assert p.inter_node + p.intra_node == p.total
    ring = plan_strategy(inputs(units=(4 * T,), links=links), "SHARD_GRAD_OP", 4).comm
    assert ring.node_link == 2 * 3 * c  # a ring leaves each node once: 3 chunks per collective


def test_ring_all_reduce_gets_the_whole_link_when_it_crosses_alone():
    """NO_SHARD over 2 nodes x 2: one ring, one hop leaves each node: V / max(inter_bw, node_bw / 1)."""
    links = Links(intra_bandwidth=1e12, inter_bandwidth=24e3, inter_node_bandwidth=12e3, inter_latency_s=0.0)
    p = plan_strategy(inputs(units=(T,), links=links), "NO_SHARD", 1).comm
    v = 2 * 3 / 4 * T * 4  # 6000 bytes per rank
    assert p.all_reduce_s == pytest.approx(max(v / 24e3, v / 12e3)) and p.node_link == v
    h = plan_strategy(inputs(units=(2 * T,), links=links), "HYBRID_SHARD", 2).comm
    v = 2 * 1 / 2 * T * 4  # the T-element shard over R = 2: two rings leave each node at once
    assert h.all_reduce_s == pytest.approx(2 * v / 12e3) and h.node_link == 2 * v


# ------------------------------------------------------------------ the step
def _half_second_links() -> Links:
    """Links on which NO_SHARD's all-reduce of a T-element unit over 2 x 2 takes 0.5 s exactly."""
    return Links(intra_bandwidth=1e15, inter_bandwidth=12e3, intra_latency_s=0.0, inter_latency_s=0.0)


def test_in_flight_all_reduce_hides_behind_the_rest_of_backward():
    base = inputs(links=_half_second_links(), compute_time_s=3.0)  # forward 1 s, backward 1 s per unit
    on = plan_strategy(base, "NO_SHARD", 1).time
    off = plan_strategy(base.replace(inter_node_in_flight=False), "NO_SHARD", 1).time
    assert off.serial_s == off.expected_s == off.scheduled_s == pytest.approx(3.0 + 2 * 0.5)
    # unit 1: backward 1 -> 2 s, its all-reduce on the link 2 -> 2.5; unit 0: 2 -> 3 s, all-reduce 3 -> 3.5
    assert on.expected_s == on.scheduled_s == pytest.approx(3.5) and on.serial_s == off.serial_s
    slow = plan_strategy(base.replace(compute_time_s=0.3), "NO_SHARD", 1).time  # the link decides
    assert slow.expected_s == pytest.approx(0.1 + 0.1 + 2 * 0.5)  # forward, first unit's backward, the link


def test_in_flight_reduce_scatter_across_nodes():
    links = Links(intra_bandwidth=1e15, inter_bandwidth=4e3, intra_latency_s=0.0, inter_latency_s=0.0)
    base = inputs(units=(4 * T, 4 * T), links=links, compute_time_s=6.0, exchange="direct")
    sgo = plan_strategy(base, "SHARD_GRAD_OP", 4)
    a = sgo.comm.first_forward_s  # 2 chunks of 4000 bytes per rank across at 4 kB/s: 2 s per collective
    assert a == pytest.approx(2.0)
    # forward 2 + 2 x 2; unit 1 backward 2 s, its reduce-scatter in flight for 2 s under unit 0's backward
    assert sgo.time.expected_s == pytest.approx(6 + 2 * 2 + 2)
    assert sgo.time.serial_s == pytest.approx(6 + 4 * 2)
    full = plan_strategy(base, "FULL_SHARD", 4).time  # the next gather waits for the link: no gain
    assert full.expected_s == pytest.approx(full.serial_s)


def test_one_node_is_serial_and_the_optimizer_counts_per_shard():
    base = PlanInputs(world_size=8, unit_elements=(8 * T,), compute_time_s=1.0, optimizer_time_s=0.8)
    for s, f in (("NO_SHARD", 1), ("HYBRID_SHARD", 2), ("FULL_SHARD", 8)):
        t = plan_strategy(base, s, f).time
        assert t.optimizer_s == pytest.approx(0.8 / f) and t.expected_s == t.serial_s == t.scheduled_s
        assert t.serial_s == pytest.approx(1.0 + t.comm_s + 0.8 / f)
    p = plan_strategy(base, "FULL_SHARD", 8)
    o = p.offload  # with CPU offload the CPU steps instead of the device
    assert o.step_time_s == pytest.approx(p.time.expected_s - p.time.optimizer_s + o.copy_s + o.optimizer_s)


def test_bad_link_inputs_say_how_to_fix():
    with pytest.raises(PlanError, match="inter_node_bandwidth must be positive"):
        Links(inter_node_bandwidth=0)
    with pytest.raises(PlanError, match="unknown exchange 'tree'"):
        inputs(exchange="tree")
    with pytest.raises(PlanError, match="optimizer_time_s must be a positive number") as e:
        inputs(optimizer_time_s=-1.0)
    assert "--optimizer-time" in e.value.fix


# ------------------------------------------------------------------ sharding_factor="auto" by time
def _slow_link_gpt(**kw) -> PlanInputs:
    """The 3M GPT of docs/multi_node.md on 2 nodes x 2 at 200 Mbit/s (its committed calibration)."""
    links, _ = read_calibration(ROOT / "bench" / "results" / "cluster_200mbit.json")
    return PlanInputs(
        world_size=4,
        unit_elements=(789_760,) * 4,
        root_elements=82_432,
        gpus_per_node=2,
        links=links,
        exchange="direct",
        compute_time_s=0.33,
        optimizer_time_s=0.03,
        **kw,
    )


def test_auto_by_time_picks_the_fastest_that_fits():
    everything = _slow_link_gpt(device_memory_bytes=10**9)
    f, why = choose_sharding_factor(everything)
    assert f == 1 and "smallest sharding factor" in why and "step time not considered (no link figures)" in why
    f, why = choose_sharding_factor(everything, by_time=True)
    assert f == 2, why  # NO_SHARD fits too, but its all-reduce over the slow link takes longer
    assert why.startswith("F=2 (HYBRID_SHARD): predicted ") and "per step, the fastest of those that fit (" in why
    assert "F=1 NO_SHARD" in why and "F=4 FULL_SHARD" in why and "fits in 900 MB" in why
    assert "direct all-gathers and reduce-scatters" in why and "compute not known" not in why
    peaks = {p: plan_strategy(everything, s, p).memory.peak for s, p in (("HYBRID_SHARD", 2), ("FULL_SHARD", 4))}
    tight = everything.replace(device_memory_bytes=(peaks[2] + peaks[4]) // 2, headroom=0.0)
    f, why = choose_sharding_factor(tight, by_time=True)
    assert f == 4 and "the only one that fits" in why and "F=1 peaks at" in why and "F=2 peaks at" in why
    nothing = everything.replace(device_memory_bytes=1000)
    assert choose_sharding_factor(nothing, by_time=True)[1].startswith("nothing fits")
    unknown = everything.replace(compute_time_s=None, optimizer_time_s=None)
    assert "compute not known: the times are communication only" in choose_sharding_factor(unknown, by_time=True)[1]


# ------------------------------------------------------------------ calibration and CLI
def test_links_from_a_calibration():
    doc = json.loads((ROOT / "bench" / "results" / "cluster_1gbit.json").read_text())
    links, g = links_from_calibration(doc)
    cal = doc["result"]["calibration"]["links"]
    assert g == 2 and links.inter_bandwidth == cal["inter, one flow"]["bandwidth_Bps"]
    assert links.inter_node_bandwidth == 2 * cal["inter"]["bandwidth_Bps"]
    assert (links.intra_bandwidth, links.inter_latency_s) == (cal["intra"]["bandwidth_Bps"], cal["inter"]["latency_s"])
    assert links_from_calibration(doc["result"]["calibration"], 2) == (links, 2)
    with pytest.raises(PlanError, match="does not say how many ranks share a node"):
        links_from_calibration(doc["result"]["calibration"])
    with pytest.raises(PlanError, match="no measured links"):
        links_from_calibration({"compute": {}}, 2)


def _json(argv: list[str], capsys) -> dict:
    assert plan_main([*argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_link_flags(capsys):
    base = ["--params", "3.24M", "--units", "4", "--world", "4", "--gpus-per-node", "2", "--compute-time", "0.3"]
    doc = _json(base, capsys)
    assert doc["inputs"]["exchange"] == "ring" and doc["inputs"]["inter_node_in_flight"] is True
    assert doc["inputs"]["links"]["inter_node_bandwidth"] is None and doc["inputs"]["optimizer_time_s"] is None
    flags = ["--inter-bw", "1Gb/s", "--inter-node-bw", "100MB/s", "--exchange", "direct", "--optimizer-time", "0.04"]
    doc = _json([*base, *flags], capsys)
    assert doc["inputs"]["links"]["inter_bandwidth"] == 125e6 and doc["inputs"]["links"]["inter_node_bandwidth"] == 1e8
    assert doc["inputs"]["exchange"] == "direct" and doc["inputs"]["optimizer_time_s"] == 0.04
    full = [p for p in doc["plans"] if p["strategy"] == "FULL_SHARD"][0]
    assert full["comm_bytes_per_step"]["node_link"] > 0
    off = _json([*base, *flags, "--no-inter-node-in-flight"], capsys)
    assert off["inputs"]["inter_node_in_flight"] is False
    no = [[p["step_time_s"] for p in d["plans"] if p["strategy"] == "NO_SHARD"][0] for d in (doc, off)]
    assert no[0] < no[1]  # NO_SHARD's all-reduce across nodes in flight
    cal = ROOT / "bench" / "results" / "cluster_200mbit.json"
    doc = _json([*base, "--calibration", str(cal), "--exchange", "direct"], capsys)
    assert doc["inputs"]["links"] == read_calibration(cal)[0].__dict__


@pytest.mark.parametrize(
    "extra,message",
    [
        (["--calibration", "bench/results/cluster_1gbit.json", "--inter-bw", "1GB/s"], "--calibration and --inter-bw"),
        (["--calibration", "/nonexistent.json"], "cannot read the calibration"),
        (["--inter-node-bw", "0GB/s"], "must be positive"),
        (["--exchange", "tree"], "invalid choice: 'tree'"),
        (["--optimizer-time", "-1"], "optimizer_time_s must be a positive number"),
    ],
)
def test_cli_link_errors(extra, message, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert plan_main(["--params", "7B", "--units", "32", "--world", "8", *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "fix:" in err, err
