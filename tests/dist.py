"""Run a function on N real processes (spawned, gloo, a file store) and check every rank's result.

Each rank runs ``fn(rank, world_size, *args)`` after ``init_process_group``; its return value (or its
traceback) comes back through a queue. A rank that neither returns nor fails within ``timeout``
seconds fails the test and every process is killed: a hang is a failure, never a wait.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from typing import Any, Callable


def _entry(fn, rank, world_size, store_path, args, results) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
        out = fn(rank, world_size, *args)
        # plain pickle (bytes), so tensors are copied rather than shared through file descriptors that
        # die with this process
        results.put((rank, "ok", pickle.dumps(out)))
    except BaseException:  # report everything, including assertion failures, to the parent
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_distributed(fn: Callable, world_size: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    """Returns the per-rank results in rank order; raises with every failing rank's traceback."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, store, args, results)) for r in range(world_size)]
        for p in procs:
            p.start()
        outcomes: dict[int, tuple[str, Any]] = {}
        try:
            while len(outcomes) < world_size:
                rank, status, payload = results.get(timeout=timeout)
                outcomes[rank] = (status, payload)
                if status == "error":
                    break  # peers of a failed rank may be stuck in a collective: stop waiting for them
        except queue.Empty:
            pass
        finally:
            for p in procs:
                p.join(timeout=5 if len(outcomes) == world_size else 0.5)
                if p.is_alive():
                    p.kill()
                    p.join()
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


def run_launcher(cmd: list[str], cwd, timeout: float, what: str) -> str:
    """Run a command that starts ranks itself (torchrun's machinery) and return its output.

    It gets a session of its own, so a hang is ended with every rank it started, and nothing else;
    a timeout or a non-zero exit fails the test with the end of the output."""
    import signal
    import subprocess

    import pytest

    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"{what} did not finish within {timeout:.0f}s:\n{log[-4000:]}")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{log[-4000:]}"
    return log
