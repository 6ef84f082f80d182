"""The planner against the committed measurements of the emulated cluster (docs/multi_node.md), offline:
bench/cluster/predict.py recomputes every prediction from a committed run's calibration with today's
planner, and the verdicts of issue 15 are asserted here (no root, no network: the figures are in the
JSONs). cluster_<rate>.json has its own link calibration (the engine as of 1cb07e0, in flight on);
slow_link_<rate>.json ran in flight off and on, with the links of cluster_<rate>.json and its own compute
figures."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from bench.cluster import predict as cluster_predict

ROOT = Path(__file__).resolve().parents[1]
RUNS = [(k, r) for k in ("cluster", "slow_link") for r in ("1gbit", "200mbit")]

# The predictions that are not within 25%, named, and why (docs/multi_node.md, "Verdicts"): none in the
# committed runs. Earlier runs missed by steps predicted too fast, of two kinds, and the two lowest ratios at
# each rate of the committed runs are still of one kind each (test below):
# * IN_FLIGHT: at 1 Gbit/s the all-reduce across nodes of a system with a replicate group spanning the nodes
#   (hybrid, NO_SHARD) is left in flight while backward computes, and the planner counts that time as
#   hidden; on 2 shared cores gloo's threads and the kernel's TCP take CPU time from compute, which the
#   planner's compute figure (measured without communication) leaves out.
# * SPANNING: at 200 Mbit/s a strategy whose shard group spans both nodes (FULL_SHARD, SHARD_GRAD_OP) does
#   not keep the link full with its exchanges across; the calibration's one-unit reduce-scatter and
#   all-gather across the nodes, each alone, take longer than the planner's time for them (test below).
# [Note: what a known miss asserts] No band is drawn around a committed ratio: every prediction not named
# here must be within 25%; every one named must be a miss, in the documented direction (predicted below
# measured), of the documented kind. A rerun that turns a miss into a hit, or a new miss, fails, and with
# it the count the documents state (test below).
IN_FLIGHT, SPANNING = "in flight across nodes at 1 Gbit/s", "shard group across nodes at 200 Mbit/s"
KNOWN_MISSES: dict[tuple[str, str, str], str] = {}  # (kind, rate, name): IN_FLIGHT or SPANNING
LOWEST_KIND = {"1gbit": IN_FLIGHT, "200mbit": SPANNING}  # the kind of the two lowest ratios at each rate
# The same effect on the in-flight saving (step in flight over step with it off): predicted within 0.1 of
# the measured ratio but for these, where the planner predicts more saving than measured, as above.
KNOWN_IN_FLIGHT_MISSES = {("1gbit", "flatshard NO_SHARD")}
IN_FLIGHT_BOUND = 0.1
CROSSING_ALL_REDUCE = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2", "NO_SHARD")  # F < W: replicas on both nodes
SPANNING_SHARD_GROUP = ("FULL_SHARD", "SHARD_GRAD_OP")  # F = W: every shard group on both nodes


def _ratio(row: dict) -> float:
    return row["predicted_s"] / row["measured_s"]


def _within(row: dict) -> bool:
    return abs(_ratio(row) - 1) <= cluster_predict.TOLERANCE


def _of_kind(kind: str, rate: str, name: str) -> bool:
    planned = cluster_predict.planned_as(name, 4, 2)  # W = 4, 2 ranks per node: every committed run
    if planned is None:
        return False
    if kind == IN_FLIGHT:
        return rate == "1gbit" and "in flight off" not in name and planned[0] in CROSSING_ALL_REDUCE
    return rate == "200mbit" and planned[0] in SPANNING_SHARD_GROUP


@pytest.fixture(scope="module", params=RUNS)
def run(request):
    kind, rate = request.param
    return kind, rate, cluster_predict.committed(rate, kind)


def test_every_prediction_within_25_percent_but_the_known_misses(run):
    kind, rate, prediction = run
    judged = {n: r for n, r in prediction["rows"].items() if r["modelled"]}
    assert len(judged) >= 5
    for name, row in judged.items():
        if (kind, rate, name) in KNOWN_MISSES:  # [Note: what a known miss asserts]
            assert _ratio(row) < 1 - cluster_predict.TOLERANCE, ("no longer a miss", kind, rate, name, _ratio(row))
            assert _of_kind(KNOWN_MISSES[kind, rate, name], rate, name), ("a miss of another kind", kind, rate, name)
        else:
            assert _within(row), (kind, rate, name, _ratio(row))


def _counts() -> tuple[int, int]:
    """(within 25%, judged) over every committed run: what bench/cluster/predict.py's verdicts add up to."""
    within = judged = 0
    for kind, rate in RUNS:
        verdict = cluster_predict.committed(rate, kind)["verdicts"]["within_25_percent"]
        within, judged = within + sum(verdict.values()), judged + len(verdict)
    return within, judged


def test_the_documents_state_the_count_the_committed_runs_give():
    """docs/planner.md and docs/multi_node.md say "N of M step predictions" for the committed
    runs; N and M are recomputed here, so the sentence cannot drift from the data."""
    within, judged = _counts()
    assert judged - within == len(KNOWN_MISSES)
    for doc in ("docs/planner.md", "docs/multi_node.md"):
        stated = re.findall(r"\b(\d+)\s+of\s+(\d+)\s+step\s+predictions\b", (ROOT / doc).read_text())
        assert stated, f"{doc} no longer states the count"
        assert all((int(a), int(b)) == (within, judged) for a, b in stated), (doc, stated, (within, judged))


def _cell(rows: dict, name: str) -> str:
    if name not in rows:
        return "–"
    return f"{_ratio(rows[name]):.2f}" if _within(rows[name]) else f"**{_ratio(rows[name]):.2f}**"


def test_the_planner_docs_table_is_what_the_committed_runs_give():
    """docs/planner.md's table of predicted / measured, row by row, from the committed runs."""
    runs = {(k, r): cluster_predict.committed(r, k)["rows"] for k, r in RUNS}
    text = (ROOT / "docs/planner.md").read_text()
    for label, name in (
        ("FULL_SHARD (4)", "flatshard FULL_SHARD"),
        ("HYBRID_SHARD (2)", "flatshard HYBRID_SHARD F=2"),
        ("HYBRID_SHARD+OptR (2)", f"flatshard HYBRID_SHARD F=2, {cluster_predict.PIECES}"),
        ("_HYBRID_SHARD_ZERO2 (2)", "flatshard _HYBRID_SHARD_ZERO2 F=2"),
        ("SHARD_GRAD_OP (4)", "flatshard SHARD_GRAD_OP"),
        ("NO_SHARD (1)", "flatshard NO_SHARD"),
        ("no communication", "no communication"),
    ):
        cells = [_cell(runs["cluster", r], name) for r in cluster_predict.RATES]
        for r in cluster_predict.RATES:
            rows, off = runs["slow_link", r], f"{name}, in flight off"
            both = name != "no communication" and (off in rows or name in rows)  # off, on
            cells.append(f"{_cell(rows, off)}, {_cell(rows, name)}" if both else _cell(rows, name))
        line = f"| {label} | {' | '.join(cells)} |"
        assert line in text, f"docs/planner.md lacks: {line}"


def test_the_planner_ranks_flatshards_systems_in_the_measured_order(run):
    kind, rate, prediction = run
    for m in prediction["verdicts"]["misordered_pairs"]:
        assert m["measured_gap"] <= cluster_predict.TIE, (kind, rate, m)


@pytest.mark.parametrize("rate", ["1gbit", "200mbit"])
def test_in_flight_is_predicted_as_much_faster_as_measured(rate):
    """The step with inter_node_in_flight over the step without, where the all-reduce across replicas
    crosses (hybrid, NO_SHARD): predicted below 1 and within 0.1 of the measured ratio, but for the known
    misses, each predicted to save more than measured ([Note: what a known miss asserts])."""
    rows = cluster_predict.committed(rate, "slow_link")["rows"]
    for name in ("flatshard HYBRID_SHARD F=2", "flatshard NO_SHARD"):
        on, off = rows[name], rows[f"{name}, in flight off"]
        measured, predicted = on["measured_s"] / off["measured_s"], on["predicted_s"] / off["predicted_s"]
        assert predicted < 1, (rate, name, predicted)
        if (rate, name) in KNOWN_IN_FLIGHT_MISSES:
            assert predicted < measured - IN_FLIGHT_BOUND, ("no longer a miss", rate, name, measured, predicted)
        else:
            assert abs(predicted - measured) <= IN_FLIGHT_BOUND, (rate, name, measured, predicted)


def test_the_table_and_summary_print(capsys):
    assert cluster_predict.main() == 0
    out = capsys.readouterr().out
    assert out.count("| system | measured ms |") == 4
    for kind, rate in RUNS:
        prediction = cluster_predict.committed(rate, kind)
        assert "\n".join(cluster_predict.table(prediction)) in out and cluster_predict.summary(prediction) in out


def test_the_spanning_collectives_are_slow_in_the_calibration_too():
    """SPANNING: at 200 Mbit/s the calibration's one-unit reduce-scatter and all-gather across the nodes,
    each measured alone, take longer than the planner's time for them, and the documents quote the figures."""
    cal = cluster_predict.committed("200mbit")["collectives"]["reduce_scatter, F=W (spans nodes)"]
    gather = cluster_predict.committed("200mbit")["collectives"]["all_gather, F=W (spans nodes)"]
    measured, planned = cal["measured_s"], cal["predicted_s"]
    assert measured > planned and gather["measured_s"] > gather["predicted_s"]
    multi = " ".join((ROOT / "docs/multi_node.md").read_text().split())
    assert (
        f"one unit's reduce-scatter across the nodes, alone, took {measured * 1e3:.1f} ms where the planner "
        f"gives {planned * 1e3:.1f} ms ({planned / measured:.2f}), its all-gather {gather['measured_s'] * 1e3:.1f} "
        f"ms ({gather['predicted_s'] / gather['measured_s']:.2f})"
    ) in multi
    planner = " ".join((ROOT / "docs/planner.md").read_text().split())
    assert (
        f"one-unit all-gather across the nodes alone takes {gather['measured_s'] / gather['predicted_s']:.2f}× the "
        f"planner's time for it, its reduce-scatter {measured / planned:.2f}×)"
    ) in planner


def _lowest_two(rate: str) -> list[tuple[float, str, str]]:
    """The two lowest predicted / measured of a rate over both committed runs: (ratio, kind, name)."""
    rows = [
        (_ratio(row), kind, name)
        for kind in ("cluster", "slow_link")
        for name, row in cluster_predict.committed(rate, kind)["rows"].items()
        if row["modelled"]
    ]
    return sorted(rows)[:2]


def _lowest_text(rate: str) -> str:
    where = {"cluster": "`make cluster`", "slow_link": "the slow-link run"}

    def what(name: str) -> str:
        return name.removeprefix("flatshard ").replace(" F=2", "").replace(", in flight off", " with in flight off")

    (ra, ka, na), (rb, kb, nb) = _lowest_two(rate)
    if ka == kb:
        return f"{what(na)} at {ra:.2f} and {what(nb)} at {rb:.2f}, both in {where[ka]}"
    return f"{what(na)} at {ra:.2f} in {where[ka]}, {what(nb)} at {rb:.2f} in {where[kb]}"


def test_the_documents_name_the_lowest_predictions():
    """No known miss; the two lowest ratios at each rate are steps predicted too fast, both of the kind
    LOWEST_KIND gives for the rate, and docs/multi_node.md and docs/planner.md name them; and the in-flight
    saving NO_SHARD is predicted at 1 Gbit/s against the measured one."""
    assert not KNOWN_MISSES
    for rate, kind in LOWEST_KIND.items():
        for ratio, run_kind, name in _lowest_two(rate):
            assert ratio < 1, (rate, run_kind, name, ratio)
            assert _of_kind(kind, rate, name), ("a low ratio of another kind", rate, run_kind, name)
    planner = " ".join((ROOT / "docs/planner.md").read_text().split())
    multi = " ".join((ROOT / "docs/multi_node.md").read_text().split())
    for doc in (planner, multi):
        assert "The lowest ratios are steps predicted too fast, and the two lowest at each rate are" in doc
    one, two = _lowest_text("1gbit"), _lowest_text("200mbit")
    assert (
        f"at 1 Gbit/s, systems whose all-reduce across nodes is left in flight while backward computes ({one};"
        in planner
    )
    assert f"at 200 Mbit/s, strategies whose shard group spans both nodes ({two};" in planner
    assert (
        f"*At 1 Gbit/s, systems whose all-reduce across nodes is left in flight while backward computes* ({one}):"
        in multi
    )
    assert f"*At 200 Mbit/s, strategies whose shard group spans both nodes* ({two}):" in multi
    rows = cluster_predict.committed("1gbit", "slow_link")["rows"]
    on, off = rows["flatshard NO_SHARD"], rows["flatshard NO_SHARD, in flight off"]
    assert (
        f"(the step in flight over the step with it off: {on['predicted_s'] / off['predicted_s']:.2f} predicted, "
        f"{on['measured_s'] / off['measured_s']:.2f} measured)"
    ) in multi


def test_the_planner_page_says_where_the_runs_were_measured():
    """docs/planner.md's table comes from four files: one commit, one machine, one day, and their loads."""
    from bench.tables import measured_at

    docs = [json.loads((cluster_predict.RESULTS / f"{k}_{r}.json").read_text()) for k, r in RUNS]
    (line,) = {measured_at(d).split(", load ")[0] for d in docs}  # commit and machine: one for all four
    (day,) = {d["provenance"]["finished"][:10] for d in docs}
    loads = [d["provenance"][k] for d in docs for k in ("load_1min_before", "load_1min_after")]
    head = line.removeprefix("Measured at ").replace("commit", "The four files were measured at commit", 1)
    planner = " ".join((ROOT / "docs/planner.md").read_text().split())
    assert f"{head}, {day}, at loads from {min(loads):g} to {max(loads):g}" in planner


@pytest.mark.parametrize("rate", ["1gbit", "200mbit"])
def test_the_optimizer_across_replicas_is_predicted_by_its_plan(rate):
    """bench/cluster/slow_link.py's "flatshard HYBRID_SHARD F=2, optimizer across replicas" in the committed runs:
    predicted by the planner's "+OptR" plan, judged with flatshard's systems, printed in the table; the same
    bytes cross the link as HYBRID_SHARD's, measured and planned."""
    import json

    from flatshard.planner import plan_strategy

    plain, name = "flatshard HYBRID_SHARD F=2", f"flatshard HYBRID_SHARD F=2, {cluster_predict.PIECES}"
    prediction = cluster_predict.committed(rate, "slow_link")
    row, other = prediction["rows"][name], prediction["rows"][plain]
    assert row["modelled"] and row["optimizer_across_replicas"] and not other["optimizer_across_replicas"]
    assert row["planned_as"] == ["HYBRID_SHARD", 2, cluster_predict.PIECES]
    result = json.loads((cluster_predict.RESULTS / f"slow_link_{rate}.json").read_text())["result"]
    links_from = json.loads((cluster_predict.RESULTS / f"cluster_{rate}.json").read_text())["result"]
    inputs = cluster_predict.planner_inputs(result, links_from=links_from, across=True)
    assert row["predicted_s"] == plan_strategy(inputs, "HYBRID_SHARD", 2).time.expected_s != other["predicted_s"]
    assert row["planner_node_link_bytes"] == other["planner_node_link_bytes"]  # the same bytes cross, moved apart
    link = result["link_tx_bytes_per_step_per_node"]
    assert max(link[name]) == pytest.approx(max(link[plain]), rel=0.02)  # and so they did, by the kernel's count
    assert name in prediction["verdicts"]["predicted_order"]
    assert any(
        line.startswith(f"| {name} |") and "not modelled" not in line for line in cluster_predict.table(prediction)
    )
