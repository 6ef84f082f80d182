"""What flatshard's own tests read or change beyond the public API, in one documented place.

Not for training scripts: these helpers reach into the engine (runtime/) to check what it does, so
they change when it does. Everything a user needs is public (``flatshard.units(model)``,
``record_comms``, ``record_memory``, ``memory_bytes``).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from torch import nn

from flatshard.runtime import build
from flatshard.runtime.mesh import group_timeout
from flatshard.runtime.tree import unit_hosts, units_under


def engine_units(model: nn.Module) -> list:
    """The engine's ``Unit`` objects under ``model`` (runtime/unit.py), for white-box assertions."""
    return units_under(model)


def shard_ranges(model: nn.Module) -> dict[int, tuple[int, int]]:
    """id(shard view) -> [start, end) of the flattened original parameter that this rank holds."""
    out = {}
    for unit in units_under(model):
        for view, rng in zip(unit.shard_views, unit.owner_layout.param_ranges(unit.owner_rank)):
            out[id(view)] = rng
    return out


def gathered_bytes(model: nn.Module) -> list[int]:
    """Bytes each unit's unsharded flat holds now (0 once resharded), in unit order."""
    return [u.unsharded.untyped_storage().nbytes() for u in units_under(model)]


def is_gathered(module: nn.Module) -> bool:
    """Whether the unit hosted by ``module`` holds (or is receiving) its unsharded flat."""
    return module._unit.gathered


def flat_shards(model: nn.Module) -> list[torch.Tensor]:
    """Each unit's flat shard (the tensor itself, not a copy), in unit order."""
    return [u.flat_shard for u in units_under(model)]


def gathered_count(model: nn.Module) -> int:
    """How many units besides the root hold their unsharded flat now."""
    return sum(u.gathered and not u.is_root for u in units_under(model))


@contextlib.contextmanager
def on_transition(model: nn.Module, fn: Callable[[], None]) -> Iterator[None]:
    """Call ``fn()`` at every unit transition of the root ``model`` (where memory recorders sample)."""

    class _Sampler:
        def sample(self) -> None:
            fn()

    ctx = unit_hosts(model)[0]._unit.ctx
    sampler = _Sampler()
    ctx.memory_recorders.append(sampler)
    try:
        yield
    finally:
        ctx.memory_recorders.remove(sampler)


def set_overlap_reductions(model: nn.Module, overlap: bool) -> None:
    """Leave each reduction in flight while the next unit computes, or not ([Note: reductions in flight])."""
    ctx = unit_hosts(model)[0]._unit.ctx
    ctx.config = dataclasses.replace(ctx.config, overlap_reductions=overlap)


@contextlib.contextmanager
def offload_on_cpu() -> Iterator[None]:
    """Let ``CPUOffload(offload_params=True)`` run with CPU as the compute device (a machine without an
    accelerator): the flat shards are then separate CPU tensors copied before every gather."""
    with mock.patch.object(build, "offload_compute_device", build._offload_device):
        yield


def units_keeping_full_grads(model: nn.Module) -> list[str]:
    """Names of the units whose unsharded flat still holds a full-size gradient."""
    return [u.name for u in units_under(model) if u.unsharded.grad is not None]


def group_timeouts(model: nn.Module) -> list:
    """The timeouts of the root unit's shard and replicate groups (those that exist), in that order."""
    groups = units_under(model)[0].groups
    return [group_timeout(g) for g in (groups.shard_group, groups.replicate_group) if g is not None]
