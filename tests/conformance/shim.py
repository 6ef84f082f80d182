"""Imported first by every generated conformance test (copied beside them as ``_conformance_shim.py``).

PyTorch's FSDP2 tests are written for a machine with accelerators; this module lets their helpers from
``torch.testing._internal`` (which ship in the wheel) run them on CPU with gloo, two emulated devices:

- ``skip_if_lt_x_gpu(n)`` runs the test instead of skipping it (every rank is a CPU "device");
- ``FSDPTest`` (one process per rank) runs at world size 2 (a test class's own size capped at 2) and
  starts its ranks without the accelerator-count check (gloo over a file store, as the helper does);
- in the flatshard variant (``CONFORMANCE_VARIANT=flatshard``, set by run.py), the helpers that call
  ``fully_shard`` themselves (``MLPStack.parallelize``) call flatshard's.

It changes the test helpers only, never torch.distributed or flatshard.
"""

from __future__ import annotations

import functools
import os

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
