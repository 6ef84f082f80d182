"""All-gather and reduce-scatter as point-to-point exchanges, for gloo (CPU tensors).

Each rank sends its shard (all-gather) or the chunk rank j owns of its full-size tensor
(reduce-scatter) straight to every other rank j, so it sends (n-1)·(shard bytes), the ring figure
the recorders count. gloo's own ``all_gather_into_tensor`` and ``reduce_scatter_tensor`` take two to
three times as long for the same bytes (``bench/gloo_collectives.py`` measures both and checks that
the results are equal; docs/bench.md has the figures).

[Note: exchange tags]
Every rank posts the same exchanges in the same order, and messages between two ranks arrive in
order, so exchanges would pair up even on one tag; the caller's ``tag`` (the run context numbers
its exchanges the same way on every rank) makes each exchange in flight at the same time (a
prefetched all-gather while a reduction runs) unmistakable all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

Target = Union[torch.Tensor, Callable[[int], torch.Tensor]]


def applies(tensor: torch.Tensor, group: ProcessGroup) -> bool:
    """Whether a collective on ``tensor`` over ``group`` runs as a point-to-point exchange."""
    return tensor.device.type == "cpu" and "gloo" in str(dist.get_backend(group)) and dist.get_world_size(group) > 1


class Exchange:
    """Rounds of sends and receives with every other rank of ``group``, waited on together.

    ``exchange`` posts one round: to each rank j (by group rank) the tensor ``send_of(j)`` and from
    each rank j into ``recv_into(j)``; both may be a tensor or a callable. ``then`` queues a step to
    run once everything posted so far has arrived; ``wait`` runs the queue ([Note: exchange tags])."""

    def __init__(self, group: ProcessGroup, n: int, tag: int):
        self.group, self.n, self.tag = group, n, tag
        self.rank = dist.get_rank(group)
        self._posted: list[dist.Work] = []
        self._steps: list[Callable[[], None]] = []

    def exchange(self, send_of: Target, recv_into: Target, peers: Optional[list[int]] = None) -> None:
        for k in peers if peers is not None else range(1, self.n):
            dst, src = (self.rank + k) % self.n, (self.rank - k) % self.n
            send = send_of(dst) if callable(send_of) else send_of
            recv = recv_into(src) if callable(recv_into) else recv_into
            to, frm = dist.get_global_rank(self.group, dst), dist.get_global_rank(self.group, src)
            # an empty tensor (a ragged shard of no elements) is neither sent nor received: both sides
            # know every shard's size, so they skip it alike
            if send.numel():
                self._posted.append(dist.isend(send, to, group=self.group, tag=self.tag))
            if recv.numel():
                self._posted.append(dist.irecv(recv, frm, group=self.group, tag=self.tag))

    def then(self, step: Callable[[], None]) -> None:
        self._steps.append(step)

    def wait(self) -> bool:
        while self._posted or self._steps:
            posted, self._posted = self._posted, []
            for w in posted:
                w.wait()
            if self._steps:
                self._steps.pop(0)()  # may post another round
        return True


def _chunks(t: torch.Tensor, n: int, sizes: Optional[list[int]]) -> tuple[torch.Tensor, ...]:
    return t.split(sizes) if sizes is not None else t.chunk(n)


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    n: int,
    tag: int,
    async_op: bool,
    sizes: Optional[list[int]] = None,
) -> Optional[Exchange]:
    """Every rank sends its shard to every other rank; ``sizes``: shards of these sizes, in rank order
    (ragged shards need no padding here: each lands at its own offset)."""
    work = Exchange(group, n, tag)
    chunks = _chunks(output, n, sizes)
    work.exchange(shard, lambda k: chunks[k])
    chunks[work.rank].copy_(shard)
    return _finish(work, async_op)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    n: int,
    tag: int,
    async_op: bool,
    sizes: Optional[list[int]] = None,
) -> Optional[Exchange]:
    """Round k (k = 1 … n-1) sends the chunk of rank r+k to it and receives rank r-k's contribution to
    this rank's chunk, which is added in. The first contribution lands in ``output`` itself; later ones
    need one chunk-sized buffer, so the extra memory is one shard at most (none at n = 2)."""
    work = Exchange(group, n, tag)
    chunks = _chunks(full, n, sizes)
    own = chunks[work.rank]
    buffer = torch.empty_like(output) if n > 2 else None
    work.exchange(lambda dst: chunks[dst], output, peers=[1])
    work.then(lambda: output.add_(own))
    for k in range(2, n):
        work.then(lambda k=k: work.exchange(lambda dst: chunks[dst], buffer, peers=[k]))
        work.then(lambda: output.add_(buffer))
    return _finish(work, async_op)


def _finish(work: Exchange, async_op: bool) -> Optional[Exchange]:
    if async_op:
        return work
    work.wait()
    return None
