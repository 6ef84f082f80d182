"""Stateless collective calls on a given group, each returning a small result with its accounting.

The callers (units, clip_grad_norm_) hand the result to the run context's communication recorder.
Tests may patch these functions. Byte figures are per rank and follow the ring algorithm:
all-gather and reduce-scatter move (n-1)·(shard bytes); all-reduce moves 2·(n-1)/n·(tensor bytes).
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class Collective(NamedTuple):
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    group_size: int
    tensor_bytes: int  # bytes of the larger buffer involved (gathered output, scattered input, reduced tensor)
    wire_bytes: float  # bytes this rank sends under the ring algorithm
    work: Optional[dist.Work]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Collective:
    n = dist.get_world_size(group)
    work = _all_gather_single(output, shard, group=group, async_op=async_op)
    return Collective("all_gather", n, _nbytes(output), float((n - 1) * _nbytes(shard)), work)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False) -> Collective:
    n = dist.get_world_size(group)
    work = _reduce_scatter_single(output, full, op=ReduceOp.SUM, group=group, async_op=async_op)
    return Collective("reduce_scatter", n, _nbytes(full), float((n - 1) * _nbytes(output)), work)


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Collective:
    n = dist.get_world_size(group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Collective("all_reduce", n, _nbytes(tensor), 2.0 * (n - 1) / n * _nbytes(tensor), work)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup) -> Collective:
    n = dist.get_world_size(group)
    src = dist.get_global_rank(group, src_group_rank)
    dist.broadcast(tensor, src=src, group=group)
    return Collective("broadcast", n, _nbytes(tensor), float(_nbytes(tensor)), None)
