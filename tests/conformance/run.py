"""Run PyTorch's FSDP2 tests on PyTorch's FSDP2 (the baseline) and on flatshard; print and record the counts.

    python tests/conformance/regenerate.py --source <pytorch>/test/distributed/_composable/fsdp
    python tests/conformance/run.py            # or: make conformance

Every test runs in both variants (regenerate.py), CPU with gloo, world size 2 where the test leaves it
to the device count. A test that runs past ``--timeout`` seconds is failed (the process is ended and the
rest of its file run anew). Per-test results go to tests/conformance/results.json (test id, baseline
and flatshard outcome, category, the first error lines, the README's reason for a listed difference).

Category ``internals``: the test (its method, and the helpers of its file it calls, followed) names a
private part of PyTorch's FSDP: a name imported from a module of ``torch.distributed.fsdp`` with a
``_``-prefixed path component (other than FSDP2's public names), one of ``common_fsdp``'s ``patch_*``
helpers (they replace FSDP2's private functions), ``fully_shard.state(...)`` (FSDP2's private state
object), or an attribute starting with ``_fsdp`` / ``_get_fsdp``. Those test PyTorch's implementation,
not FSDP2's behaviour, and are counted apart. Every other test is ``public``.

Printed: the baseline count (public tests that pass on PyTorch's FSDP2 here), flatshard's count of
those, the listed differences (README.md, "Differences from PyTorch FSDP") and the unlisted failures;
exit status 1 when there is an unlisted failure.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: bench/
from readme import listed_differences  # noqa: E402
from regenerate import DEFAULT_OUT, FSDP2_MODULES, SWAPPED  # noqa: E402

from bench import provenance  # noqa: E402

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results.json"
SOURCES = HERE / "sources.json"
VARIANTS = ("torch", "flatshard")
PRIVATE_ATTR = re.compile(r"^_(get_)?fsdp")


# ---- categories -----------------------------------------------------------------------------------------
def _private_names(tree: ast.Module) -> set[str]:
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            parts = node.module.split(".")
            fsdp = node.module.startswith(("torch.distributed.fsdp", "torch.distributed._composable.fsdp"))
            if fsdp and any(p.startswith("_") for p in parts[2:]) and node.module not in FSDP2_MODULES:
                names.update(a.asname or a.name for a in node.names if a.name not in SWAPPED)
            if node.module.endswith("common_fsdp"):
                names.update(a.asname or a.name for a in node.names if a.name.startswith("patch_"))
    return names


def _uses_private(node: ast.AST, private: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Name) and sub.id in private:
            return True
        if isinstance(sub, ast.Attribute):
            if PRIVATE_ATTR.match(sub.attr) or sub.attr in private:
                return True
            if sub.attr == "state" and isinstance(sub.value, ast.Name) and sub.value.id == "fully_shard":
                return True
    return False


def categories(path: Path) -> dict[str, str]:
    """``Class::method`` -> "internals" or "public", following ``self.<helper>`` calls and module-level
    functions of the file."""
    tree = ast.parse(path.read_text())
    private = _private_names(tree)
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    classes = {n.name: n for n in tree.body if isinstance(n, ast.ClassDef)}

    def methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
        found = {}
        for base in cls.bases:  # helpers inherited from a class of the same file
            if isinstance(base, ast.Name) and base.id in classes:
                found.update(methods(classes[base.id]))
        found.update({n.name: n for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))})
        return found

    out = {}
    for cls in classes.values():
        own = methods(cls)
        for name, fn in own.items():
            if not name.startswith("test"):
                continue
            seen, todo, internal = set(), [fn], False
            while todo and not internal:
                node = todo.pop()
                internal = _uses_private(node, private)
                for sub in ast.walk(node):
                    ref = None
                    if isinstance(sub, ast.Attribute) and isinstance(sub.value, ast.Name) and sub.value.id == "self":
                        ref = own.get(sub.attr)
                    elif isinstance(sub, ast.Name):
                        ref = functions.get(sub.id) or classes.get(sub.id)
                    if ref is not None and id(ref) not in seen:
                        seen.add(id(ref))
                        todo.append(ref)
            out[f"{cls.name}::{name}"] = "internals" if internal else "public"
    return out


def category_of(test_id: str, cats: dict[str, str]) -> str:
    """Parametrized tests (``test_x_foo_bar``) take their method's category: the longest matching name."""
    file_cls, _, name = test_id.rpartition("::")
    cls = file_cls.rpartition("::")[2]
    candidates = [k for k in cats if k.startswith(cls + "::") and name.startswith(k.split("::")[1])]
    return cats[max(candidates, key=len)] if candidates else "public"


# ---- running --------------------------------------------------------------------------------------------
def _pytest(variant_dir: Path, args: list[str], env: dict, timeout: float) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(variant_dir), *args]
    proc = subprocess.Popen(
        cmd,
        cwd=variant_dir,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        out = ""
    finally:  # the test's own children (FSDPTest spawns one process per rank) go with it
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def collect(variant_dir: Path, files: list[str]) -> list[str]:
    res = _pytest(variant_dir, ["--collect-only", *files], dict(os.environ), 600)
    ids = [line.strip() for line in res.stdout.splitlines() if "::" in line and not line.startswith(" ")]
    if res.returncode not in (0, 5):  # a file that cannot be imported would otherwise count as no tests
        tail = "\n".join((res.stdout + res.stderr).splitlines()[-12:])
        raise SystemExit(f"collecting {files} in {variant_dir} failed (make conformance installs expecttest):\n{tail}")
    return ids


def run_file(variant: str, variant_dir: Path, ids: list[str], timeout: float) -> dict[str, dict]:
    """Run ``ids`` (one file's) in as few processes as hangs allow; id -> {outcome, error, seconds}."""
    results: dict[str, dict] = {}
    todo = list(ids)
    while todo:
        with tempfile.NamedTemporaryFile("r", suffix=".jsonl") as log:
            env = dict(
                os.environ, CONFORMANCE_LOG=log.name, CONFORMANCE_TIMEOUT=str(timeout), CONFORMANCE_VARIANT=variant
            )
            start = time.time()
            res = _pytest(variant_dir, todo, env, timeout * len(todo) + 60)
            records = [json.loads(line) for line in Path(log.name).read_text().splitlines() if line.strip()]
        started, finished = [], set()
        for rec in records:
            if rec["event"] == "start":
                started.append(rec["id"])
                continue
            entry = results.setdefault(rec["id"], {"outcome": "passed", "error": ""})
            if rec["outcome"] != "passed" and entry["outcome"] == "passed":
                entry.update(outcome=rec["outcome"], error=rec["error"])
            if rec["event"] == "teardown" or rec["outcome"] != "passed":
                finished.add(rec["id"])
            if rec["event"] == "call":
                finished.add(rec["id"])
        hung = [i for i in started if i not in finished]
        for test_id in hung:
            # [Note: a timeout says the load] On a shared machine a slow test is not a hang: the 1f1b test took
            # 10 s at load 6 and 147 s at load 36 on 2 cores, and two training tests ran past 120 s on FSDP2
            # and on flatshard alike at load 3 (both pass within 300 s, now the default). Say the load, so a
            # failure by timeout under load is told apart from a hang. tests/conformance/flaky_pair.py measures
            # the two training tests that failed once in three runs: their values equal to the bit at every
            # load, their time growing with it (the other cause of a one-off failure, a rank aborted at exit,
            # is the shim's [Note: a rank that passed leaves without finalizing]).
            load = os.getloadavg()[0]
            error = f"no result within {timeout:.0f} s (hang or crash; 1-min load {load:.1f} on {os.cpu_count()} cores)"
            results[test_id] = {"outcome": "failed", "error": error}
        if not started:  # the file did not even import: every test fails with the same reason
            tail = " | ".join(res.stdout.strip().splitlines()[-3:])[:500]
            for test_id in todo:
                results[test_id] = {"outcome": "failed", "error": f"did not run: {tail}"}
            break
        todo = [i for i in todo if i not in results]
        _ = start
    return results


# ---- the report -----------------------------------------------------------------------------------------
def _src_tree() -> str:
    """The tree of ``src/`` at HEAD: each test records the one it ran at ([Note: files rerun at another tree])."""
    done = subprocess.run(["git", "rev-parse", "HEAD:src"], cwd=HERE, capture_output=True, text=True, check=False)
    return done.stdout.strip() or "unknown"


# [Note: files rerun at another tree]
# ``--files`` reruns some files into the existing record (after a fix, a whole run takes an hour). Each
# test then records the tree of ``src/`` it ran at (``src_tree``), and the summary prints how many tests
# ran at each tree when there is more than one, so a record made of two runs says so.
def summarize(tests: list[dict], listed: dict[str, str]) -> tuple[str, int]:
    lines, unlisted = [], []
    trees: dict[str, int] = {}
    for t in tests:
        trees[t.get("src_tree", "unrecorded")] = trees.get(t.get("src_tree", "unrecorded"), 0) + 1
    if len(trees) > 1:
        lines.append("tests ran at more than one src tree: " + ", ".join(f"{n} at {k[:9]}" for k, n in trees.items()))
    for cat in ("public", "internals"):
        group = [t for t in tests if t["category"] == cat]
        base = [t for t in group if t["baseline"] == "passed"]
        ours = [t for t in base if t["flatshard"] == "passed"]
        fails = sum(t["baseline"] == "failed" for t in group)
        skips = sum(t["baseline"] == "skipped" for t in group)
        lines.append(
            f"{cat:9s}: {len(group)} tests; PyTorch FSDP2 (baseline) passes {len(base)} (fails {fails}, skips "
            f"{skips}); flatshard passes {len(ours)} of those {len(base)}"
        )
    public_fail = [
        t for t in tests if t["category"] == "public" and t["baseline"] == "passed" and t["flatshard"] != "passed"
    ]
    by_reason: dict[str, list[str]] = {}
    for t in public_fail:
        if t["id"] in listed:
            by_reason.setdefault(listed[t["id"]], []).append(t["id"])
        else:
            unlisted.append(t)
    lines.append(f"listed differences (docs/concepts/differences.md): {sum(map(len, by_reason.values()))}")
    for reason, ids in by_reason.items():
        lines.append(f"  - {reason}")
        lines.extend(f"      {i}" for i in ids)
    lines.append(f"unlisted failures: {len(unlisted)}")
    for t in unlisted:
        lines.append(f"  {t['id']}\n      {t.get('flatshard_error', '')[:300]}")
    stale = sorted(set(listed) - {t["id"] for t in public_fail})
    if stale:
        lines.append(f"listed in docs/concepts/differences.md but not failing (stale): {len(stale)}")
        lines.extend(f"  {i}" for i in stale)
    return "\n".join(lines), len(unlisted) + len(stale)


def _write(path: Path, tests: list[dict]) -> None:
    import torch

    recorded = {
        "torch": torch.__version__,
        "torch_git_version": torch.version.git_version,
        "sources": json.loads(SOURCES.read_text()) if SOURCES.exists() else {},
        "world_size": 2,
        "tests": tests,
    }
    path.write_text(json.dumps(provenance.stamp(recorded), indent=1) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--generated", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--files", nargs="*", help="test files to run (default: all generated)")
    parser.add_argument("-k", dest="keyword", help="only test ids containing this string")
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--timeout", type=float, default=300, help="seconds one test may take")
    parser.add_argument("--results", type=Path, default=RESULTS)
    parser.add_argument("--report-only", action="store_true", help="print the recorded results; run nothing")
    args = parser.parse_args()

    recorded = json.loads(args.results.read_text()) if args.results.exists() else {"tests": []}
    by_id = {t["id"]: t for t in recorded["tests"]}
    if not args.report_only:
        torch_dir = args.generated / "torch"
        if not torch_dir.exists():
            raise SystemExit(f"{torch_dir} is missing: run tests/conformance/regenerate.py --source ... first")
        files = args.files or sorted(p.name for p in torch_dir.glob("test_*.py"))
        tree = _src_tree()
        for name in files:
            cats = categories(torch_dir / name)
            ids = [i for i in collect(torch_dir, [name]) if not args.keyword or args.keyword in i]
            print(f"{name}: {len(ids)} tests", flush=True)
            for variant in args.variants:
                t0 = time.time()
                got = run_file(variant, args.generated / variant, ids, args.timeout)
                print(
                    f"  {variant}: {sum(r['outcome'] == 'passed' for r in got.values())} passed "
                    f"in {time.time() - t0:.0f} s",
                    flush=True,
                )
                for test_id, res in got.items():
                    entry = by_id.setdefault(test_id, {"id": test_id, "baseline": "not run", "flatshard": "not run"})
                    entry["category"] = category_of(test_id, cats)
                    entry["src_tree"] = tree
                    key = "baseline" if variant == "torch" else "flatshard"
                    entry[key] = res["outcome"]
                    entry[f"{key}_error"] = res["error"] if res["outcome"] != "passed" else ""
    listed = listed_differences()
    tests = sorted(by_id.values(), key=lambda t: t["id"])
    for t in tests:
        failing = t.get("category") == "public" and t["baseline"] == "passed" and t["flatshard"] != "passed"
        t["reason"] = listed.get(t["id"], "") if failing else ""
    if not args.report_only:  # a report leaves the record, and the provenance of the run that made it, as it is
        _write(args.results, tests)
    text, bad = summarize(tests, listed)
    print(text)
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
