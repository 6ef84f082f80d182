"""Full conformance runs at one ``src/`` tree, side by side: which tests changed outcome between runs.

    python tests/conformance/runs.py add tests/conformance/results.json --started 2026-12-07T09:54:04+00:00
    python tests/conformance/runs.py          # print the runs and the tests whose outcome differed

``results.json`` holds one outcome per test, the last run's. A test that fails once in three runs is a
bug to find (CONTRIBUTING.md), so each full run of every file (each by its own ``run.py --files``) is
also kept here, as the record stands after it: ``add`` appends its outcomes (``baseline/flatshard`` per
test id), its provenance (that of the run's last file, whose ``finished`` is the run's end) and when the
run began. Runs at another ``src/`` tree than the newest one are dropped on ``add``: they measured other
code. tests/test_conformance.py holds results.json to the newest run here, and
docs/concepts/differences.md's count of runs and its list of the tests that changed outcome to this file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HERE = Path(__file__).resolve().parent
RUNS = HERE / "runs.json"


def outcomes(record: dict) -> dict[str, str]:
    """test id -> ``baseline/flatshard`` outcome of a results.json record."""
    return {t["id"]: f"{t['baseline']}/{t['flatshard']}" for t in record["tests"]}


def load(path: Path = RUNS) -> list[dict]:
    return json.loads(path.read_text())["runs"] if path.exists() else []


def changed(runs: list[dict]) -> dict[str, list[str]]:
    """test id -> its outcome in each run, for the tests whose outcome was not the same in every run."""
    ids = sorted({i for run in runs for i in run["outcomes"]})
    seen = {i: [run["outcomes"].get(i, "not run") for run in runs] for i in ids}
    return {i: o for i, o in seen.items() if len(set(o)) > 1}


def add(results: Path, started: str, path: Path = RUNS) -> list[dict]:
    record = json.loads(results.read_text())
    prov = record["provenance"]
    trees = {t.get("src_tree") for t in record["tests"]}
    if trees != {prov["src_tree"]}:
        raise SystemExit(f"{results} mixes src trees {sorted(map(str, trees))}: not one full run")
    runs = [run for run in load(path) if run["provenance"]["src_tree"] == prov["src_tree"]]
    runs.append({"started": started, "provenance": prov, "outcomes": outcomes(record)})
    path.write_text(json.dumps({"runs": runs}, indent=1, sort_keys=True) + "\n")
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="verb")
    add_p = sub.add_parser("add", help="append a full run's record")
    add_p.add_argument("results", type=Path)
    add_p.add_argument("--started", required=True, help="when the run's first file began (UTC, ISO 8601)")
    args = parser.parse_args()
    runs = add(args.results, args.started) if args.verb == "add" else load()
    for n, run in enumerate(runs, 1):
        prov = run["provenance"]
        print(
            f"run {n}: {run['started']} .. {prov['finished']}, commit {prov['commit'][:9]}, "
            f"src tree {prov['src_tree'][:9]}, {prov['machine'].get('cpu_model')}, {len(run['outcomes'])} tests"
        )
    diff = changed(runs)
    print(f"tests whose outcome changed between the {len(runs)} runs: {len(diff)}")
    for test_id, seen in diff.items():
        print(f"  {test_id}: {', '.join(seen)}")


if __name__ == "__main__":
    main()
