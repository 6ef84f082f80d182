"""Run a function on N real processes (spawned, gloo, a file store) and check every rank's result.

Each rank runs ``fn(rank, world_size, *args)`` in a process that has joined a gloo group of
``world_size`` ranks; its return value (or its traceback) comes back through a queue. A rank that
neither returns nor fails within ``timeout`` seconds fails the test and every process of its pool is
killed: a hang is a failure, never a wait. Processes are kept per world size across tests
(dist_pool.py) and replaced after any failure.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Callable
from typing import Any

from tests.helpers import dist_pool


def run_distributed(
    fn: Callable, world_size: int, *args: Any, timeout: float = 180.0, fresh: bool = False
) -> list[Any]:
    """Returns the per-rank results in rank order; raises with every failing rank's traceback.

    The ranks come from the pool of ``world_size`` processes (tests/helpers/dist_pool.py), started on first use.
    ``fresh``: the pool is retired after this task (for tests that leave a process group timed out)."""
    pool = dist_pool.pool(world_size)
    try:
        outcomes = pool.run(fn, args, timeout)
    finally:
        if fresh:
            pool.kill()
    errors = [f"rank {r}:\n{payload}" for r, (s, payload) in sorted(outcomes.items()) if s == "error"]
    missing = sorted(set(range(world_size)) - set(outcomes))
    if errors or missing:
        msg = "\n".join(errors)
        if missing and not errors:
            msg += f"\nranks {missing} gave no result within {timeout:.0f}s (hung or died)"
        elif missing:
            msg += f"\n(ranks {missing} were stopped after the failure above)"
        raise AssertionError(msg)
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


def run_launcher(cmd: list[str], cwd, timeout: float, what: str, returncodes: tuple[int, ...] = (0,)) -> str:
    """Run a command that starts ranks itself (torchrun's machinery) and return its output.

    It gets a session of its own, so a hang is ended with every rank it started, and nothing else;
    a timeout or an exit status not in ``returncodes`` fails the test with the end of the output."""
    import signal
    import subprocess

    import pytest

    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:.0f}s:\n{log[-4000:]}")
    assert proc.returncode in returncodes, f"{what} exited {proc.returncode}:\n{log[-4000:]}"
    return log


def raised(fn) -> str:
    """What calling ``fn`` raises, as "Class/Base/Base: message" (the class and its first two bases, so a
    check can name the one a user would catch), or "no error"."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the class and message are the answer
        return f"{'/'.join(c.__name__ for c in type(e).__mro__[:3])}: {e}"
    return "no error"
