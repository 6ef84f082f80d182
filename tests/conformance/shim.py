"""Imported first by every generated conformance test (copied beside them as ``_conformance_shim.py``).

PyTorch's FSDP2 tests are written for a machine with accelerators; this module lets their helpers from
``torch.testing._internal`` (which ship in the wheel) run them on CPU with gloo, two emulated devices:

- ``skip_if_lt_x_gpu(n)`` runs the test instead of skipping it (every rank is a CPU "device");
- ``FSDPTest`` (one process per rank) runs at world size 2 (a test class's own size capped at 2) and
  starts its ranks without the accelerator-count check (gloo over a file store, as the helper does);
- in the flatshard variant (``CONFORMANCE_VARIANT=flatshard``, set by run.py), the helpers that call
  ``fully_shard`` themselves (``MLPStack.parallelize``) call flatshard's.

- a rank whose test passed ends its process without finalizing the interpreter ([Note: a rank that
  passed leaves without finalizing]), where gloo can abort it after the test.

It changes the test helpers only, never torch.distributed or flatshard.
"""

from __future__ import annotations

import functools
import os
import sys

import torch
import torch.distributed as dist
from torch.testing._internal import common_distributed, common_fsdp

WORLD_SIZE = 2
VARIANT = os.environ.get("CONFORMANCE_VARIANT", "torch")


def _run_anyway(x, *, allow_cpu=False):  # noqa: ARG001 - skip_if_lt_x_gpu's signature
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            return func(*args, **kwargs)

        return wrapper

    return decorator


common_distributed.skip_if_lt_x_gpu = _run_anyway


def _fsdp_test_run(cls, rank, test_name, file_name, pipe, **kwargs):  # noqa: ARG001 - the helper's signature
    """``FSDPTest._run`` on CPU: one gloo process per rank, no accelerator to select."""
    self = cls(test_name)
    self.rank = rank
    self.file_name = file_name
    dist.init_process_group(init_method=self.init_method, backend="gloo", world_size=int(self.world_size), rank=rank)
    dist.barrier()
    torch._dynamo.reset()
    common_fsdp.set_rng_seed()
    self.run_test(test_name, pipe)
    torch._dynamo.reset()
    dist.barrier()
    dist.destroy_process_group()
    # [Note: a rank that passed leaves without finalizing] Past this line the test has run and passed on
    # this rank (a failing one exits inside run_test with its own code). If the process then ends as Python
    # does, finalizing the interpreter, a gloo worker thread may still be destroying a finished collective
    # whose tensors hold Python objects: it takes the GIL during finalization, the thread is ended by
    # pthread_exit inside a noexcept C++ frame, std::terminate, "terminate called without an active
    # exception", SIGABRT (core dump: c10d::ProcessGroupGloo::runLoop -> ~AsyncAllgatherCoalescedWork ->
    # decref -> take_gil -> PyThread_exit_thread, beside Py_FinalizeEx). FSDPTest then fails the test with
    # "Expected exit code 0 but got -6" when it is rank 0's. It is PyTorch's (pytorch/pytorch#190489, the
    # atexit fix of #179291 abandoned) and struck PyTorch's FSDP2 and flatshard alike: 9 of 50 processes
    # of a two-rank fully_shard run with full_tensor() aborted so, 0 of 50 when they ended here with
    # os._exit; through this harness 1 of 30 runs of test_register_fsdp_forward_method's model once, 0 of
    # 100 another time. Ending the process here, output flushed, skips only that finalization.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


_fsdp_test_run.__name__ = _fsdp_test_run.__qualname__ = "_run"  # spawn pickles the method by this name
common_fsdp.FSDPTest._run = classmethod(_fsdp_test_run)
common_fsdp.FSDPTest.world_size = property(lambda self: WORLD_SIZE)  # noqa: ARG005


def _cap_world_size(cls, **kwargs):
    """A test class's own ``world_size`` (4 or 8 on CPU) is capped at 2 processes: two emulated devices
    on a 2-core machine. Tests that need more ranks (a 2x2x2 mesh) then fail in both variants alike."""
    super(common_fsdp.FSDPTest, cls).__init_subclass__(**kwargs)
    own = cls.__dict__.get("world_size")
    if isinstance(own, property):
        cls.world_size = property(lambda self, _get=own.fget: min(_get(self), WORLD_SIZE))


common_fsdp.FSDPTest.__init_subclass__ = classmethod(_cap_world_size)
common_fsdp.FSDPTestMultiThread.world_size = property(lambda self: WORLD_SIZE)  # noqa: ARG005

if VARIANT == "flatshard":
    import flatshard

    common_fsdp.fully_shard = flatshard.fully_shard
