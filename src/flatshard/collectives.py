"""Stateless collective calls on a given group, each returning a small result with its accounting.

The callers (units, clip_grad_norm_) hand the result to the run context's communication recorder.
Tests may patch these functions. Byte figures are per rank and follow the ring algorithm:
all-gather and reduce-scatter move (n-1)·(shard bytes); all-reduce moves 2·(n-1)/n·(tensor bytes).

On gloo (CPU tensors) all-gather and reduce-scatter are point-to-point exchanges: each rank sends its
shard (all-gather) or the chunk rank j owns of its full-size tensor (reduce-scatter) straight to every
other rank j, so it sends (n-1)·(shard bytes), the figure above. gloo's own all_gather_into_tensor and
reduce_scatter_tensor take two to three times as long for the same bytes (bench/gloo_collectives.py,
one 30M-parameter GPT block, fp32: all-gather 17.5 ms against 5.1 at W = 2 and 22.8 against 11.8 at
W = 4; reduce-scatter 27.4 against 9.0 and 50.7 against 15.9). NCCL and other backends use their own.
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


def all_gather(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, async_op: bool = False,
               tag: int = 0) -> Collective:
    """``tag`` names a point-to-point exchange (gloo): exchanges in flight at the same time need their own."""
    n = dist.get_world_size(group)
    if _point_to_point(output, group):
        work = _Exchange(group, n, tag)
        chunks = output.chunk(n)
        work.exchange(shard, lambda k: chunks[k])  # every rank sends its shard to every other rank
        chunks[work.rank].copy_(shard)
        work = _finish(work, async_op)
    else:
        work = _all_gather_single(output, shard, group=group, async_op=async_op)
    return Collective("all_gather", n, _nbytes(output), float((n - 1) * _nbytes(shard)), work)


def reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, async_op: bool = False,
                   tag: int = 0) -> Collective:
    """``tag`` as for ``all_gather``."""
    n = dist.get_world_size(group)
    if _point_to_point(full, group):
        work = _reduce_scatter_exchange(output, full, group, n, tag)
        work = _finish(work, async_op)
    else:
        work = _reduce_scatter_single(output, full, op=ReduceOp.SUM, group=group, async_op=async_op)
    return Collective("reduce_scatter", n, _nbytes(full), float((n - 1) * _nbytes(output)), work)


# ---- point-to-point all-gather and reduce-scatter (gloo) ---------------------------------------
def _point_to_point(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group)) and dist.get_world_size(group) > 1


class _Exchange:
    """Rounds of sends and receives with every other rank of ``group``, waited on together.

    ``exchange`` posts one round: to each rank j (by group rank) the tensor ``send_of(j)`` and from
    each rank j into ``recv_into(j)``; both may be a tensor or a callable. Every rank posts the same
    exchanges in the same order, and messages between two ranks arrive in order, so exchanges would
    pair up even on one tag; the caller's ``tag`` (the run context numbers its exchanges) makes each
    exchange in flight (a prefetched all-gather while a reduction runs) unmistakable all the same.
    ``then`` queues a step to run once everything posted so far has arrived; ``wait`` runs the queue."""

    def __init__(self, group: ProcessGroup, n: int, tag: int):
        self.group, self.n, self.tag = group, n, tag
        self.rank = dist.get_rank(group)
        self._posted: list[dist.Work] = []
        self._steps: list = []

    def exchange(self, send_of, recv_into, peers=None) -> None:
        for k in peers if peers is not None else range(1, self.n):
            dst, src = (self.rank + k) % self.n, (self.rank - k) % self.n
            send = send_of(dst) if callable(send_of) else send_of
            recv = recv_into(src) if callable(recv_into) else recv_into
            self._posted.append(dist.isend(send, dist.get_global_rank(self.group, dst), group=self.group, tag=self.tag))
            self._posted.append(dist.irecv(recv, dist.get_global_rank(self.group, src), group=self.group, tag=self.tag))

    def then(self, step) -> None:
        self._steps.append(step)

    def wait(self) -> bool:
        while self._posted or self._steps:
            posted, self._posted = self._posted, []
            for w in posted:
                w.wait()
            if self._steps:
                self._steps.pop(0)()  # may post another round
        return True

    def is_completed(self) -> bool:
        return not self._posted and not self._steps


def _reduce_scatter_exchange(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, n: int, tag: int) -> _Exchange:
    """Round k (k = 1 … n-1) sends the chunk of rank r+k to it and receives rank r-k's contribution to
    this rank's chunk, which is added in. The first contribution lands in ``output`` itself; later ones
    need one chunk-sized buffer, so the extra memory is one shard at most (none at n = 2)."""
    work = _Exchange(group, n, tag)
    chunks = full.chunk(n)
    own = chunks[work.rank]
    buffer = torch.empty_like(output) if n > 2 else None
    work.exchange(lambda dst: chunks[dst], output, peers=[1])
    work.then(lambda: output.add_(own))
    for k in range(2, n):
        work.then(lambda k=k: work.exchange(lambda dst: chunks[dst], buffer, peers=[k]))
        work.then(lambda: output.add_(buffer))
    return work


def _finish(work: _Exchange, async_op: bool) -> Optional[_Exchange]:
    if async_op:
        return work
    work.wait()
    return None


def all_reduce(tensor: torch.Tensor, group: ProcessGroup, op: ReduceOp = ReduceOp.SUM, async_op: bool = False) -> Collective:
    n = dist.get_world_size(group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return Collective("all_reduce", n, _nbytes(tensor), 2.0 * (n - 1) / n * _nbytes(tensor), work)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: ProcessGroup) -> Collective:
    n = dist.get_world_size(group)
    src = dist.get_global_rank(group, src_group_rank)
    dist.broadcast(tensor, src=src, group=group)
    return Collective("broadcast", n, _nbytes(tensor), float(_nbytes(tensor)), None)
