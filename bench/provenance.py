"""Where a committed result file comes from: ``stamp(doc)`` before writing it, ``python -m bench.provenance``
to list them.

Every tool that writes a file under bench/results/ (or tests/conformance/results.json) calls

    from bench import provenance
    path.write_text(json.dumps(provenance.stamp(doc), indent=1))

which adds ``doc["provenance"] = record()``: the commit (``git rev-parse HEAD``), the tree of src/
(``git rev-parse HEAD:src``), whether src/, bench/ or examples/ had uncommitted changes (and which
files), the command as typed (``sys.orig_argv``), the machine (CPU model, cores, torch's CPU capability,
AVX-512 and bf16 instructions or not, torch and Python versions), its 1-minute load average before and
after, and the start and end time (UTC).

[Note: load before and after] The "before" is read when this module is first imported, which every
writer does at the top of its file, so it is the load when the tool started; a tool that runs several
measurements may call ``begin()`` before the one a file records. The "after" is read in ``record()``.
The machine is shared: a figure measured at a load above the core count is noisy, and only ratios
taken within one interleaved run compare.

``python -m bench.provenance`` prints, for each result file, its commit, src tree, how many commits
have touched src/ since, its age and the minutes its command ran, then their sum; ``check(doc)`` lists
what a file's record lacks (tests/test_provenance.py runs it on every committed file).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULT_FILES = ("bench/results/*.json", "tests/conformance/results.json")
FIELDS = {
    "commit": str,
    "src_tree": str,
    "dirty": bool,
    "command": str,
    "machine": dict,
    "load_1min_before": float,
    "load_1min_after": float,
    "started": str,
    "finished": str,
}
MACHINE_FIELDS = ("cpu_model", "cores", "cpu_capability", "avx512", "bf16_instructions")
_began: tuple[float, float] = (time.time(), os.getloadavg()[0])


def begin() -> None:
    """Take the "before" now (the start time and the load) instead of at import ([Note: load before and after])."""
    global _began
    _began = (time.time(), os.getloadavg()[0])


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.stdout.strip()


def _cpu() -> dict[str, Any]:
    model, flags = platform.processor() or "unknown", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("unknown", "", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags" and not flags:
                flags = set(value.split())
    except OSError:
        pass
    try:
        import torch

        capability, torch_version = torch.backends.cpu.get_cpu_capability(), torch.__version__
    except Exception:  # a record must not fail because torch does not import
        capability, torch_version = "unknown", "not importable"
    return {
        "cpu_model": model,
        "cores": os.cpu_count() or 0,
        "cpu_capability": capability,
        "avx512": "avx512f" in flags,
        "bf16_instructions": bool(flags & {"avx512_bf16", "amx_bf16"}),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch_version,
    }


def _now(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def record(argv: list[str] | None = None) -> dict[str, Any]:
    """The provenance of a result written now; ``argv`` the command (default: this process's, as typed)."""
    argv = list(argv if argv is not None else getattr(sys, "orig_argv", sys.argv))
    if argv and Path(argv[0]).name.startswith("python"):
        argv[0] = "python"
    # The result files being written are not sources: a run after another run's uncommitted results is clean.
    status = _git("status", "--porcelain", "--", "src", "bench", "examples", ":(exclude)bench/results")
    changed = [line.split(maxsplit=1)[-1] for line in status.splitlines() if line.strip()]
    started, load_before = _began
    return {
        "commit": _git("rev-parse", "HEAD"),
        "src_tree": _git("rev-parse", "HEAD:src"),
        "dirty": bool(changed),
        "dirty_files": changed[:20],
        "command": shlex.join(argv),
        "machine": _cpu(),
        "load_1min_before": round(load_before, 2),
        "load_1min_after": round(os.getloadavg()[0], 2),
        "started": _now(started),
        "finished": _now(time.time()),
    }


def stamp(doc: dict[str, Any], argv: list[str] | None = None) -> dict[str, Any]:
    """``doc`` with ``doc["provenance"] = record(argv)``, for the writer to dump."""
    doc["provenance"] = record(argv)
    return doc


def check(doc: Any) -> list[str]:
    """What a result file's provenance lacks or has of the wrong type; empty when complete."""
    prov = doc.get("provenance") if isinstance(doc, dict) else None
    if not isinstance(prov, dict):
        return ["no 'provenance' (regenerate the file with a writer that calls bench.provenance.stamp)"]
    bad = [f"provenance.{k}: missing or not {t.__name__}" for k, t in FIELDS.items() if not _is(prov.get(k), t)]
    machine = prov.get("machine") if isinstance(prov.get("machine"), dict) else {}
    bad += [f"provenance.machine.{k}: missing" for k in MACHINE_FIELDS if k not in machine]
    if isinstance(prov.get("src_tree"), str) and len(prov["src_tree"]) != 40:
        bad.append("provenance.src_tree: not a git tree hash")
    return bad


def _is(value: Any, kind: type) -> bool:
    if kind is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, kind)


def result_files() -> list[Path]:
    return sorted(p for pattern in RESULT_FILES for p in ROOT.glob(pattern))


def run_minutes(prov: dict[str, Any]) -> float:
    """The minutes a record's command ran, from its start and finish."""
    return (datetime.fromisoformat(prov["finished"]) - datetime.fromisoformat(prov["started"])).total_seconds() / 60


def status() -> str:
    """One line per result file: commit, src tree, commits touching src/ since, age, the minutes its command
    ran, the load before/after and whether the tree was dirty; then the minutes' sum
    ([Note: what make figures costs])."""
    lines = [f"{'file':40s} {'commit':9s} {'src tree':9s} {'src since':>9s} {'age':>8s} {'minutes':>7s}  load  dirty"]
    total, partial = 0.0, []
    for path in result_files():
        name = str(path.relative_to(ROOT))
        try:
            prov = json.loads(path.read_text()).get("provenance")
        except (OSError, ValueError, AttributeError):
            prov = None
        if not isinstance(prov, dict):
            last = _git("log", "-1", "--format=%h", "--", name)
            since = _git("rev-list", "--count", f"{last}..HEAD", "--", "src")
            when = _git("log", "-1", "--format=%cr", "--", name)
            lines.append(f"{name:40s} no provenance: last committed {last}, {when}; {since} src commits since")
            continue
        commit = prov.get("commit", "unknown")
        since = _git("rev-list", "--count", f"{commit}..HEAD", "--", "src")
        age_h = (time.time() - datetime.fromisoformat(prov["finished"]).timestamp()) / 3600
        minutes = run_minutes(prov)
        total += minutes
        if "--files" in str(prov.get("command")):
            partial.append(name)
        lines.append(
            f"{name:40s} {commit[:9]:9s} {str(prov.get('src_tree'))[:9]:9s} {since:>9s} {age_h:7.1f}h {minutes:7.1f} "
            f"{prov.get('load_1min_before')}/{prov.get('load_1min_after')}  {prov.get('dirty')}"
        )
    # [Note: what make figures costs] Each record's start and finish give the minutes its command ran; their
    # sum is what ``make figures`` took on the machines and loads these files were measured at (a command
    # that writes several files, cluster and slow_link, starts each file's record at its own part). A record
    # made by a command that reran part of its file (``--files``) counts that part only.
    note = f" (of {', '.join(partial)}: the last command's part only)" if partial else ""
    lines.append(f"the commands behind these files ran {total / 60:.1f} h in all{note}")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description="The committed result files: commit, src tree, src commits since, age")
    p.parse_args()
    print(status())


if __name__ == "__main__":
    main()
