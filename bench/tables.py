"""docs/bench.md's tables, made from the committed result file: ``python -m bench.tables`` prints them
(the main comparison, the ablation, the compiled rows; all from bench/results/bench.json) each under
the line that says where and when the file was measured (its provenance record, bench/provenance.py).
The page quotes this output; the tests (tests/test_claims.py, tests/test_bench.py) hold the page to the
file with tables they make themselves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("flatshard", "flatshard fully_shard", "FSDP2", "DDP")


def _mib(system: dict[str, Any]) -> str:
    return f"{max(system['peak_bytes_per_rank']) / 2**20:.1f}"


def _ms(system: dict[str, Any]) -> str:
    return f"{system['step_s_median'] * 1e3:,.0f}"


def measured_at(doc: dict[str, Any]) -> str:
    """One line: the commit, the machine, the load and the day a result file was measured."""
    p = doc["provenance"]
    m = p["machine"]
    isa = "AVX-512" + (" with bf16 instructions" if m["bf16_instructions"] else "") if m["avx512"] else "no AVX-512"
    dirty = ", with uncommitted changes" if p["dirty"] else ""
    return (
        f"Measured at commit `{p['commit'][:9]}`{dirty} on {m['cores']} cores of an {m['cpu_model']} ({isa}; torch "
        f"{m['torch']}, capability {m['cpu_capability']}), load {p['load_1min_before']:g} before and "
        f"{p['load_1min_after']:g} after, {p['finished'][:10]}: `{p['command']}`."
    )


def comparison_table(report: dict[str, Any]) -> list[str]:
    rows = [
        "| model | W | dtype | flatshard ms | fully_shard ms | FSDP2 ms | DDP ms | flatshard / FSDP2 | "
        "fully_shard / FSDP2 | peak MiB: flatshard / fully_shard / FSDP2 / DDP |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in (r for r in report["results"] if r["kind"] == "comparison"):
        sy = r["systems"]
        rows.append(
            f"| {r['size']} | {r['world']} | {r['dtype']} | {' | '.join(_ms(sy[n]) for n in SYSTEMS)} | "
            f"{r['flatshard/FSDP2']:.2f} | {r['fully_shard/FSDP2']:.2f} | {' / '.join(_mib(sy[n]) for n in SYSTEMS)} |"
        )
    return rows


def ablation_table(report: dict[str, Any]) -> list[str]:
    (a,) = [r for r in report["results"] if r["kind"] == "ablation"]
    rows = [
        f"| flatshard variant ({a['size']}, W = {a['world']}, fp32) "
        "| median step (ms) | ratio to default | peak MiB/rank |",
        "|---|---:|---:|---:|",
    ]
    default = a["systems"]["BACKWARD_PRE (default)"]["step_s_median"]
    for name, s in a["systems"].items():
        rows.append(f"| {name} | {_ms(s)} | {s['step_s_median'] / default:.2f} | {_mib(s)} |")
    return rows


def compiled_table(report: dict[str, Any]) -> list[str]:
    three = SYSTEMS[:3]
    rows = [
        "| model | W | dtype | compiled step ms: flatshard / fully_shard / FSDP2 | flatshard / FSDP2 compiled | "
        "fully_shard / FSDP2 compiled | fully_shard / FSDP2 eager "
        "| compiled peak MiB: flatshard / fully_shard / FSDP2 |",
        "|---|---:|---|---|---:|---:|---:|---|",
    ]
    for r in (r for r in report["results"] if r["kind"] == "compiled"):
        (eager,) = [
            e
            for e in report["results"]
            if e["kind"] == "comparison" and (e["size"], e["world"], e["dtype"]) == (r["size"], r["world"], r["dtype"])
        ]
        sy = r["systems"]
        rows.append(
            f"| {r['size']} | {r['world']} | {r['dtype']} | {' / '.join(_ms(sy[n]) for n in three)} | "
            f"{r['flatshard/FSDP2']:.2f} | {r['fully_shard/FSDP2']:.2f} | {eager['fully_shard/FSDP2']:.2f} | "
            f"{' / '.join(_mib(sy[n]) for n in three)} |"
        )
    return rows


BEGIN = "<!-- python -m bench.tables --write: {name} -->"
END = "<!-- end of {name} -->"


def sections(bench: dict[str, Any]) -> dict[str, list[str]]:
    """Each generated section of docs/bench.md: the line saying where the file was measured, then its table."""
    return {
        "comparison": [measured_at(bench), "", *comparison_table(bench)],
        "ablation": [measured_at(bench), "", *ablation_table(bench)],
        "compiled": [measured_at(bench), "", *compiled_table(bench)],
    }


def write(page: Path, parts: dict[str, list[str]]) -> str:
    """``page`` with every generated section replaced by ``parts``' (each between its two markers)."""
    text = page.read_text()
    for name, lines in parts.items():
        begin, end = BEGIN.format(name=name), END.format(name=name)
        if begin not in text or end not in text:
            raise SystemExit(f"{page}: no section {begin!r} ... {end!r}; add both markers where the table goes")
        head, rest = text.split(begin, 1)
        text = head + begin + "\n" + "\n".join(lines) + "\n" + end + rest.split(end, 1)[1]
    return text


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="docs/bench.md's tables from the committed result files")
    p.add_argument("--bench", type=Path, default=RESULTS / "bench.json")
    p.add_argument("--write", action="store_true", help="replace the generated sections of docs/bench.md")
    args = p.parse_args(argv)
    parts = sections(json.loads(args.bench.read_text()))
    if args.write:
        page = ROOT / "docs" / "bench.md"
        page.write_text(write(page, parts))
        print(f"{page.relative_to(ROOT)}: {', '.join(parts)} regenerated")
        return
    for name, lines in parts.items():
        print(BEGIN.format(name=name), *lines, END.format(name=name), "", sep="\n")


if __name__ == "__main__":
    main()
