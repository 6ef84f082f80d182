"""examples/train_gpt.py's figure runs, launched as users launch it (one command, 2 local ranks through
torchrun's machinery), once per strategy for the whole session: tests/test_example.py checks their
--json figures and the sockets they listened on, which the run records by reading
the kernel's socket table while it goes (sockets.py). One launch serves both: starting the launcher and
its ranks (each importing torch and flatshard) costs more than the run itself.

The FULL_SHARD run leaves MASTER_ADDR unset and the NO_SHARD run sets it to 127.0.0.1: a local launch
listens on loopback only either way."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tests.helpers.sockets import run_watched

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "train_gpt.py"
WORLD = 2
TIMEOUT_S = 150  # one run takes ~12 s on two cores; a hang must fail, not wait
MASTER_ADDR = {"FULL_SHARD": None, "NO_SHARD": "127.0.0.1"}  # strategy -> MASTER_ADDR of its run


@dataclass(frozen=True)
class FigureRun:
    figures: dict  # what --json wrote
    listeners: frozenset  # (address, port, pid) of every socket the launcher or a rank listened on
    launcher: int  # the launcher's pid
    master_addr: str | None


@functools.cache
def _workdir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="flatshard-train-gpt-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def figure_run(strategy: str) -> FigureRun:
    """A tiny GPT with odd widths (dim 33: padding) for 20 steps under ``strategy``; run on first use."""
    out = _workdir() / f"{strategy}.json"
    cmd = [sys.executable, str(SCRIPT), "--nproc", str(WORLD), "--strategy", strategy]
    cmd += ["--model", "tiny", "--dim", "33", "--heads", "3", "--steps", "20", "--batch-size", "8"]
    cmd += ["--log-interval", "5", "--eval-batches", "2", "--sample-tokens", "8", "--quiet", "--json", str(out)]
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    if MASTER_ADDR[strategy] is not None:
        env["MASTER_ADDR"] = MASTER_ADDR[strategy]
    log, seen, launcher = run_watched(cmd, ROOT, env, TIMEOUT_S, f"train_gpt.py --strategy {strategy}")
    assert out.exists(), f"no JSON written:\n{log[-4000:]}"
    return FigureRun(json.loads(out.read_text()), frozenset(seen), launcher, MASTER_ADDR[strategy])
