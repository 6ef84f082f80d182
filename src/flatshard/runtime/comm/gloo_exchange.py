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

import functools
from collections.abc import Callable, Sequence
from typing import Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flatshard.runtime.comm import int8

Target = Union[torch.Tensor, Callable[[int], torch.Tensor]]
Remote = Optional[Sequence[bool]]  # per group rank: on another node (its messages go as int8)


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
        self._steps: list[Callable[[], object]] = []  # run for their effect: what a step returns is dropped
        self.buffers: list[torch.Tensor] = []  # receive buffers of its own (memory recorders count them)

    def buffer(self, numel: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
        """A receive buffer held until the exchange is done (int8 messages are uint8 bytes)."""
        self.buffers.append(torch.empty(numel, dtype=dtype))
        return self.buffers[-1]

    def hold(self, t: torch.Tensor) -> torch.Tensor:
        """Keep a tensor this exchange sends (a quantised message) until it is done."""
        self.buffers.append(t)
        return t

    def nbytes(self) -> int:
        return sum(b.untyped_storage().nbytes() for b in self.buffers)

    def exchange(self, send_of: Target, recv_into: Target, peers: Optional[list[int]] = None) -> None:
        for k in peers if peers is not None else range(1, self.n):
            dst, src = (self.rank + k) % self.n, (self.rank - k) % self.n
            send = send_of(dst) if callable(send_of) else send_of
            recv = recv_into(src) if callable(recv_into) else recv_into
            to, frm = dist.get_global_rank(self.group, dst), dist.get_global_rank(self.group, src)
            # an empty tensor (a ragged shard of no elements) is neither sent nor received: both sides
            # know every shard's size, so they skip it alike
            if send.numel():
                self._post(dist.isend(send, to, group=self.group, tag=self.tag))
            if recv.numel():
                self._post(dist.irecv(recv, frm, group=self.group, tag=self.tag))

    def _post(self, work: Optional[dist.Work]) -> None:
        assert work is not None  # torch returns None only to a rank outside the group, and this one is in it
        self._posted.append(work)

    def then(self, step: Callable[[], object]) -> None:
        self._steps.append(step)

    def wait(self) -> bool:
        while self._posted or self._steps:
            posted, self._posted = self._posted, []
            for w in posted:
                w.wait()
            if self._steps:
                self._steps.pop(0)()  # may post another round
        self.buffers = []
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
    remote: Remote = None,
) -> Optional[Exchange]:
    """Every rank sends its shard to every other rank; ``sizes``: shards of these sizes, in rank order
    (ragged shards need no padding here: each lands at its own offset). ``remote``: the group ranks on
    other nodes, which get (and send) the shard as int8 ([Note: inter-node compression], int8.py)."""
    work = Exchange(group, n, tag)
    chunks = _chunks(output, n, sizes)
    if remote is None:
        work.exchange(shard, lambda k: chunks[k])
    else:
        packed = work.hold(int8.quantize(shard))
        inbox = {j: work.buffer(int8.packed_nbytes(chunks[j].numel())) for j in range(n) if remote[j]}
        work.exchange(lambda j: packed if remote[j] else shard, lambda j: inbox[j] if remote[j] else chunks[j])
        work.then(lambda: [chunks[j].copy_(int8.dequantize(b, chunks[j].numel())) for j, b in inbox.items()])
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
    remote: Remote = None,
) -> Optional[Exchange]:
    """Round k (k = 1 … n-1) sends the chunk of rank r+k to it and receives rank r-k's contribution to
    this rank's chunk, which is added in: ``output`` = the contribution of r-1, + this rank's own, + that
    of r-2, and so on. Synchronous, a round at a time: the first contribution lands in ``output`` itself
    and later ones share one chunk-sized buffer (one shard of memory at most, none at n = 2).
    ``async_op`` (left in flight while backward goes on): every round is posted at once, each into a
    buffer of its own (n - 2 shards), and added in the same order, so the result is the same bits.
    ``remote``: chunks to and from ranks on other nodes go as int8 ([Note: inter-node compression])."""
    work = Exchange(group, n, tag)
    chunks = _chunks(full, n, sizes)
    own = chunks[work.rank]
    packed = {} if remote is None else {j: work.hold(int8.quantize(chunks[j])) for j in range(n) if remote[j]}

    def send(dst: int) -> torch.Tensor:
        return packed.get(dst, chunks[dst])

    def inbox(k: int, plain: Optional[torch.Tensor]) -> tuple[torch.Tensor, Callable[[], torch.Tensor]]:
        """Where round k's contribution lands (``plain``, unless it comes as int8), and its values."""
        if remote is not None and remote[(work.rank - k) % n]:
            buf = work.buffer(int8.packed_nbytes(output.numel()))
            return buf, lambda: int8.dequantize(buf, output.numel())
        buf = plain if plain is not None else work.buffer(output.numel(), output.dtype)
        return buf, lambda: buf

    first, first_values = inbox(1, output)
    work.exchange(send, first, peers=[1])
    if first is not output:
        work.then(lambda: output.copy_(first_values()))
    work.then(lambda: output.add_(own))
    if async_op:
        later = [inbox(k, None) for k in range(2, n)]
        for k, (buf, _) in zip(range(2, n), later):
            work.exchange(send, buf, peers=[k])
        for _, values in later:
            work.then(functools.partial(_add, output, values))
        return work
    shared = torch.empty_like(output) if n > 2 else None
    arrived: list[Callable[[], torch.Tensor]] = []

    def post(k: int) -> None:
        buf, values = inbox(k, shared)
        arrived.append(values)
        work.exchange(send, buf, peers=[k])

    for k in range(2, n):
        work.then(functools.partial(post, k))
        work.then(lambda: output.add_(arrived.pop()()))
    return _finish(work, async_op)


def _add(output: torch.Tensor, values: Callable[[], torch.Tensor]) -> torch.Tensor:
    return output.add_(values())


def all_reduce_int8(tensor: torch.Tensor, group: ProcessGroup, n: int, tag: int, async_op: bool) -> Optional[Exchange]:
    """The sum over ranks of ``tensor`` into ``tensor``, every contribution sent as int8 to every other rank
    and the dequantised contributions (this rank's own too) added in group-rank order: the same bits on
    every rank ([Note: inter-node compression])."""
    work = Exchange(group, n, tag)
    numel = tensor.numel()
    mine = int8.quantize(tensor)
    inbox = {j: work.buffer(int8.packed_nbytes(numel)) for j in range(n) if j != work.rank}
    inbox[work.rank] = work.hold(mine)
    work.exchange(mine, lambda j: inbox[j])

    def total() -> None:
        tensor.copy_(int8.dequantize(inbox[0], numel))
        for j in range(1, n):
            tensor.add_(int8.dequantize(inbox[j], numel))

    work.then(total)
    return _finish(work, async_op)


def _finish(work: Exchange, async_op: bool) -> Optional[Exchange]:
    if async_op:
        return work
    work.wait()
    return None
