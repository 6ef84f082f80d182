"""Reducing one unit's full-size gradient to this rank's grad shard.

Two halves, so the collective can stay in flight while backward goes on: ``start`` casts the
unsharded flat's gradient to the reduce dtype and issues the reduce-scatter over the shard group
(or, with F = 1, the all-reduce over the replicate group); ``finish`` waits for it, all-reduces the
shard across replicas when there are both (hybrid), divides by the data-parallel size and casts to
the master dtype. The full-size gradient is released as soon as the reduce-scatter is done.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch

from flatshard.runtime import collectives
from flatshard.runtime.mesh import ShardGroups


@dataclass(frozen=True)
class ReduceSpec:
    """What a unit's reduction needs to know about the unit."""

    groups: ShardGroups
    shard_sizes: list[int]  # every shard rank's shard, in rank order (equal unless shard_boundaries is ragged)
    reduce_dtype: torch.dtype
    label: str  # the unit's name, for profiler labels
    divide_factor: Optional[float] = None  # what the summed gradient is divided by (None: the data-parallel size)


@dataclass
class PendingReduction:
    work: Optional[Any]  # a Work (or a point-to-point exchange) still in flight, or None
    full: Optional[torch.Tensor]  # the gradient being reduced, kept alive until the collective is done
    out: torch.Tensor  # this rank's reduced shard (reduce dtype)
    all_reduce_after: bool  # hybrid: the shard still has to be all-reduced across replicas

    def nbytes(self) -> tuple[int, int]:
        """(full-size gradient bytes, reduced shard bytes) held now."""
        full = 0 if self.full is None or self.full is self.out else self.full.untyped_storage().nbytes()
        return full, self.out.untyped_storage().nbytes()


Record = Callable[[collectives.CollectiveResult, str], None]


def start(grad: torch.Tensor, spec: ReduceSpec, record: Record, *, async_op: bool, tag: int = 0) -> PendingReduction:
    groups = spec.groups
    full = grad if grad.dtype == spec.reduce_dtype else grad.to(spec.reduce_dtype)
    if groups.shard_size > 1:
        out = torch.empty(spec.shard_sizes[groups.shard_rank], dtype=spec.reduce_dtype, device=grad.device)
        with torch.profiler.record_function(f"flatshard::reduce_scatter ({spec.label})"):
            result = collectives.reduce_scatter(
                out, full, groups.shard_group, async_op=async_op, tag=tag, sizes=spec.shard_sizes
            )
        record(result, "shard")
        return PendingReduction(result.work, full, out, groups.replicate_size > 1)
    if groups.replicate_size > 1:
        with torch.profiler.record_function(f"flatshard::all_reduce ({spec.label})"):
            result = collectives.all_reduce(full, groups.replicate_group, async_op=async_op)
        record(result, "replicate")
        return PendingReduction(result.work, full, full, False)
    return PendingReduction(None, full, full, False)


def finish(pending: PendingReduction, spec: ReduceSpec, master_dtype: torch.dtype, record: Record) -> torch.Tensor:
    groups = spec.groups
    if pending.work is not None:
        pending.work.wait()
    pending.full = None
    out = pending.out
    if pending.all_reduce_after:
        with torch.profiler.record_function(f"flatshard::all_reduce ({spec.label})"):
            record(collectives.all_reduce(out, groups.replicate_group), "replicate")
    factor = spec.divide_factor if spec.divide_factor is not None else groups.data_parallel_size
    if factor != 1:
        out.div_(factor)
    return out if out.dtype == master_dtype else out.to(master_dtype)
