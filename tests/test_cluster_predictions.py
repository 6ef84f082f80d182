"""The planner against the committed measurements of the emulated cluster (docs/multi_node.md), offline:
bench/cluster_predict.py recomputes every prediction from a committed run's calibration with today's
planner, and the verdicts of issue 15 are asserted here (no root, no network: the figures are in the
JSONs). cluster_<rate>.json has its own link calibration and ran the engine before
inter_node_in_flight; slow_link_<rate>.json ran in flight off and on, with the links of cluster_<rate>.json
and its own compute figures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import cluster_predict  # noqa: E402

# The one prediction that is not within 25%, and why (docs/multi_node.md, "What the planner still misses"):
# in that run HYBRID_SHARD measured 476 ms, where compute + optimizer + the calibration's own measured
# collectives add up to 0.75 of it; the same code measured 375-476 ms over three runs.
KNOWN_MISSES = {("cluster", "1gbit", "flatshard HYBRID_SHARD F=2"): (0.70, 0.75)}
# Pairs ordered the other way from one run's measurement although they measured more than 5% apart, and why:
# HYBRID_SHARD and _HYBRID_SHARD_ZERO2 (predicted within 2% of each other) measured 10% apart one way in
# the committed run and 20% the other way in the run before it (docs/multi_node.md).
KNOWN_ORDER = {("slow_link", "1gbit"): [{"flatshard HYBRID_SHARD F=2", "flatshard _HYBRID_SHARD_ZERO2 F=2"}]}


@pytest.fixture(scope="module", params=[(k, r) for k in ("cluster", "slow_link") for r in ("1gbit", "200mbit")])
def run(request):
    kind, rate = request.param
    return kind, rate, cluster_predict.committed(rate, kind)


def test_every_prediction_within_25_percent(run):
    kind, rate, prediction = run
    judged = {n: r for n, r in prediction["rows"].items() if r["modelled"]}
    assert len(judged) >= 5
    for name, row in judged.items():
        ratio = row["predicted_s"] / row["measured_s"]
        low, high = KNOWN_MISSES.get((kind, rate, name), (1 - cluster_predict.TOLERANCE, 1 + cluster_predict.TOLERANCE))
        assert low <= ratio <= high, (kind, rate, name, ratio)


def test_the_planner_ranks_flatshards_systems_in_the_measured_order(run):
    kind, rate, prediction = run
    allowed = KNOWN_ORDER.get((kind, rate), [])
    for m in prediction["verdicts"]["misordered_pairs"]:
        assert m["measured_gap"] <= cluster_predict.TIE or set(m["pair"]) in allowed, (kind, rate, m)


@pytest.mark.parametrize("rate", ["1gbit", "200mbit"])
def test_in_flight_is_predicted_as_much_faster_as_measured(rate):
    """The step with inter_node_in_flight over the step without, where the all-reduce across replicas
    crosses (hybrid, NO_SHARD): predicted within 0.1 of the measured ratio (0.77-0.90 measured)."""
    rows = cluster_predict.committed(rate, "slow_link")["rows"]
    for name in ("flatshard HYBRID_SHARD F=2", "flatshard NO_SHARD"):
        on, off = rows[name], rows[f"{name}, in flight off"]
        measured, predicted = on["measured_s"] / off["measured_s"], on["predicted_s"] / off["predicted_s"]
        assert predicted < 1 and abs(predicted - measured) <= 0.1, (rate, name, measured, predicted)


def test_the_table_and_summary_print(capsys):
    assert cluster_predict.main() == 0
    out = capsys.readouterr().out
    assert out.count("| system | measured ms |") == 4 and "within 25%: 5/5" in out


def test_a_run_with_the_optimizer_across_replicas_is_predicted_by_its_plan():
    """bench/slow_link.py's "flatshard HYBRID_SHARD F=2, optimizer across replicas" (no committed run has it
    yet): predicted by the planner's "+OptR" plan, judged with flatshard's systems, printed in the table."""
    import copy
    import json

    from flatshard.planner import plan_strategy

    base = json.loads((cluster_predict.RESULTS / "slow_link_1gbit.json").read_text())["result"]
    links_from = json.loads((cluster_predict.RESULTS / "cluster_1gbit.json").read_text())["result"]
    result = copy.deepcopy(base)
    plain, name = "flatshard HYBRID_SHARD F=2", f"flatshard HYBRID_SHARD F=2, {cluster_predict.PIECES}"
    result["systems"][name] = dict(result["systems"][plain])  # a stand-in measurement
    prediction = cluster_predict.predict(result, links_from=links_from)
    row, other = prediction["rows"][name], prediction["rows"][plain]
    assert row["modelled"] and row["optimizer_across_replicas"] and not other["optimizer_across_replicas"]
    assert row["planned_as"] == ["HYBRID_SHARD", 2, cluster_predict.PIECES]
    inputs = cluster_predict.planner_inputs(result, links_from=links_from, across=True)
    assert row["predicted_s"] == plan_strategy(inputs, "HYBRID_SHARD", 2).time.expected_s != other["predicted_s"]
    assert row["planner_node_link_bytes"] == other["planner_node_link_bytes"]  # the same bytes cross, moved apart
    assert name in prediction["verdicts"]["within_25_percent"] and name in prediction["verdicts"]["predicted_order"]
    assert any(
        line.startswith(f"| {name} |") and "not modelled" not in line for line in cluster_predict.table(prediction)
    )
    # the committed runs do not have it: nothing changes there
    assert not any(cluster_predict.across_replicas(n) for n in cluster_predict.committed("1gbit", "slow_link")["rows"])
