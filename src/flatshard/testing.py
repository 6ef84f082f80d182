"""What flatshard's own tests read or change beyond the public API, in one documented place.

Not for training scripts: these helpers reach into the engine (runtime/) to check what it does, so
they change when it does. Everything a user needs is public (``flatshard.units(model)``,
``record_comms``, ``record_memory``, ``memory_bytes``).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from flatshard.runtime.build import units as construction
from flatshard.runtime.comm.mesh import group_timeout
from flatshard.runtime.comm.streams import RecordingStreams
from flatshard.runtime.schedule import run_context
from flatshard.runtime.tree import UnitHost, unit_hosts, units_under


def engine_units(model: nn.Module) -> list:
    """The engine's ``Unit`` objects under ``model`` (runtime/unit.py), for white-box assertions."""
    return units_under(model)


def flat_groups(model: nn.Module) -> list:
    """Every unit's flat groups (runtime/flat_group.py) under ``model``, in unit order."""
    return [g for u in units_under(model) for g in u.flat_groups]


def shard_ranges(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(shard view) -> [start, end) of the flattened original parameter that this rank holds."""
    out = {}
    for group in flat_groups(model):
        for view, rng in zip(group.shard_views, group.owner_layout.param_ranges(group.owner_rank)):
            out[id(view)] = rng
    return out


def gathered_bytes(model: nn.Module) -> list[int]:
    """Bytes each flat group's unsharded flat holds now (0 once resharded), in unit order."""
    return [g.unsharded.untyped_storage().nbytes() for g in flat_groups(model)]


def is_gathered(module: UnitHost) -> bool:
    """Whether the unit hosted by ``module`` holds (or is receiving) its unsharded flat."""
    return module._unit.gathered


def flat_shards(model: nn.Module) -> list[torch.Tensor]:
    """Each flat group's flat shard (the tensor itself, not a copy), in unit order."""
    return [g.flat_shard for g in flat_groups(model)]


def gathered_count(model: nn.Module) -> int:
    """How many units besides the root hold their unsharded flat now."""
    return sum(u.gathered and not u.is_root for u in units_under(model))


@contextlib.contextmanager
def on_transition(model: nn.Module, fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` at every unit transition of the root ``model`` (where memory recorders sample)."""

    class _Sampler:
        def sample(self) -> None:
            fn()

    ctx = run_context(unit_hosts(model)[0]._unit)
    sampler = _Sampler()
    ctx.memory_recorders.append(sampler)
    try:
        yield
    finally:
        ctx.memory_recorders.remove(sampler)


@contextlib.contextmanager
def record_streams(model: nn.Module, streams=None) -> Iterator:
    """Run the root ``model``'s schedule against a recording stand-in for the device's streams (a
    ``runtime.streams.RecordingStreams``, or ``streams``): every record, wait and buffer access it would
    issue on an accelerator is logged ([Note: stream discipline]); ``runtime.streams.check_schedule``
    checks the log."""
    ctx = run_context(unit_hosts(model)[0]._unit)
    recording = streams if streams is not None else RecordingStreams()
    before, ctx.streams = ctx.streams, recording
    try:
        yield recording
    finally:
        ctx.streams = before


def set_overlap_reductions(model: nn.Module, overlap: bool) -> None:
    """Leave each reduction in flight while the next unit computes, or not ([Note: reductions in flight])."""
    ctx = run_context(unit_hosts(model)[0]._unit)
    ctx.config = dataclasses.replace(ctx.config, overlap_reductions=overlap)


@contextlib.contextmanager
def offload_on_cpu() -> Iterator[None]:
    """Let ``CPUOffload(offload_params=True)`` run with CPU as the compute device (a machine without an
    accelerator): the flat shards are then separate CPU tensors copied before every gather."""
    with mock.patch.object(construction, "offload_compute_device", construction._offload_device):
        yield


def units_keeping_full_grads(model: nn.Module) -> list[str]:
    """Names of the units whose unsharded flat still holds a full-size gradient."""
    return [u.name for u in units_under(model) if any(g.unsharded.grad is not None for g in u.flat_groups)]


def group_timeouts(model: nn.Module) -> list:
    """The timeouts of the root unit's shard and replicate groups (those that exist), in that order."""
    groups = units_under(model)[0].flat_group.groups
    return [group_timeout(g) for g in (groups.shard_group, groups.replicate_group) if g is not None]


# torch.distributed's entry points that communicate (collectives, object collectives, point-to-point,
# barriers), by the names the module exports; one missing from a torch release is skipped.
DIST_ENTRY_POINTS = (
    "all_reduce", "all_reduce_coalesced", "all_gather", "all_gather_into_tensor", "all_gather_coalesced",
    "all_gather_object", "_all_gather_base", "reduce_scatter", "reduce_scatter_tensor", "_reduce_scatter_base",
    "reduce", "broadcast", "broadcast_object_list", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "batch_isend_irecv",
    "send_object_list", "recv_object_list", "barrier", "monitored_barrier",
)  # fmt: skip
# Namespaces of the dispatcher's communication operators: what ProcessGroup's methods and the functional
# collectives (DTensor's redistributions) run; waiting on one already issued (or wrapping its result) is not
# counted.
DIST_OP_NAMESPACES = ("c10d", "_c10d_functional", "c10d_functional")
NOT_COMMUNICATION = ("wait_tensor", "_wrap_tensor_autograd")


@dataclasses.dataclass
class DistCounts:
    """What ``count_dist_calls`` saw: ``calls`` by entry point (every thread; a call made inside another
    counted call, e.g. ``all_gather_object``'s own ``all_gather``, is not counted again) and ``ops`` by
    dispatcher operator (this thread). One ``dist.all_reduce`` is ``calls["all_reduce"] == 1`` and
    ``ops["c10d.allreduce_"] == 1``."""

    calls: collections.Counter = dataclasses.field(default_factory=collections.Counter)
    ops: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    def __bool__(self) -> bool:
        return bool(self.calls or self.ops)


class _CountOps(TorchDispatchMode):
    def __init__(self, counts: DistCounts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        space, name = func.namespace, func.__name__.split(".")[0]
        if space in DIST_OP_NAMESPACES and name not in NOT_COMMUNICATION:
            self.counts.ops[f"{space}.{name}"] += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def count_dist_calls() -> Iterator[DistCounts]:
    """Count the communication that torch.distributed does while the block runs, whoever asks for it.

    Two views, since one alone can miss some: torch.distributed's entry points (``DIST_ENTRY_POINTS``)
    are replaced, for the block only and in ``torch.distributed`` and its ``distributed_c10d`` module, by
    counting wrappers, which see calls from any thread; and a dispatch mode counts the communication
    operators that run on this thread, which sees a ``ProcessGroup`` method called directly and the
    functional collectives. A test-only patch: nothing in flatshard patches torch."""
    counts, local = DistCounts(), threading.local()

    def counting(name: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            depth = getattr(local, "depth", 0)
            if depth == 0:
                counts.calls[name] += 1
            local.depth = depth + 1
            try:
                return fn(*args, **kwargs)
            finally:
                local.depth = depth

        return wrapper

    with contextlib.ExitStack() as stack:
        for name in DIST_ENTRY_POINTS:
            fn = getattr(c10d, name, None)
            if fn is None:
                continue
            wrapped = counting(name, fn)
            for module in (dist, c10d):
                if getattr(module, name, None) is fn:
                    stack.enter_context(mock.patch.object(module, name, wrapped))
        stack.enter_context(_CountOps(counts))
        yield counts
