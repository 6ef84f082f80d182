"""``python -m bench.fuzz.plants -n N [--jobs J] [--json PATH]``: bench/fuzz/plants/__init__.py says what."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from bench import provenance
from bench.cluster.jobs import source_commit
from bench.fuzz.plants import table

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]


def patches() -> list[Path]:
    return sorted(HERE.glob("*.patch"))


def run_plant(patch: Path, n: int, seed: int) -> dict:
    """Apply ``patch`` in a throwaway worktree of HEAD and run the fuzzer there."""
    with tempfile.TemporaryDirectory(prefix="fuzz-plant-") as tmp:
        tree = Path(tmp) / "tree"
        subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), "HEAD"], cwd=ROOT, check=True)
        try:
            subprocess.run(["git", "apply", str(patch)], cwd=tree, check=True)
            out = Path(tmp) / "fuzz.json"
            env = {"PYTHONPATH": f"{tree / 'src'}:{tree}", "PATH": "/usr/bin:/bin"}
            t0 = time.perf_counter()
            cmd = [sys.executable, "-m", "bench.fuzz", "-n", str(n), "--seed", str(seed), "--json", str(out)]
            subprocess.run(cmd, cwd=tree, env=env, capture_output=True, check=False)
            result = json.loads(out.read_text())
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT, check=False)
    flagged = result["failing_indices"]
    return {
        "bug": patch.stem,
        "configurations": result["configurations"],
        "flagged": len(flagged),
        "first_flagged_index": min(flagged) if flagged else None,
        "flagged_indices": flagged,
        "kinds": result["kinds"],
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def write_json(path: Path, summary: dict) -> None:
    """The run's record, the one place this runner writes a result file."""
    path.write_text(json.dumps(provenance.stamp(summary), indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz.plants")
    parser.add_argument("-n", "--count", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--jobs", type=int, default=1, help="patches run at once")
    parser.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "fuzz_plants.json")
    parser.add_argument("--table", action="store_true", help="print the --json file as a Markdown table; run nothing")
    args = parser.parse_args(argv)
    if args.table:
        print("\n".join(table(json.loads(args.json.read_text()))))
        return 0
    with ThreadPoolExecutor(args.jobs) as pool:
        rows = list(pool.map(lambda p: run_plant(p, args.count, args.seed), patches()))
    print(f"{'bug':32s} {'flagged':>12s} {'first index':>12s}")
    for row in rows:
        first = "-" if row["first_flagged_index"] is None else str(row["first_flagged_index"])
        print(f"{row['bug']:32s} {row['flagged']:5d} of {row['configurations']:<4d} {first:>12s}")
    summary = {
        "command": "python -m bench.fuzz.plants " + " ".join(sys.argv[1:] if argv is None else argv),
        "commit": source_commit(),
        "seed": args.seed,
        "plants": rows,
    }
    write_json(args.json, summary)
    return 0 if all(row["flagged"] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
