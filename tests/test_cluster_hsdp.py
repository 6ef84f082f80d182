"""docs/multi_node.md's "FSDP2's HSDP as a user runs it" against the committed bench/cluster/hsdp.py runs:
its tables are the files' tables, each under the commit, machine and load it was measured at, and each
sentence of "What the figures say" holds for every run and quotes the files' figures."""

import json
from pathlib import Path

import pytest

from bench.cluster import hsdp as cluster_hsdp
from bench.tables import measured_at

ROOT = Path(__file__).resolve().parents[1]

FILES = ("cluster_hsdp.json", "cluster_hsdp_30M.json")
HSDP = cluster_hsdp.USER_HSDP
ZERO2 = "flatshard _HYBRID_SHARD_ZERO2 F=2"
RAF = f"{HSDP}, reshard_after_forward=False"
P2P = f"{HSDP}, point-to-point gloo collectives"
GOAL = 0.75  # flatshard's hybrid at most 0.75x FSDP2 HSDP's step


def report(name: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / name).read_text())


def all_runs() -> list[tuple[str, dict]]:
    return [(name, run) for name in FILES for run in report(name)["runs"]]


def runs():
    for name, run in all_runs():
        yield pytest.param(run, id=f"{name}-{run['batch_size']}seq")


def steps(run: dict) -> dict[str, float]:
    return {name: s["step_s_median"] for name, s in run["result"]["systems"].items()}


def prose() -> str:
    text = (ROOT / "docs" / "multi_node.md").read_text()
    start = text.index("## FSDP2's HSDP as a user runs it")
    return " ".join(text[start : text.index("## Keeping the slow link busy and short")].split())


def test_the_docs_tables_are_the_committed_runs():
    doc = (ROOT / "docs" / "multi_node.md").read_text()
    for name in FILES:
        table = "\n".join(cluster_hsdp.table(report(name)))
        assert table in doc, name


def test_the_section_says_where_and_when_each_file_was_measured():
    """Each file's provenance line, and the load over each job of cluster_hsdp.json (its own record)."""
    text = prose()
    for name in FILES:
        assert " ".join(measured_at(report(name)).split()) in text, name
    four, sixteen = report(FILES[0])["runs"]
    loads = (
        f"The load average rose from {four['load_average_before'][0]:.2f} to {four['load_average_after'][0]:.2f} "
        f"over the job with 4 sequences and from {sixteen['load_average_before'][0]:.2f} to "
        f"{sixteen['load_average_after'][0]:.2f} over the one with 16"
    )
    assert loads in text, loads


@pytest.mark.parametrize("run", list(runs()))
def test_what_the_figures_say(run):
    s = steps(run)
    # the user's configuration: torchtitan's wrapping within 5% of the defaults; explicit prefetch hides
    # little: within 6% of the defaults' step (the range over the runs: test_the_ranges_the_prose_gives_are_the_runs)
    assert abs(s[f"{HSDP}, torchtitan's wrapping"] / s[HSDP] - 1) <= 0.05
    assert abs(s[f"{HSDP}, explicit prefetch"] / s[HSDP] - 1) <= 0.06
    # what FSDP2 could gain: each of the two shortens the defaults' step in every run (the range: as above)
    for variant in (RAF, P2P):
        assert s[variant] / s[HSDP] < 1, variant
    # the goal against the defaults: met with 4 sequences, not with 16 (the compute step three times as long)
    if run["batch_size"] == 4:
        assert s[cluster_hsdp.FLATSHARD] / s[HSDP] <= GOAL
    else:
        assert s[cluster_hsdp.FLATSHARD] / s[HSDP] > GOAL
    # every HSDP system computes the same bits as flatshard's hybrid; FULL_SHARD within 2.2e-5
    agree = run["losses_agree"]
    assert all(a["max_rel_diff"] == 0.0 for name, a in agree.items() if "HSDP" in name or "ZERO2" in name)
    assert agree["FSDP2 FULL_SHARD"]["max_rel_diff"] <= 2.2e-5


def test_the_goal_sentence_quotes_the_runs():
    """The ratios "The goal" lists are the files', in the order 3M with 4 and 16 sequences, then 30M."""
    text = prose()
    (four, sixteen, thirty) = [steps(run) for _, run in all_runs()]
    assert [run["batch_size"] for _, run in all_runs()] == [4, 16, 4]

    def r(s, a, b):
        return f"{s[a] / s[b]:.2f}"

    flat = cluster_hsdp.FLATSHARD
    assert (
        f"flatshard's HYBRID_SHARD is {r(four, flat, HSDP)} of the step with 4 sequences of the 3M GPT and "
        f"{r(thirty, flat, HSDP)} with 4 of the 30M: met; with 16 sequences of the 3M GPT it is "
        f"{r(sixteen, flat, HSDP)}: not met"
    ) in text
    zero2 = ", ".join(r(s, ZERO2, RAF) for s in (four, sixteen)) + f" and {r(thirty, ZERO2, RAF)}"
    assert f"flatshard's _HYBRID_SHARD_ZERO2 is {zero2} (3M with 4 and 16 sequences, 30M)" in text
    p2p = ", ".join(r(s, flat, P2P) for s in (four, sixteen)) + f" and {r(thirty, flat, P2P)}"
    assert f"given point-to-point collectives HYBRID_SHARD is {p2p}." in text


def test_the_compute_step_explains_the_multiple():
    """The same link bytes at 4 and 16 sequences; the multiple of compute falls as compute grows, with the
    figures the prose gives."""
    (four, sixteen) = report(FILES[0])["runs"]
    (thirty,) = report(FILES[1])["runs"]
    assert (four["batch_size"], sixteen["batch_size"]) == (4, 16)
    r4, r16, r30 = cluster_hsdp.ratios(four), cluster_hsdp.ratios(sixteen), cluster_hsdp.ratios(thirty)
    link = round(r4[HSDP]["link_mb"], 1)
    assert link == round(r16[HSDP]["link_mb"], 1) == 13.0
    floor4, floor16 = r4[cluster_hsdp.FLOOR]["ms"], r16[cluster_hsdp.FLOOR]["ms"]
    assert floor16 > floor4 and r4[HSDP]["compute"] > r16[HSDP]["compute"]
    text = prose()
    assert (
        f"the compute step grows from {floor4:,.0f} to {floor16:,.0f} ms, so FSDP2's HSDP is "
        f"{r4[HSDP]['compute']:.2f}× the compute step with 4 sequences and {r16[HSDP]['compute']:.2f}× with 16 "
        f"({r30[HSDP]['compute']:.2f}× for the 30M GPT with 4)"
    ) in text
    assert (
        f"with 16 sequences the compute step is {floor16 / floor4:.1f}× that with 4 ({floor16:,.0f} against "
        f"{floor4:,.0f} ms) for the same {link:.1f} MB across, and the goal is missed there"
    ) in text


def test_the_ranges_the_prose_gives_are_the_runs():
    """The ranges the prose gives (explicit prefetch; the two gains) are the lowest and highest of the runs."""
    text = prose()
    every = [steps(run) for _, run in all_runs()]
    prefetch = [s[f"{HSDP}, explicit prefetch"] / s[HSDP] for s in every]
    assert (
        f"its step is {min(prefetch):.2f}–{max(prefetch):.2f} of the defaults', within 6% of them in every run" in text
    )
    gains = [s[v] / s[HSDP] for s in every for v in (RAF, P2P)]
    assert f"its step {min(gains):.2f}–{max(gains):.2f} of the defaults' in every run" in text
