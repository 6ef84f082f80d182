"""docs/multi_node.md's "FSDP2's HSDP as a user runs it" against the committed bench/cluster/hsdp.py runs:
its tables are the files' tables, and each sentence of "What the figures say" holds for every run."""

import json
from pathlib import Path

import pytest

from bench.cluster import hsdp as cluster_hsdp

ROOT = Path(__file__).resolve().parents[1]

FILES = ("cluster_hsdp.json", "cluster_hsdp_30M.json")
HSDP = cluster_hsdp.USER_HSDP


def runs():
    for name in FILES:
        for run in json.loads((ROOT / "bench" / "results" / name).read_text())["runs"]:
            yield pytest.param(run, id=f"{name}-{run['batch_size']}seq")


def steps(run: dict) -> dict[str, float]:
    return {name: s["step_s_median"] for name, s in run["result"]["systems"].items()}


def test_the_docs_tables_are_the_committed_runs():
    doc = (ROOT / "docs" / "multi_node.md").read_text()
    for name in FILES:
        table = "\n".join(cluster_hsdp.table(json.loads((ROOT / "bench" / "results" / name).read_text())))
        assert table in doc, name


@pytest.mark.parametrize("run", list(runs()))
def test_what_the_figures_say(run):
    s = steps(run)
    # the user's configuration: torchtitan's wrapping and explicit prefetch within 5% of the defaults
    assert abs(s[f"{HSDP}, torchtitan's wrapping"] / s[HSDP] - 1) <= 0.05
    assert abs(s[f"{HSDP}, explicit prefetch"] / s[HSDP] - 1) <= 0.05
    # what FSDP2 could gain: each of the two 0.87-0.92 of the defaults
    for variant in ("reshard_after_forward=False", "point-to-point gloo collectives"):
        assert 0.865 <= s[f"{HSDP}, {variant}"] / s[HSDP] < 0.925, variant
    # the goal against the defaults, met; against the fastest FSDP2s, ratios the prose gives
    assert s[cluster_hsdp.FLATSHARD] / s[HSDP] <= 0.75
    assert s["flatshard _HYBRID_SHARD_ZERO2 F=2"] / s[f"{HSDP}, reshard_after_forward=False"] < 0.795
    assert 0.735 <= s[cluster_hsdp.FLATSHARD] / s[f"{HSDP}, point-to-point gloo collectives"] < 0.825
    # every HSDP system computes the same bits as flatshard's hybrid; FULL_SHARD within 2.2e-5
    agree = run["losses_agree"]
    assert all(a["max_rel_diff"] == 0.0 for name, a in agree.items() if "HSDP" in name or "ZERO2" in name)
    assert agree["FSDP2 FULL_SHARD"]["max_rel_diff"] <= 2.2e-5


def test_the_compute_step_explains_the_multiple():
    """The same link bytes at 4 and 16 sequences; the multiple of compute falls as compute grows."""
    (four, sixteen) = json.loads((ROOT / "bench" / "results" / FILES[0]).read_text())["runs"]
    assert (four["batch_size"], sixteen["batch_size"]) == (4, 16)
    r4, r16 = cluster_hsdp.ratios(four), cluster_hsdp.ratios(sixteen)
    assert round(r4[HSDP]["link_mb"], 1) == round(r16[HSDP]["link_mb"], 1) == 13.0
    assert r4[HSDP]["compute"] > 3.0 > 2.0 > r16[HSDP]["compute"]
