"""The benchmark harness (python -m bench.compare) end to end, small: a tiny GPT at W = 2, two measured
steps per system, fp32 and bf16, the compiled rows, and a tiny ablation. Checks the JSON, not the speed: every figure is
there for every system, the peaks and bytes are positive, flatshard's collectives counted by the
benchmark's tracker equal its own recorder's, bf16 halves the all-gather bytes, and the three systems'
losses agree."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from tests.helpers.dist import run_launcher

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 240  # ~50 s on two cores with a cold inductor cache; a hang must fail, not wait
SYSTEM_FIELDS = {
    "step_s_median",
    "step_s",
    "losses_per_rank",
    "peak_bytes_per_rank",
    "comm_per_step",
    "bytes_per_step",
    "recorder_bytes_per_step",
}


@pytest.mark.slow
def test_bench_smoke(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "bench.compare",
        "--sizes",
        "tiny",
        "--world",
        "2",
        "--dtypes",
        "fp32",
        "bf16",
        "--steps",
        "2",
        "--warmup",
        "0",
        "--ablation-size",
        "tiny",
        "--compile-dtypes",  # one dtype's compiled rows: tests/test_compile.py checks compiled parity
        "fp32",
        "--json",
        str(out),
    ]
    run_launcher(cmd, ROOT, TIMEOUT_S, "the benchmark")
    report = json.loads(out.read_text())
    assert {"command", "torch", "cpus", "load_average_before", "load_average_after", "results"} <= set(report)

    compiled = [r for r in report["results"] if r["kind"] == "compiled"]  # every Block compiled (inductor)
    assert [(r["size"], r["world"], r["dtype"]) for r in compiled] == [("tiny", 2, "fp32")]
    for r in compiled:
        assert list(r["systems"]) == ["flatshard", "flatshard fully_shard", "FSDP2"]
        assert r["flatshard/FSDP2"] > 0 and r["fully_shard/FSDP2"] > 0 and r["flatshard peak/FSDP2"] > 0
        assert all(a["agree"] for a in r["agree"].values()), r["agree"]
        for name, fig in r["systems"].items():
            assert SYSTEM_FIELDS <= set(fig) and min(fig["peak_bytes_per_rank"]) > 0, name

    comparisons = [r for r in report["results"] if r["kind"] == "comparison"]
    assert [(r["size"], r["world"], r["dtype"]) for r in comparisons] == [("tiny", 2, "fp32"), ("tiny", 2, "bf16")]
    for r in comparisons:
        assert list(r["systems"]) == ["flatshard", "flatshard fully_shard", "FSDP2", "DDP"]
        assert r["flatshard/FSDP2"] > 0 and r["flatshard/DDP"] > 0 and r["fully_shard/FSDP2"] > 0
        for name, fig in r["systems"].items():
            assert SYSTEM_FIELDS <= set(fig), name
            assert len(fig["step_s"]) == 2 and fig["step_s_median"] > 0
            assert len(fig["losses_per_rank"]) == 2 and all(
                len(ls) == 3 for ls in fig["losses_per_rank"]
            )  # 2 + tracked
            assert len(fig["peak_bytes_per_rank"]) == 2 and min(fig["peak_bytes_per_rank"]) > 0
            assert fig["bytes_per_step"] > 0
        assert all(a["agree"] for a in r["agree"].values()), r["agree"]
        flat = r["systems"]["flatshard"]
        assert flat["bytes_per_step"] == pytest.approx(flat["recorder_bytes_per_step"])
        # the same units and precision: the same bytes as FSDP2 (flatshard's as point-to-point sends on gloo)
        assert flat["bytes_per_step"] == pytest.approx(r["systems"]["FSDP2"]["bytes_per_step"])
        assert set(flat["comm_per_step"]) == {"send"}
        ours = r["systems"]["flatshard fully_shard"]  # FSDP2's layout, flatshard's exchanges: FSDP2's bytes
        assert ours["bytes_per_step"] == pytest.approx(r["systems"]["FSDP2"]["bytes_per_step"])
        assert ours["bytes_per_step"] == pytest.approx(ours["recorder_bytes_per_step"])
    fp32, bf16 = (r["systems"]["flatshard"]["recorder_bytes_per_step_by_kind"]["all_gather"] for r in comparisons)
    assert bf16 == fp32 / 2

    (ablation,) = [r for r in report["results"] if r["kind"] == "ablation"]
    assert (
        len(ablation["systems"]) >= 6
        and ablation["FULL_SHARD/NO_SHARD"] > 0
        and all(a["agree"] for a in ablation["agree"].values())
    )
    # fp32: the prefetch settings change when collectives run, never the numbers
    prefetch = [name for name in ablation["systems"] if name != "NO_SHARD" and "shard_boundaries" not in name]
    losses = [ablation["systems"][name]["losses_per_rank"] for name in prefetch]
    assert len(prefetch) >= 5 and ablation["rows/flat"] > 0 and ablation["params/flat"] > 0
    assert all(ls == losses[0] for ls in losses)


def compiled_rows(report: dict) -> list[str]:
    """docs/bench.md's compiled table, made from the rows of kind "compiled" of bench/results/bench.json."""
    rows = []
    three = ("flatshard", "flatshard fully_shard", "FSDP2")
    for r in (r for r in report["results"] if r["kind"] == "compiled"):
        (eager,) = [
            e
            for e in report["results"]
            if e["kind"] == "comparison" and (e["size"], e["world"], e["dtype"]) == (r["size"], r["world"], r["dtype"])
        ]
        sy = r["systems"]
        ms = [f"{sy[n]['step_s_median'] * 1e3:,.0f}" for n in three]
        mib = [f"{max(sy[n]['peak_bytes_per_rank']) / 2**20:.1f}" for n in three]
        rows.append(
            f"| {r['size']} | {r['world']} | {r['dtype']} | {' / '.join(ms)} | {r['flatshard/FSDP2']:.2f} | "
            f"{r['fully_shard/FSDP2']:.2f} | {eager['fully_shard/FSDP2']:.2f} | {' / '.join(mib)} |"
        )
    return rows


def test_docs_compiled_rows_are_the_committed_run():
    """The compiled table of docs/bench.md, and what its prose says of every row, are bench/results/bench.json."""
    report = json.loads((ROOT / "bench" / "results" / "bench.json").read_text())
    doc = (ROOT / "docs" / "bench.md").read_text()
    prose = " ".join(doc.split())
    rows = compiled_rows(report)
    assert rows and all(row in doc for row in rows), [row for row in rows if row not in doc]
    compiled = [r for r in report["results"] if r["kind"] == "compiled"]
    worst = max(max(r["flatshard/FSDP2"], r["fully_shard/FSDP2"]) for r in compiled)
    assert f"compiled steps are at most {worst:.2f} of compiled FSDP2's" in prose, worst
    spans = [
        f"{min(r[k] for r in compiled):.2f}–{max(r[k] for r in compiled):.2f}"
        for k in ("flatshard/FSDP2", "fully_shard/FSDP2")
    ]
    assert f"(the FSDP1 wrapper's {spans[0]}, fully_shard's {spans[1]})" in prose, spans
    peaks = [max(r["flatshard peak/FSDP2"], r["flatshard fully_shard peak/FSDP2"]) for r in compiled]
    if "their compiled peaks are at or below FSDP2's" in prose:
        assert max(peaks) <= 1, peaks
    else:
        assert max(peaks) > 1, peaks  # the peaks are at or below FSDP2's: the prose must say so
    # the prose says the compiled losses agree as the eager rows' do: within compare.py's tolerances
    assert "losses agree within the eager rows' tolerances" in prose
    for r in compiled:
        assert all(a["agree"] for a in r["agree"].values()), r["agree"]


def test_compress_accuracy_steps_the_learning_rate_of_the_example(monkeypatch):
    """bench/figures/compress_accuracy.py restates examples/train_gpt.py's schedule, which it cannot
    import (train_gpt.py imports its siblings by file name, as a script does): the two agree."""
    from bench.figures import compress_accuracy

    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for steps in (1, 2, 19, 40, 200):
        for step in range(steps):
            assert compress_accuracy.lr_at(step, steps, 3e-3) == example.lr_at(step, steps, 3e-3), (step, steps)


def test_moe_page_quotes_the_committed_run():
    """docs/how-to/moe.md's figures of ``python -m bench.moe`` are bench/results/moe.json's, with the commit,
    machine and load it was measured at (a rerun fails this until the page says what the file says)."""
    from bench.tables import measured_at

    run = json.loads((ROOT / "bench" / "results" / "moe.json").read_text())
    prose = " ".join((ROOT / "docs" / "how-to" / "moe.md").read_text().split())
    med = run["step_s_median"]
    steps = (
        f"a median step (slowest rank, {run['rounds']} rounds) of {med['flatshard']:.2f} s for flatshard and "
        f"{med['fsdp2']:.2f} s for FSDP2 (ratio {run['step_ratio_flatshard_over_fsdp2']:.2f})"
    )
    assert steps in prose, steps
    held = {h[k] for h in run["held_bytes_per_rank"] for k in ("flatshard", "fsdp2")}
    assert len(run["held_bytes_per_rank"]) == run["world"] and len(held) == 1, run["held_bytes_per_rank"]
    assert f"the same bytes held on every rank by both ({held.pop():,}:" in prose
    assert " ".join(measured_at(run).split()) in prose


def test_the_accuracy_guard_page_is_the_committed_run():
    """docs/multi_node.md's "The accuracy guard" is bench/results/compress_accuracy.json: its table
    (``python -m bench.figures.compress_accuracy --table``), the commit it was measured at, and every figure
    its prose quotes; and the verdict it states holds (both int8 runs within the 1% guard)."""
    from bench.figures import compress_accuracy
    from bench.tables import measured_at

    run = json.loads((ROOT / "bench" / "results" / "compress_accuracy.json").read_text())
    page = (ROOT / "docs" / "multi_node.md").read_text()
    assert "\n".join(compress_accuracy.table(run)) in page
    prose = " ".join(page.split())
    assert " ".join(measured_at(run).split()) in prose
    hybrid, full = run["compressed"]["int8 hybrid"], run["compressed"]["int8 full shard"]
    assert hybrid["within_goal"] and full["within_goal"]
    per_step = [100 * r["max_rel_diff_per_step"] for r in run["compressed"].values()]
    beyond = [
        compress_accuracy.steps_beyond_goal(run, n) for n in ("int8 hybrid", "int8 full shard", "bf16 reductions")
    ]
    for phrase in (
        f"up to {min(per_step):.1f}–{max(per_step):.1f}% from fp32's in this run",
        f"(int8: {100 * hybrid['max_rel_diff_window_mean']:.2f}% and {100 * full['max_rel_diff_window_mean']:.2f}%)",
        f"({100 * hybrid['held_out_rel_diff']:.2f}% and {100 * full['held_out_rel_diff']:.2f}%)",
        f"({beyond[0]} and {beyond[1]} of {run['steps']} steps beyond it; bf16 reductions: {beyond[2]})",
    ):
        assert phrase in prose, phrase
