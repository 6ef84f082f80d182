"""docs/multi_node.md's figures of ``make cluster`` ("The figures") and of bench/cluster/slow_link.py ("The
step, off and on, interleaved"), and the pages that repeat them, against the committed
bench/results/cluster_<rate>.json and slow_link_<rate>.json: the tables are what bench/cluster/predict.py
and bench/cluster/slow_link.py print for the files, each under the commit, machine and load it was
measured at, and every figure of the prose is the files' (no root: the figures are in the JSONs)."""

from __future__ import annotations

import json
from pathlib import Path

from bench.cluster import net, slow_link
from bench.cluster import predict as cluster_predict
from bench.tables import measured_at

ROOT = Path(__file__).resolve().parents[1]
RATES = cluster_predict.RATES
LABEL = {"1gbit": "1 Gbit/s", "200mbit": "200 Mbit/s"}
HYBRID, ZERO2 = "flatshard HYBRID_SHARD F=2", "flatshard _HYBRID_SHARD_ZERO2 F=2"
OPT_R = f"{HYBRID}, optimizer across replicas"
CROSSING = (HYBRID, "flatshard NO_SHARD", "flatshard FULL_SHARD")  # each run in flight off and on
GOAL_COMPUTE, GOAL_HSDP = 1.30, 0.75  # the recommended hybrid at 1 Gbit/s: x the compute step, x FSDP2 HSDP's


def report(kind: str, rate: str) -> dict:
    return json.loads((ROOT / "bench" / "results" / f"{kind}_{rate}.json").read_text())


def doc(page: str = "docs/multi_node.md") -> str:
    return (ROOT / page).read_text()


def prose(start: str, end: str, page: str = "docs/multi_node.md") -> str:
    """The part of a page between two headings, its whitespace collapsed (sentences wrap anywhere)."""
    text = doc(page)
    return " ".join(text[text.index(start) : text.index(end)].split())


def steps(rate: str) -> dict[str, float]:
    return {name: r["step_s"] for name, r in report("slow_link", rate)["rows"].items()}


def link_seconds(mb: float, rate: str) -> float:
    return mb * 1e6 / (net.parse_rate(rate) / 8)


# ------------------------------------------------------------------ make cluster: "The figures"
def test_the_figures_are_the_committed_runs():
    """Per rate: the provenance line, the link calibration, the compute figures, the planner's table and
    its verdict, as bench/cluster/predict.py prints them for the committed file."""
    text = doc()
    section = prose("## The figures", "## FSDP2's HSDP as a user runs it")
    for rate in RATES:
        run = report("cluster", rate)
        cal = run["result"]["calibration"]
        assert " ".join(measured_at(run).split()) in section, rate
        links = ["| link class | latency | bandwidth per rank |", "|---|---|---|"] + [
            f"| {name} | {f['latency_s'] * 1e6:,.0f} µs | {f['bandwidth_Bps'] / 1e6:,.1f} MB/s |"
            for name, f in cal["links"].items()
        ]
        assert "\n".join(links) in text, rate
        c = cal["compute"]
        compute = f"forward + backward {c['forward_backward_s'] * 1e3:.0f} ms, "
        compute += f"AdamW step {c['optimizer_step_s'] * 1e3:.0f} ms."
        assert compute in section, compute
        prediction = cluster_predict.committed(rate)
        assert "\n".join(cluster_predict.table(prediction)) in text, rate
        assert f"Verdict: {cluster_predict.summary(prediction)}." in section, rate


def test_the_figures_say_how_long_and_at_what_load():
    """Both rates were one command: its seconds per rate, and each job's own load (the provenance record's
    "before" is the command's start, [Note: load before and after])."""
    one, two = (report("cluster", r) for r in RATES)
    section = prose("## The figures", "### 1 Gbit/s")
    assert f"{one['seconds']:.0f} s at 1 Gbit/s, {two['seconds']:.0f} s at 200 Mbit/s" in section
    loads = ", ".join(
        f"{r['load_average_before'][0]:.2f} → {r['load_average_after'][0]:.2f} at {LABEL[rate]}"
        for rate, r in zip(RATES, (one, two))
    )
    assert f"(`load_average_before`, `load_average_after`): {loads}." in section


def test_the_verdicts_count_and_the_method_quote_the_runs():
    predictions = [cluster_predict.committed(rate) for rate in RATES]
    within = [ok for p in predictions for ok in p["verdicts"]["within_25_percent"].values()]
    section = prose("**Verdicts.**", "## FSDP2's HSDP as a user runs it")
    stated = f"{sum(within)} of these {len(within)} predictions are within 25%, and the order is right at both rates."
    assert stated in section
    assert not any(p["verdicts"]["misordered_pairs"] for p in predictions)  # the order exactly, no tie excepted
    worst = max(a["max_rel_diff"] for rate in RATES for a in report("cluster", rate)["losses_agree"].values())
    method = prose("## The method", "## The figures")
    worst = f"{worst:.1e}".replace("e-0", "e-")  # 3.6e-7, as the page writes it
    assert f"losses equal flatshard FULL_SHARD's within 1e-4 (worst {worst}) in every run." in method


# ------------------------------------------------------------------ bench/cluster/slow_link.py
SLOW = ("### The step, off and on, interleaved", "### The accuracy guard")


def test_the_slow_link_table_is_the_committed_runs():
    """The table is ``python -m bench.cluster.slow_link --table``, under each file's provenance line and
    each job's own load."""
    reports = [report("slow_link", rate) for rate in RATES]
    assert "\n".join(slow_link.table(reports)) in doc()
    section = prose(*SLOW)
    for r in reports:
        assert " ".join(measured_at(r).split()) in section, r["rate"]
    loads = ", ".join(
        f"{r['load_average_before'][0]:.2f} → {r['load_average_after'][0]:.2f} at {LABEL[r['rate']]}" for r in reports
    )
    assert f"(`load_average_before`, `load_average_after`): {loads}," in section


def _on_over_off(rate: str) -> dict[str, float]:
    s = steps(rate)
    return {name: s[name] / s[f"{name}, in flight off"] for name in CROSSING}


def test_in_flight_is_faster_for_every_crossing_strategy():
    """Every strategy whose collectives cross is faster than with it off, by the figures each page gives."""
    one, two = (_on_over_off(rate) for rate in RATES)
    assert all(r < 1 for r in (*one.values(), *two.values()))
    pct = {name: (f"{1 - one[name]:.0%}", f"{1 - two[name]:.0%}") for name in CROSSING}
    section = prose(*SLOW)
    h, n, f = (pct[name] for name in CROSSING)
    assert (
        f"hybrid by {h[0]} at 1 Gbit/s and {h[1]} at 200 Mbit/s, NO_SHARD by {n[0]} and {n[1]}, "
        f"FULL_SHARD by {f[0]} and {f[1]}."
    ) in section
    keywords = prose("## Keeping the slow link busy and short", SLOW[0])
    ranges = f"{min(one.values()):.2f}–{max(one.values()):.2f} of the step with it off at 1 Gbit/s, "
    ranges += f"{min(two.values()):.2f}–{max(two.values()):.2f} at 200 Mbit/s"
    assert f"it was faster for every strategy in every run (the committed one below: {ranges};" in keywords
    settings = prose("### Settings for a slow link", "## Replica groups")
    assert f"and {h[0]} faster than without it at 1 Gbit/s here, {h[1]} at 200 Mbit/s." in settings
    how_to = " ".join(doc("docs/how-to/multi-node.md").split())
    assert f"the same bits as off, {h[0]} faster at 1 Gbit/s);" in how_to


def test_where_the_hybrid_step_goes():
    """At 200 Mbit/s hybrid's step is within 0.2 s of forward + link + optimizer (the link idle in forward);
    at 1 Gbit/s its link time is shorter than backward (two thirds of compute), at 200 Mbit/s int8's longer."""
    section = prose(*SLOW)
    run = report("slow_link", "200mbit")
    compute = run["result"]["calibration"]["compute"]
    fb, opt = compute["forward_backward_s"], compute["optimizer_step_s"]
    mb = run["rows"][HYBRID]["link_mb_per_step_per_node"]
    link = link_seconds(mb, "200mbit")
    bound, step = fb / 3 + link + opt, run["rows"][HYBRID]["step_s"]
    assert 0 <= step - bound <= 0.2, (step, bound)
    rate_mb = net.parse_rate("200mbit") / 8 / 1e6
    assert f"{mb:.1f} MB per node per step at {rate_mb:.0f} MB/s is {link:.2f} s of link" in section
    bound_text = f"(forward + link + optimizer: {bound:.2f} s)"
    assert f"the step ({step:.2f} s) is within 0.2 s of that bound {bound_text}" in section
    one = report("slow_link", "1gbit")
    fast = link_seconds(one["rows"][HYBRID]["link_mb_per_step_per_node"], "1gbit")
    assert fast < 2 / 3 * one["result"]["calibration"]["compute"]["forward_backward_s"]
    assert f"At 1 Gbit/s the link's {fast:.2f} s hides under backward" in section
    int8 = link_seconds(run["rows"][f"{HYBRID}, int8"]["link_mb_per_step_per_node"], "200mbit")
    assert int8 > 2 / 3 * fb
    assert (
        f"(the link's {int8:.2f} s is longer than backward, {2 / 3 * fb:.2f} s here, so not all of it hides)" in section
    )


def test_int8_and_zero2_as_the_prose_gives_them():
    section = prose(*SLOW)
    one, two = steps("1gbit"), steps("200mbit")
    rows = report("slow_link", "1gbit")["rows"]

    def mb(name):
        return f"{rows[name]['link_mb_per_step_per_node']:.1f}"

    assert f"({mb(HYBRID)} → {mb(f'{HYBRID}, int8')} MB per node per step for hybrid," in section
    assert f"{mb('flatshard FULL_SHARD')} → {mb('flatshard FULL_SHARD, int8')} MB for FULL_SHARD)" in section
    exact = (HYBRID, ZERO2, "flatshard FULL_SHARD")
    fast, slow = ({n: s[f"{n}, int8"] / s[n] for n in exact} for s in (one, two))
    assert f"At 200 Mbit/s hybrid's step is then {slow[HYBRID]:.2f} of exact in flight" in section
    assert f"_HYBRID_SHARD_ZERO2's {slow[ZERO2]:.2f} and FULL_SHARD's {slow['flatshard FULL_SHARD']:.2f};" in section
    assert all(r < 1 for r in (*fast.values(), *slow.values()))  # int8 shortened every exact step, both rates
    assert (
        f"hybrid's is {fast[HYBRID]:.2f}, _HYBRID_SHARD_ZERO2's {fast[ZERO2]:.2f} and "
        f"FULL_SHARD's {fast['flatshard FULL_SHARD']:.2f}: int8 shortened every one of these steps at both rates"
    ) in section
    settings = prose("### Settings for a slow link", "## Replica groups")
    both = f"(here 200 Mbit/s: {slow[HYBRID]:.2f} of the exact step; at 1 Gbit/s {fast[HYBRID]:.2f})"
    assert both in settings
    assert f"then with int8: {slow['flatshard FULL_SHARD']:.2f} of the exact step at 200 Mbit/s." in settings
    assert (
        f"was {one[ZERO2] / one[HYBRID]:.2f} of HYBRID_SHARD's step at 1 Gbit/s and "
        f"{two[ZERO2] / two[HYBRID]:.2f} at 200 Mbit/s (the optimizer-sharded hybrid, whose gathers are "
        f"HYBRID_SHARD's, {one[OPT_R] / one[HYBRID]:.2f} and {two[OPT_R] / two[HYBRID]:.2f})"
    ) in section


def test_the_optimizer_sharded_hybrid_as_the_prose_gives_it():
    """Its step against HYBRID_SHARD's, shorter at both rates, and the planner's ratio for it."""
    one, two = steps("1gbit"), steps("200mbit")
    r1, r2 = one[OPT_R] / one[HYBRID], two[OPT_R] / two[HYBRID]
    assert r1 < 1 and r2 < 1
    section = prose(*SLOW)
    assert (
        f"The optimizer-sharded hybrid's step is {r1:.2f} of HYBRID_SHARD's at 1 Gbit/s ({one[OPT_R] * 1e3:.0f} "
        f"against {one[HYBRID] * 1e3:.0f} ms) and {r2:.2f} of it at 200 Mbit/s ({two[OPT_R] * 1e3:.0f} against "
        f"{two[HYBRID] * 1e3:.0f} ms)"
    ) in section
    settings = prose("### Settings for a slow link", "## Replica groups")
    assert f"a step shorter than HYBRID_SHARD's in this run ({r1:.2f} at 1 Gbit/s, {r2:.2f} at 200 Mbit/s)." in settings
    hsdp = report("slow_link", "1gbit")["rows"][OPT_R]["per_fsdp2_hsdp"]
    planned = [cluster_predict.committed(rate, "slow_link")["rows"][OPT_R] for rate in RATES]
    p1, p2 = (f"{p['predicted_s'] / p['measured_s']:.2f}" for p in planned)
    measured = prose("### The optimizer-sharded hybrid", "### Settings for a slow link")
    assert (
        f"at 1 Gbit/s its step is {r1:.2f} of HYBRID_SHARD's ({one[OPT_R] * 1e3:.0f} against "
        f"{one[HYBRID] * 1e3:.0f} ms, {hsdp:.2f} of FSDP2 HSDP's), at 200 Mbit/s {r2:.2f} of it "
        f"({two[OPT_R] * 1e3:.0f} against {two[HYBRID] * 1e3:.0f} ms;"
    ) in measured
    assert f"the HYBRID_SHARD+OptR plan ({p1} of the measured step at 1 Gbit/s, {p2} at 200 Mbit/s;" in measured


def test_the_goals_at_1_gbit():
    """Every hybrid setting with in flight on is at most 0.75x FSDP2 HSDP's step and one, _HYBRID_SHARD_ZERO2
    with int8, at most 1.30x the compute step; with in flight off above 0.75x; the figures as the prose gives
    them."""
    rows = report("slow_link", "1gbit")["rows"]
    hybrids = [n for n in rows if n.startswith((HYBRID, ZERO2))]
    on = [n for n in hybrids if not n.endswith("in flight off")]
    assert all(rows[n]["per_fsdp2_hsdp"] <= GOAL_HSDP for n in on)
    assert [n for n in on if rows[n]["per_compute"] <= GOAL_COMPUTE] == [f"{ZERO2}, int8"]
    off = rows[f"{HYBRID}, in flight off"]
    assert off["per_fsdp2_hsdp"] > GOAL_HSDP

    def x(name):
        return f"{rows[name]['per_compute']:.2f}× and {rows[name]['per_fsdp2_hsdp']:.2f}×"

    section = prose(*SLOW)
    assert (
        f"exact HYBRID_SHARD in flight {x(HYBRID)}, the optimizer-sharded hybrid {x(OPT_R)}, int8 "
        f"{x(f'{HYBRID}, int8')}, _HYBRID_SHARD_ZERO2 with int8 {x(f'{ZERO2}, int8')}: ≤ 0.75× HSDP's step in "
        f"every hybrid setting with in flight on (with it off {off['per_fsdp2_hsdp']:.2f}×), ≤ 1.30× the compute "
        "step in one, _HYBRID_SHARD_ZERO2 with int8."
    ) in section
    slow = report("slow_link", "200mbit")["rows"][f"{HYBRID}, int8"]
    assert (
        f"At 200 Mbit/s int8 hybrid is {slow['per_compute']:.2f}× the compute step and "
        f"{slow['per_fsdp2_hsdp']:.2f}× HSDP's."
    ) in section
