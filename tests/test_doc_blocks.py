"""Every python and shell code block of README.md and docs/**/*.md runs as written, so a snippet cannot rot.

How a block is run is said by an HTML comment on the line before it (a user reading the page sees none):

* no comment, or ``<!-- run -->``: a python block runs as a script in one process; the shell blocks of a
  page run in order, as one user typing them from the repository root (``flatshard``, ``python`` and
  ``torchrun`` are this checkout's);
* ``<!-- run: torchrun -->``: a python block is a training script, run by ``torchrun --nproc-per-node 2``
  on CPU (gloo);
* ``<!-- syntax-only: REASON -->``: a block that needs a GPU, several machines, root, minutes, packages
  installed or names of the reader's own script is compiled (python) or ``bash -n``-checked (shell);
  the reason is required.

Blocks in other languages (``text``, ``mermaid``, none) are not code. Identical blocks run once. The counts
are printed (``pytest -s``) and checked against a floor, so marking everything syntax-only fails too."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PYTHON_LANGS = {"python", "py"}
SHELL_LANGS = {"sh", "bash", "shell", "console"}
FENCE = re.compile(r"^```([\w-]*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!--\s*(run(?::\s*torchrun)?|syntax-only:(.*?))\s*-->\s*$")
TIMEOUT_S = 240
MIN_RUN = 15  # blocks that really run today: fewer means blocks were marked away


@dataclass(frozen=True)
class Block:
    page: str
    line: int
    lang: str  # "python" or "sh"
    how: str  # "run", "torchrun" or "syntax"
    code: str
    reason: str = ""

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def blocks_of(text: str, page: str) -> list[Block]:
    found = []
    for m in FENCE.finditer(text):
        lang = m.group(1).lower()
        if lang not in PYTHON_LANGS | SHELL_LANGS:
            continue
        before = text[: m.start()].rstrip("\n").splitlines()
        mark = MARK.search(before[-1]) if before else None
        how, reason = "run", ""
        if mark and mark.group(1).startswith("syntax-only"):
            how, reason = "syntax", (mark.group(2) or "").strip()
        elif mark and "torchrun" in mark.group(1):
            how = "torchrun"
        found.append(
            Block(
                page=page,
                line=text.count("\n", 0, m.start()) + 1,
                lang="python" if lang in PYTHON_LANGS else "sh",
                how=how,
                code=m.group(2),
                reason=reason,
            )
        )
    return found


def all_blocks() -> list[Block]:
    return [b for p in pages() for b in blocks_of(p.read_text(), p.relative_to(ROOT).as_posix())]


def _env(bin_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), env.get("PYTHONPATH", "")])
    env["NO_COLOR"] = "1"
    return env


REFUSE = "echo 'the doc test installs nothing: mark this block <!-- syntax-only: installs packages -->' >&2; exit 3"


def _shims(bin_dir: Path) -> None:
    """``flatshard``, ``python`` and ``torchrun`` as a user of this checkout has them; ``pip`` (and
    ``python -m pip``) refuse, so a block that installs cannot change an environment."""
    for name, args in (("flatshard", "-m flatshard"), ("python", ""), ("torchrun", "-m torch.distributed.run")):
        shim = bin_dir / name
        guard = f'case "$1 $2" in "-m pip"*) {REFUSE};; esac\n' if name == "python" else ""
        shim.write_text(f'#!/bin/sh\n{guard}exec "{sys.executable}" {args} "$@"\n')
        shim.chmod(0o755)
    for name in ("pip", "pip3", "python3", "uv"):
        shim = bin_dir / name
        shim.write_text(f"#!/bin/sh\n{REFUSE}\n")
        shim.chmod(0o755)


def _run(argv: list[str], cwd: Path, env: dict[str, str]) -> str | None:
    """None when it succeeded, else what it printed last."""
    try:
        done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return f"timed out after {TIMEOUT_S} s"
    if done.returncode == 0:
        return None
    return f"exit status {done.returncode}\nstdout: {done.stdout[-1500:]}\nstderr: {done.stderr[-3000:]}"


TIMES: dict[str, float] = {}  # seconds per job (its first block's place), printed by the test


def check(job: list[Block], work: Path, bin_dir: Path) -> list[str]:
    """Run one job (a python block, or a page's shell blocks in order); the failures, as messages."""
    start = time.perf_counter()
    try:
        return _check(job, work, bin_dir)
    finally:
        TIMES[job[0].where] = time.perf_counter() - start


def _check(job: list[Block], work: Path, bin_dir: Path) -> list[str]:
    env = _env(bin_dir)
    failures = []
    for i, b in enumerate(job):
        if b.how == "syntax" and not b.reason:
            failures.append(f"{b.where}: syntax-only without a reason")
            continue
        if b.lang == "python" and b.how == "syntax":
            try:
                compile(b.code, b.where, "exec")
            except SyntaxError as e:
                failures.append(f"{b.where}: {e}")
            continue
        script = work / f"block_{abs(hash((b.where, i)))}.{'py' if b.lang == 'python' else 'sh'}"
        script.write_text(b.code if b.lang == "python" else "set -eo pipefail\n" + b.code)
        if b.lang == "sh":
            argv = ["bash", "-n" if b.how == "syntax" else "-e", str(script)]
            cwd = ROOT
        elif b.how == "torchrun":
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
            cwd = work
        else:
            argv, cwd = [sys.executable, str(script)], work
        if (out := _run(argv, cwd, env)) is not None:
            failures.append(f"{b.where} ({b.lang}, {b.how}): {out}")
    return failures


def jobs_of(blocks: list[Block]) -> list[list[Block]]:
    """A page's shell blocks together, in order; each python block alone; identical code once."""
    seen: set[tuple[str, str, str]] = set()
    shell: dict[str, list[Block]] = {}
    jobs: list[list[Block]] = []
    for b in blocks:
        key = (b.lang, b.how, b.code)
        if key in seen:
            continue
        seen.add(key)
        if b.lang == "sh" and b.how != "syntax":
            shell.setdefault(b.page, []).append(b)
        else:
            jobs.append([b])
    return list(shell.values()) + jobs


def run_all(blocks: list[Block], workers: int = 2) -> list[str]:
    with tempfile.TemporaryDirectory(prefix="doc_blocks_") as tmp:
        bin_dir = Path(tmp) / "bin"
        bin_dir.mkdir()
        _shims(bin_dir)
        jobs = jobs_of(blocks)
        # the slowest first (a page's shell sequence, then torchrun scripts), so two workers finish together
        jobs.sort(key=lambda j: (j[0].how == "syntax", j[0].how != "torchrun" and j[0].lang == "python"))
        work_dirs = []
        for i in range(len(jobs)):
            work_dirs.append(Path(tmp) / f"job{i}")
            work_dirs[-1].mkdir()
        with ThreadPoolExecutor(workers) as pool:
            results = pool.map(lambda iw: check(jobs[iw], work_dirs[iw], bin_dir), range(len(jobs)))
            return [f for r in results for f in r]


def counts(blocks: list[Block]) -> dict[str, int]:
    return {
        "run": sum(b.how != "syntax" for b in blocks),
        "syntax-only": sum(b.how == "syntax" for b in blocks),
    }


@pytest.mark.slow
def test_every_code_block_runs():
    blocks = all_blocks()
    n = counts(blocks)
    reasons: dict[str, int] = {}
    for b in blocks:
        if b.how == "syntax":
            reasons[b.reason] = reasons.get(b.reason, 0) + 1
    print(f"\ndoc blocks: {n['run']} run, {n['syntax-only']} syntax-only, in {len(pages())} pages")
    for reason, k in sorted(reasons.items(), key=lambda kv: -kv[1]):
        print(f"  syntax-only x{k}: {reason}")
    assert n["run"] >= MIN_RUN, f"only {n['run']} blocks run (at least {MIN_RUN} did): were blocks marked away?"
    started = time.perf_counter()
    failures = run_all(blocks)
    slowest = sorted(TIMES.items(), key=lambda kv: -kv[1])[:6]
    print(f"  {time.perf_counter() - started:.0f} s; slowest: " + ", ".join(f"{w} {t:.0f} s" for w, t in slowest))
    assert not failures, "code blocks that do not run as written:\n\n" + "\n\n".join(failures)


BROKEN = """# a page

```python
import torch
print(torch.zeros(2) + undefined_name)
```

<!-- run: torchrun -->
```python
import torch.distributed as dist
dist.init_process_group("gloo")
assert dist.get_world_size() == 3, "two ranks"
```

```sh
flatshard plan --no-such-flag
```

```sh
pip install --no-such-package-here
```

<!-- syntax-only: a fragment -->
```python
def broken(:
```

<!-- syntax-only: needs a GPU -->
```sh
if then fi
```

<!-- syntax-only: -->
```python
x = 1
```

```text
not code
```
"""


@pytest.mark.slow
def test_a_broken_block_is_reported():
    """Each kind of block fails on a broken snippet: a python script, a torchrun script, a shell command,
    a syntax-only python and shell block, and a syntax-only mark with no reason."""
    blocks = blocks_of(BROKEN, "broken.md")
    assert [(b.lang, b.how) for b in blocks] == [
        ("python", "run"),
        ("python", "torchrun"),
        ("sh", "run"),
        ("sh", "run"),
        ("python", "syntax"),
        ("sh", "syntax"),
        ("python", "syntax"),
    ]
    failures = run_all(blocks)
    assert sorted(f.split(" ")[0].rstrip(":") for f in failures) == sorted(b.where for b in blocks), failures
