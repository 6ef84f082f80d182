"""Rank processes for the fuzzer (bench/fuzz/): one pool of W spawned processes per world size, joined
in one gloo group through a file store, running one configuration after another.

Starting a rank costs about two CPU-seconds (importing torch, joining the group), so a pool serves many
configurations. Between them every rank restores its environment, RNG seed and default dtype. A pool is
never reused after anything went wrong: on a rank's error, a rank that died, or a configuration that
did not finish within its timeout (a hang is a failure, never a wait), every process of the pool is
killed and the next configuration of that world size starts a fresh pool. A pool whose ranks hold many
process groups (each configuration with ``sharding_factor=F`` makes its own) is retired too, as idle
gloo groups slow every collective.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import tempfile
import traceback
from collections.abc import Callable
from datetime import timedelta

_SHUTDOWN = None
MAX_GROUPS = 48  # retire a pool whose ranks hold more process groups than this
STARTUP_S = 300.0  # how long W ranks may take to start and join their group


def _serve(rank: int, world: int, store: str, tasks, results) -> None:
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=timedelta(seconds=300)
    )
    results.put((0, rank, "ready", None))
    while True:
        task = tasks.get()
        if task is _SHUTDOWN:
            break
        task_id, fn, args = task
        environ = dict(os.environ)
        torch.manual_seed(0)
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
        try:
            results.put((task_id, rank, "ok", fn(rank, world, *args)))
        except BaseException:  # everything, assertion failures included, goes to the parent
            results.put((task_id, rank, "error", traceback.format_exc()))
        finally:
            os.environ.clear()
            os.environ.update(environ)
            gc.collect()
    dist.barrier()
    dist.destroy_process_group()


class Pool:
    """``world`` rank processes in one gloo group; ``run`` executes one function on all of them."""

    def __init__(self, world: int):
        ctx = mp.get_context("spawn")
        self.world = world
        self._tmp = tempfile.TemporaryDirectory(prefix="fuzz-pool-")
        store = os.path.join(self._tmp.name, "store")
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._results = ctx.Queue()
        self._procs = [
            ctx.Process(target=_serve, args=(r, world, store, self._tasks[r], self._results), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self._next = 0
        self._ready: set[int] = set()
        self.broken = False

    def _wait_ready(self) -> bool:
        """Starting ranks (importing torch, joining the group) is not timed as the configuration's run: on
        a loaded machine it can take longer than a small configuration does."""
        waiting = set(range(self.world)) - self._ready
        while waiting:
            try:
                task_id, rank, status, _ = self._results.get(timeout=STARTUP_S)
            except queue.Empty:
                return False
            if task_id == 0 and status == "ready":
                self._ready.add(rank)
                waiting.discard(rank)
        return True

    def run(self, fn: Callable, args: tuple, timeout: float) -> dict:
        """{rank: (status, payload)}; a rank missing from it gave nothing within ``timeout`` seconds."""
        if not self._wait_ready():
            self.kill()
            return {}
        self._next += 1
        for q in self._tasks:
            q.put((self._next, fn, args))
        outcomes: dict = {}
        while len(outcomes) < self.world:
            try:
                task_id, rank, status, payload = self._results.get(timeout=timeout)
            except queue.Empty:
                break
            if task_id != self._next:
                continue
            outcomes[rank] = (status, payload)
            if status == "error":
                timeout = 10.0  # its peers may wait in a collective: a moment for their own error, then stop
        groups = max((p.get("groups", 0) for s, p in outcomes.values() if s == "ok"), default=0)
        if len(outcomes) < self.world or any(s == "error" for s, _ in outcomes.values()) or groups > MAX_GROUPS:
            self.kill()
        return outcomes

    def kill(self) -> None:
        self.broken = True
        for p in self._procs:
            if p.is_alive() and p.pid is not None:
                try:
                    os.kill(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for p in self._procs:
            p.join(timeout=10)
        self._tmp.cleanup()

    def close(self) -> None:
        if self.broken:
            return
        for q in self._tasks:
            q.put(_SHUTDOWN)
        for p in self._procs:
            p.join(timeout=20)
        self.kill()


class Pools:
    """One live pool per world size, started on first use and replaced once broken."""

    def __init__(self):
        self._pools: dict[int, Pool] = {}

    def get(self, world: int) -> Pool:
        pool = self._pools.get(world)
        if pool is None or pool.broken or not all(p.is_alive() for p in pool._procs):
            if pool is not None:
                pool.kill()
            pool = self._pools[world] = Pool(world)
        return pool

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()
