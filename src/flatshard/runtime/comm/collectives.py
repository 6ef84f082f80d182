"""Stateless collective calls on a given group, each returning a small result with its accounting.

Every collective flatshard issues goes through these functions: the engine's gathers and
reductions, ``clip_grad_norm_``, summon, state dicts and checkpoints. Callers hand the result to the
run context's communication recorder (``RunContext.record``). Tests may patch these functions.

Byte figures are per rank and follow the ring algorithm: all-gather and reduce-scatter move
(n-1)·(shard bytes); all-reduce moves 2·(n-1)/n·(tensor bytes); broadcast counts the tensor once.
On gloo (CPU tensors) all-gather and reduce-scatter are point-to-point exchanges (comm/gloo_exchange.py)
that send exactly those bytes; NCCL and other backends use their own collectives.

``remote`` (all-gather, reduce-scatter) and ``compressed`` (all-reduce) send what crosses the node
boundary as int8 ([Note: inter-node compression], int8.py); the bytes recorded are then those
sent: each message's int8 values and its blocks' fp32 scales.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Optional, Protocol, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup, ReduceOp

from flatshard.runtime.comm import gloo_exchange, int8
from flatshard.runtime.comm.gloo_exchange import Remote


class Handle(Protocol):
    """A collective in flight: torch's ``dist.Work``, or a point-to-point exchange (gloo_exchange.py)."""

    def wait(self) -> bool: ...


class CollectiveResult(NamedTuple):
    kind: str  # "all_gather" | "reduce_scatter" | "all_reduce" | "broadcast"
    group_size: int
    tensor_bytes: int  # bytes of the larger buffer involved (gathered output, scattered input, reduced tensor)
    wire_bytes: float  # bytes this rank sends under the ring algorithm
    work: Optional[Handle]  # set when issued with async_op=True; wait() before reading the output


def default_group() -> ProcessGroup:
    """torch.distributed's default group, what a group of None means (torch.distributed is initialised:
    every path here runs after ``mesh.require_initialized``)."""
    group = dist.group.WORLD
    assert group is not None, "torch.distributed is not initialised"
    return group


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_gather(
    output: torch.Tensor,
    shard: torch.Tensor,
    group: ProcessGroup,
    async_op: bool = False,
    tag: int = 0,
    sizes: Optional[list[int]] = None,
    remote: Remote = None,
    custom: Optional[Any] = None,
) -> CollectiveResult:
    """``output`` receives every rank's ``shard`` in group-rank order: n·len(shard) elements, or
    ``sizes[r]`` from rank r when shards differ in size ([Note: shard boundaries], layout.py).

    ``tag`` names a point-to-point exchange (gloo): exchanges in flight at the same time need their own.
    ``remote``: the group ranks on other nodes, whose messages go as int8 (gloo only). ``custom``: an
    FSDP2 ``AllGather`` that issues it instead ([Note: custom collectives], reduce.py)."""
    n = dist.get_world_size(group)
    ragged = sizes if sizes is not None and len(set(sizes)) > 1 else None  # the sizes, when they differ
    _check_compressible(remote is not None, output, group)
    _check_custom(custom, ragged, remote)
    work: Optional[Handle]
    if custom is not None:
        work = custom(output_tensor=output, input_tensor=shard, group=group, async_op=async_op)
    elif gloo_exchange.applies(output, group):
        work = gloo_exchange.all_gather(output, shard, group, n, tag, async_op, ragged, remote)
    elif ragged is not None:
        work = None  # synchronous
        _padded_all_gather(output, shard, group, ragged)
    else:
        work = dist.all_gather_into_tensor(output, shard, group=group, async_op=async_op)
    me = dist.get_rank(group)
    sent = [_message_bytes(shard.numel(), shard.element_size(), remote, j) for j in range(n) if j != me]
    return CollectiveResult("all_gather", n, _nbytes(output), float(sum(sent)), work)


def reduce_scatter(
    output: torch.Tensor,
    full: torch.Tensor,
    group: ProcessGroup,
    async_op: bool = False,
    tag: int = 0,
    sizes: Optional[list[int]] = None,
    remote: Remote = None,
    custom: Optional[Any] = None,
    op: Any = ReduceOp.SUM,
) -> CollectiveResult:
    """``output`` receives this rank's chunk of the sum over ranks of ``full`` (chunks of ``sizes``
    when they differ); ``tag`` and ``remote`` as for ``all_gather``. Bytes: what this rank sends, the
    other ranks' chunks. ``custom``: an FSDP2 ``ReduceScatter`` that issues it instead, with ``op`` (a sum,
    an average or a pre-multiplied sum: [Note: custom collectives], reduce.py); without one, ``op`` is a sum."""
    n = dist.get_world_size(group)
    ragged = sizes if sizes is not None and len(set(sizes)) > 1 else None  # the sizes, when they differ
    _check_compressible(remote is not None, full, group)
    _check_custom(custom, ragged, remote)
    work: Optional[Handle]
    if custom is not None:
        work = custom(output_tensor=output, input_tensor=full, group=group, op=op, async_op=async_op)
    elif gloo_exchange.applies(full, group):
        work = gloo_exchange.reduce_scatter(output, full, group, n, tag, async_op, ragged, remote)
    elif ragged is not None:
        work = None  # synchronous
        _padded_reduce_scatter(output, full, group, ragged)
    else:
        work = dist.reduce_scatter_tensor(output, full, op=ReduceOp.SUM, group=group, async_op=async_op)
    me = dist.get_rank(group)
    numel = ragged if ragged is not None else [output.numel()] * n
    sent = [_message_bytes(numel[j], full.element_size(), remote, j) for j in range(n) if j != me]
    return CollectiveResult("reduce_scatter", n, _nbytes(full), float(sum(sent)), work)


def _message_bytes(numel: int, element_size: int, remote: Remote, peer: int) -> int:
    """Bytes of one message of ``numel`` elements to ``peer``: int8 and scales when it crosses nodes."""
    if remote is not None and remote[peer]:
        return int8.packed_nbytes(numel)
    return numel * element_size


def _check_custom(custom: Optional[Any], ragged: Optional[list[int]], remote: Remote) -> None:
    if custom is not None and (ragged is not None or remote is not None):
        raise RuntimeError(
            "flatshard internal error: a custom collective over shards of different sizes or compressed across "
            "nodes; fully_shard's shards are equal and uncompressed, so please report this"
        )


def _check_compressible(compressed: bool, tensor: torch.Tensor, group: ProcessGroup) -> None:
    if compressed and not gloo_exchange.applies(tensor, group):
        raise RuntimeError(
            "flatshard internal error: an int8 (inter-node) collective outside gloo's point-to-point exchange; "
            "compress_inter_node is checked at construction, so please report this"
        )


# ---- shards of different sizes on backends that need equal ones (NCCL) --------------------------------
# Each rank's shard is padded to the largest; the collective runs on the padded buffer and the pieces are
# copied into (or out of) their places: max(sizes)·n - sum(sizes) elements of padding on the wire and one
# copy of the unit's flat per collective. Synchronous.
def _padded_all_gather(output: torch.Tensor, shard: torch.Tensor, group: ProcessGroup, sizes: list[int]) -> None:
    n, longest = len(sizes), max(sizes)
    padded = torch.zeros(longest, dtype=shard.dtype, device=shard.device)
    padded[: shard.numel()].copy_(shard)
    gathered = torch.empty(n * longest, dtype=shard.dtype, device=shard.device)
    dist.all_gather_into_tensor(gathered, padded, group=group)
    for piece, row, size in zip(output.split(sizes), gathered.view(n, longest), sizes):
        piece.copy_(row[:size])


def _padded_reduce_scatter(output: torch.Tensor, full: torch.Tensor, group: ProcessGroup, sizes: list[int]) -> None:
    n, longest = len(sizes), max(sizes)
    padded = torch.zeros(n, longest, dtype=full.dtype, device=full.device)
    for row, piece, size in zip(padded, full.split(sizes), sizes):
        row[:size].copy_(piece)
    out = torch.empty(longest, dtype=full.dtype, device=full.device)
    dist.reduce_scatter_tensor(out, padded.view(-1), op=ReduceOp.SUM, group=group)
    output.copy_(out[: output.numel()])


def all_reduce(
    tensor: torch.Tensor,
    group: ProcessGroup,
    op: Union[ReduceOp, ReduceOp.RedOpType] = ReduceOp.SUM,
    async_op: bool = False,
    *,
    compressed: bool = False,
    tag: int = 0,
) -> CollectiveResult:
    """``compressed``: a sum whose contributions go as int8 to every other rank (gloo's point-to-point
    exchange, ``tag`` as for ``all_gather``), (n - 1)·(int8 message) bytes per rank."""
    n = dist.get_world_size(group)
    if compressed:
        _check_compressible(True, tensor, group)
        if op != ReduceOp.SUM:
            raise RuntimeError("flatshard internal error: an int8 all-reduce sums; it has no other op")
        work = gloo_exchange.all_reduce_int8(tensor, group, n, tag, async_op)
        return CollectiveResult(
            "all_reduce", n, _nbytes(tensor), float((n - 1) * int8.packed_nbytes(tensor.numel())), work
        )
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return CollectiveResult("all_reduce", n, _nbytes(tensor), 2.0 * (n - 1) / n * _nbytes(tensor), work)


def broadcast(tensor: torch.Tensor, src_group_rank: int, group: Optional[ProcessGroup]) -> CollectiveResult:
    group = group if group is not None else default_group()
    n = dist.get_world_size(group)
    src = dist.get_global_rank(group, src_group_rank)
    dist.broadcast(tensor, src=src, group=group)
    return CollectiveResult("broadcast", n, _nbytes(tensor), float(_nbytes(tensor)), None)
