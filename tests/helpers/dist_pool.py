"""A pool of rank processes per world size, kept alive across tests (the suite's harness, tests/helpers/dist.py).

Starting a rank costs about two CPU-seconds (importing torch and flatshard, joining the gloo group), and
the suite runs some forty multi-process tests: so each world size gets one pool of W processes, joined in
one gloo group, that runs one test function after another. The processes are forked by a forkserver that
imported torch and flatshard once (``_PRELOAD``), so a pool started again after a failure, or for a
test that needs a fresh one, costs the gloo group and little else; each process starts with the
parent's environment of that moment, as a spawned one would. Between tasks every rank restores what
a test may change in its process: the RNG states, the default dtype, grad mode, the environment and
the ``flatshard`` logger's handlers and level; and it collects garbage.

A pool that fails is never reused: on any rank's error, on a timeout, or when a rank dies, every process
of the pool is killed and the next test of that world size starts a fresh pool. So a test that breaks a
collective can never leave the next test waiting on it. At the end of the session every pool meets at a
barrier before its group is destroyed (a rank that tears its group down early would break a peer still
connecting).
"""

from __future__ import annotations

import atexit
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import traceback
from collections.abc import Callable
from typing import Any

_SHUTDOWN = None
# imported once by the forkserver, before it forks any rank (a module missing here is skipped); "__main__":
# a script's own module (bench/figures/checkpoint_figures.py runs its worker from it), as spawn imports it
_PRELOAD = ["__main__", "numpy", "torch", "torch.distributed", "flatshard.fsdp", "flatshard.fsdp2", "flatshard.testing"]


def _serve(rank: int, world_size: int, store_path: str, environ: dict, tasks, results) -> None:
    import gc
    import logging
    import random

    import numpy as np
    import torch
    import torch.distributed as dist

    os.environ.clear()
    os.environ.update(environ)
    np.random.seed()  # a state of its own, as a freshly started process draws (random reseeds at fork itself)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=world_size)
    seed, py_state, np_state = torch.initial_seed(), random.getstate(), np.random.get_state()
    logger = logging.getLogger("flatshard")
    # What importing torch and flatshard made lives as long as the process: frozen, the collection after
    # each task skips it (about 0.1 CPU-second a collection otherwise, in every rank after every test).
    gc.collect()
    gc.freeze()
    while True:
        task = tasks.get()
        if task is _SHUTDOWN:
            break
        task_id, fn, args = task
        environ, handlers, level = dict(os.environ), list(logger.handlers), logger.level
        torch.manual_seed(seed)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            out = fn(rank, world_size, *args)
            # plain pickle (bytes), so tensors are copied rather than shared through file descriptors
            results.put((task_id, rank, "ok", pickle.dumps(out)))
        except BaseException:  # report everything, including assertion failures, to the parent
            results.put((task_id, rank, "error", traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(environ)
            logger.handlers[:] = handlers
            logger.setLevel(level)
            gc.collect()
    dist.barrier()
    dist.destroy_process_group()


def context():
    """The multiprocessing context of the pools: processes forked by a forkserver that imported
    ``_PRELOAD`` (read when the forkserver starts, with the first process)."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


class Pool:
    """``world_size`` rank processes in one gloo group; ``run`` executes one function on all of them."""

    def __init__(self, world_size: int):
        ctx = context()
        self.world_size = world_size
        self._tmp = tempfile.TemporaryDirectory()
        store = os.path.join(self._tmp.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        environ = dict(os.environ)
        self._procs = [
            ctx.Process(target=_serve, args=(r, world_size, store, environ, self._tasks[r], self._results), daemon=True)
            for r in range(world_size)
        ]
        for p in self._procs:
            p.start()
        self._next_id = 0
        self.broken = False

    def run(self, fn: Callable, args: tuple, timeout: float) -> dict[int, tuple[str, Any]]:
        """Every rank's (status, payload); a rank missing from the result gave none within ``timeout``."""
        self._next_id += 1
        task_id = self._next_id
        for q in self._tasks:
            q.put((task_id, fn, args))
        outcomes: dict[int, tuple[str, Any]] = {}
        while len(outcomes) < self.world_size:
            try:
                got_id, rank, status, payload = self._results.get(timeout=timeout if not outcomes else min(timeout, 60))
            except queue.Empty:
                break
            if got_id != task_id:  # a late answer from an earlier task cannot happen: that pool was killed
                continue
            outcomes[rank] = (status, payload)
            if status == "error":
                # peers of a failed rank may be stuck in a collective: give them a moment, then stop waiting
                timeout = 2.0
        if len(outcomes) < self.world_size or any(s == "error" for s, _ in outcomes.values()):
            self.kill()
        return outcomes

    def kill(self) -> None:
        self.broken = True
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._tmp.cleanup()

    def close(self) -> None:
        if self.broken:
            return
        for q in self._tasks:
            q.put(_SHUTDOWN)
        for p in self._procs:
            p.join(timeout=20)
        self.kill()


_POOLS: dict[int, Pool] = {}


def pool(world_size: int) -> Pool:
    current = _POOLS.get(world_size)
    if current is None or current.broken or not all(p.is_alive() for p in current._procs):
        if current is not None:
            current.kill()
        current = _POOLS[world_size] = Pool(world_size)
    return current


@atexit.register
def close_all() -> None:
    for p in list(_POOLS.values()):
        p.close()
    _POOLS.clear()
