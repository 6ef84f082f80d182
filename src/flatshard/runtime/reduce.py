"""Reducing one unit's full-size gradient to this rank's grad shard.

Up to three steps, so each collective can stay in flight while backward goes on ([Note: reductions
in flight], schedule.py): ``start`` casts the unsharded flat's gradient to the reduce dtype and
issues the reduce-scatter over the shard group (or, with F = 1, the all-reduce over the replicate
group); ``advance`` waits for the reduce-scatter and, when there are replicas too (hybrid), issues the
all-reduce of the shard across them; ``finish`` waits for whatever is left, divides by the
data-parallel size and casts to the master dtype. The full-size gradient is released as soon as the
reduce-scatter is done. With ``ReduceSpec.inter_node`` compressing, what crosses nodes goes as int8
([Note: inter-node compression], comm/int8.py). fully_shard's ``set_requires_all_reduce(False)`` ends a
hybrid reduction at the shard group's sum (``finish_shard_sum``), which the next one adds before its
all-reduce; ``set_all_reduce_hook``'s hook runs in ``finish`` (``ReduceSpec.hook_sees_sum`` says where).

[Note: custom collectives]
fully_shard's ``set_custom_all_gather`` / ``set_custom_reduce_scatter`` hand the shard group's collective to
the user's FSDP2 ``AllGather`` / ``ReduceScatter`` (``torch.distributed.fsdp._fully_shard._fsdp_api``), as
FSDP2 does: the object allocates the buffers of that collective (``allocate(size, dtype=, device=)``: the
gathered rank-major staging; the reduce-scatter's rank-major input and its output) and is called with
keyword arguments ``output_tensor``, ``input_tensor``, ``group`` (the shard group), ``async_op`` and, for
the reduce-scatter, ``op``. The op is FSDP2's (``ReduceSpec.custom_op``): with an fp32 or bf16 reduce dtype
and no ``set_force_sum_reduction_for_comms``, ``ReduceOp.AVG`` over the shard group, or under
``set_gradient_divide_factor(f)`` ``PREMUL_SUM(1/f)`` (AVG when f is the shard group's size); otherwise a
sum, divided before and after as flatshard's own reductions are. What the collective divided by is not
divided again in ``finish``. The all-reduce across replicas (HSDP) stays flatshard's, as in FSDP2, where
the custom comm is the reduce-scatter only. Built where a unit has one flat group (FSDP2 raises for
several parameter groups alike) and its shards are equal (fully_shard's chunked layout).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.distributed import ProcessGroup, ReduceOp

from flatshard.runtime.comm import collectives, nodes
from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.comm.streams import Lane, Streams

COMPUTE, REDUCE = Lane.COMPUTE, Lane.REDUCE
NO_STREAMS = Streams()


@dataclass(frozen=True)
class ReduceSpec:
    """What a unit's reduction needs to know about the unit."""

    groups: ShardGroups
    shard_sizes: list[int]  # every shard rank's shard, in rank order (equal unless shard_boundaries is ragged)
    reduce_dtype: torch.dtype
    label: str  # the unit's name, for profiler labels
    divide_factor: Optional[float] = None  # what the summed gradient is divided by (None: the data-parallel size)
    inter_node: nodes.InterNode = nodes.LOCAL  # which peers are on other nodes; int8 across them
    # across replicas a reduce-scatter, not an all-reduce ([Note: optimizer state across replicas], across_replicas.py)
    scatter_replicas: bool = False
    streams: Streams = NO_STREAMS  # the run context's ([Note: stream discipline], comm/streams.py)
    # False (fully_shard's set_requires_all_reduce(False), hybrid): stop at the shard group's sum
    across_replicas: bool = True
    force_sum: bool = False  # fully_shard's set_force_sum_reduction_for_comms (``hook_sees_sum``)
    hook: Optional[Callable[[torch.Tensor], None]] = None  # fully_shard's set_all_reduce_hook: on the reduced shard
    custom: Optional[Any] = None  # fully_shard's set_custom_reduce_scatter ([Note: custom collectives])
    # fully_shard's set_separate_reduce_scatter_group: the shard group's ranks in a group of their own (None:
    # the shard group itself)
    scatter_group: Optional[ProcessGroup] = None

    def custom_op(self) -> tuple[Any, float]:
        """(the op a custom reduce-scatter is called with, what that op divides the sum by): FSDP2's choice
        ([Note: custom collectives])."""
        if self.force_sum or self.reduce_dtype not in (torch.float32, torch.bfloat16):
            return ReduceOp.SUM, 1.0
        f = self.groups.shard_size
        if self.divide_factor is None or self.divide_factor == f:
            return ReduceOp.AVG, float(f)
        return ReduceOp.PREMUL_SUM(1 / self.divide_factor), self.divide_factor

    @property
    def hook_sees_sum(self) -> bool:
        """Whether ``hook`` runs before the division after the sum (else after it), as in PyTorch FSDP2:
        for fp32 and bf16 FSDP2 divides inside its collectives (``ReduceOp.AVG``, ``PREMUL_SUM``), so its
        hook sees the divided gradient, unless ``set_force_sum_reduction_for_comms(True)`` makes them plain
        sums followed by a division, when the hook sees the sum; a reduce dtype of little range (fp16) is
        always summed so, divided before and after (``divide_factors``), and the hook sees it between.
        flatshard's collectives always sum and divide after, so the setting moves only the hook."""
        return self.force_sum or self.reduce_dtype not in (torch.float32, torch.bfloat16)

    @property
    def all_reduces(self) -> bool:
        """Whether the reduction goes on across replicas after the shard group (hybrid, and not stopped
        by ``across_replicas``)."""
        return self.groups.replicate_size > 1 and self.across_replicas

    @property
    def divide_factors(self) -> tuple[float, float]:
        """(before the sum, after it): together they divide the summed gradient by ``divide_factor`` (default
        the data-parallel size). A reduce dtype of little range (fp16) is divided by a power of two near
        the factor's square root before the sum and by the rest after, as PyTorch FSDP1 and FSDP2 split
        it, so the sum of W gradients cannot overflow where their mean would not; fp32 and bf16 are divided
        once, after (a power of two before would change no bit but a subnormal's)."""
        factor = self.divide_factor if self.divide_factor is not None else float(self.groups.data_parallel_size)
        if self.reduce_dtype in (torch.float32, torch.bfloat16):
            return 1.0, factor
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return float(pre), factor / pre


@dataclass
class PendingReduction:
    work: Optional[collectives.Handle]  # a collective still in flight, or None
    full: Optional[torch.Tensor]  # the gradient being reduced, kept alive until the collective is done
    out: torch.Tensor  # this rank's reduced shard (reduce dtype)
    all_reduce_after: bool  # hybrid: the shard still has to be all-reduced (or scattered) across replicas
    source: Optional[torch.Tensor] = None  # the shard a reduce-scatter across replicas sends from
    event: Any = None  # the reduce stream's event after the collective in flight ([Note: stream discipline])
    # earlier backwards' shard-group sums (set_requires_all_reduce(False)), added before the all-reduce
    partial: Optional[torch.Tensor] = None
    shard_sum_only: bool = False  # the reduction ends at the shard group's sum (``finish_shard_sum``)

    def nbytes(self) -> tuple[int, int]:
        """(full-size gradient and receive buffer bytes, reduced shard bytes) held now."""
        full = 0 if self.full is None or self.full is self.out else self.full.untyped_storage().nbytes()
        full += 0 if self.source is None else self.source.untyped_storage().nbytes()
        work = self.work
        buffers = work.nbytes() if work is not None and hasattr(work, "nbytes") else 0  # a point-to-point exchange's
        partial = 0 if self.partial is None else self.partial.untyped_storage().nbytes()
        return full + buffers, self.out.untyped_storage().nbytes() + partial


Record = Callable[[collectives.CollectiveResult, str], None]


def start(
    grad: torch.Tensor,
    spec: ReduceSpec,
    record: Record,
    *,
    async_op: bool,
    tag: int = 0,
    partial: Optional[torch.Tensor] = None,
) -> PendingReduction:
    """Issue the reduction of ``grad``, already in ``spec.reduce_dtype``: the unit makes it so (a cast, or the
    rank-major copy) and releases its own gradient before the collective starts (Unit._take_gradient).
    On the reduce stream, after compute's event ([Note: stream discipline], comm/streams.py). ``partial``:
    the shard-group sums of earlier backwards that stopped there, added before the all-reduce."""
    groups, inter, streams = spec.groups, spec.inter_node, spec.streams
    stops = groups.replicate_size > 1 and not spec.all_reduces  # at the shard group's sum
    full = grad
    before, _after = spec.divide_factors
    if before != 1 and (groups.shard_size > 1 or groups.replicate_size > 1):
        full.div_(before)  # ``grad`` is the unit's own (taken off the unsharded flat, or its cast copy)
    async_op = async_op and streams.host_ordered
    if groups.shard_size > 1:
        assert groups.shard_group is not None  # F > 1: the shard group exists
        size = spec.shard_sizes[groups.shard_rank]
        if spec.custom is not None:  # [Note: custom collectives]: the comm allocates its output too
            out = spec.custom.allocate((size,), dtype=spec.reduce_dtype, device=grad.device)
        else:
            out = torch.empty(size, dtype=spec.reduce_dtype, device=grad.device)
        streams.use(COMPUTE, out, "alloc", f"reduced gradient {spec.label}")
        streams.order(COMPUTE, REDUCE)
        with streams.on(REDUCE), torch.profiler.record_function(f"flatshard::reduce_scatter ({spec.label})"):
            streams.use(REDUCE, full, "read", f"gradient {spec.label}")
            result = collectives.reduce_scatter(
                out,
                full,
                spec.scatter_group or groups.shard_group,
                async_op=async_op,
                tag=tag,
                sizes=spec.shard_sizes,
                remote=inter.gather_remote(),
                custom=spec.custom,
                op=spec.custom_op()[0] if spec.custom is not None else ReduceOp.SUM,
            )
            streams.use(REDUCE, out, "write", f"reduced gradient {spec.label}")
        record(result, "shard")
        event = streams.record(REDUCE)
        return PendingReduction(
            result.work, full, out, spec.all_reduces, event=event, partial=partial, shard_sum_only=stops
        )
    if spec.all_reduces:
        assert groups.replicate_group is not None  # R > 1: the replicate group exists
        if partial is not None:  # F = 1: the shard group's sum is the gradient itself
            full.add_(partial)
        streams.order(COMPUTE, REDUCE)
        with streams.on(REDUCE), torch.profiler.record_function(f"flatshard::all_reduce ({spec.label})"):
            streams.use(REDUCE, full, "read", f"gradient {spec.label}")
            result = collectives.all_reduce(
                full, groups.replicate_group, async_op=async_op, compressed=inter.compress_replicate, tag=tag
            )
            streams.use(REDUCE, full, "write", f"gradient {spec.label}")
        record(result, "replicate")
        return PendingReduction(result.work, None, full, False, event=streams.record(REDUCE))
    return PendingReduction(None, full, full, False, shard_sum_only=stops)


def advance(pending: PendingReduction, spec: ReduceSpec, record: Record, *, async_op: bool, tag: int = 0) -> None:
    """Wait for the shard group's reduce-scatter; then (hybrid) issue the all-reduce across replicas,
    left in flight with ``async_op`` for ``finish`` to wait on."""
    if pending.full is None and not pending.all_reduce_after:
        return
    streams = spec.streams
    if pending.work is not None and pending.full is not None:
        pending.work.wait()
        pending.work = None
    if pending.full is not None and pending.full is not pending.out:  # dropped by compute, after the reduction
        streams.wait(COMPUTE, pending.event)
        streams.use(COMPUTE, pending.full, "free", f"gradient {spec.label}")
    pending.full = None
    if not pending.all_reduce_after:
        return
    pending.all_reduce_after = False
    groups, inter = spec.groups, spec.inter_node
    assert groups.replicate_group is not None  # all_reduce_after: R > 1, so the replicate group exists
    async_op = async_op and streams.host_ordered
    if pending.partial is not None:  # set_requires_all_reduce(False) before: its sums join this one's
        with streams.on(REDUCE):
            streams.use(REDUCE, pending.partial, "read", f"shard-group sum {spec.label}")
            pending.out.add_(pending.partial)
            streams.use(REDUCE, pending.out, "write", f"reduced gradient {spec.label}")
    if spec.scatter_replicas:  # [Note: optimizer state across replicas] (across_replicas.py): S elements to this piece
        shard, r = pending.out, groups.replicate_size
        pending.source, pending.out = shard, torch.empty(shard.numel() // r, dtype=shard.dtype, device=shard.device)
        streams.use(COMPUTE, pending.out, "alloc", f"reduced piece {spec.label}")
        streams.order(COMPUTE, REDUCE)
        with streams.on(REDUCE), torch.profiler.record_function(f"flatshard::reduce_scatter_pieces ({spec.label})"):
            streams.use(REDUCE, shard, "read", f"reduced gradient {spec.label}")
            result = collectives.reduce_scatter(
                pending.out, shard, groups.replicate_group, async_op=async_op, tag=tag, sizes=[pending.out.numel()] * r
            )
            streams.use(REDUCE, pending.out, "write", f"reduced piece {spec.label}")
        record(result, "replicate")
        pending.work, pending.event = result.work, streams.record(REDUCE)
        return
    with streams.on(REDUCE), torch.profiler.record_function(f"flatshard::all_reduce ({spec.label})"):
        streams.use(REDUCE, pending.out, "read", f"reduced gradient {spec.label}")
        result = collectives.all_reduce(
            pending.out, groups.replicate_group, async_op=async_op, compressed=inter.compress_replicate, tag=tag
        )
        streams.use(REDUCE, pending.out, "write", f"reduced gradient {spec.label}")
    record(result, "replicate")
    pending.work, pending.event = result.work, streams.record(REDUCE)


def discard(pending: PendingReduction, spec: ReduceSpec) -> None:
    """Wait for whatever of ``pending`` is still in flight and drop it (a step that raised: [Note: a step
    that raised], schedule.py). Nothing new is issued: every rank drops the same reductions alike."""
    if pending.work is not None:
        pending.work.wait()
    spec.streams.wait(COMPUTE, pending.event)
    held = (pending.full, pending.source, pending.out, pending.partial)
    for t in {id(t): t for t in held if t is not None}.values():
        spec.streams.use(COMPUTE, t, "free", f"reduction {spec.label}")
    pending.work = pending.full = pending.source = pending.partial = None


def finish_shard_sum(pending: PendingReduction, spec: ReduceSpec, record: Record, tag: int = 0) -> torch.Tensor:
    """A reduction that ends at the shard group (``pending.shard_sum_only``): compute waits for the
    reduce-scatter and gets the shard group's sum, in the reduce dtype, undivided and without the hook, as
    PyTorch FSDP2 keeps it under ``set_requires_all_reduce(False)`` until a backward all-reduces it."""
    advance(pending, spec, record, async_op=False, tag=tag)  # nothing to issue: it only waits
    streams = spec.streams
    streams.wait(COMPUTE, pending.event)
    streams.use(COMPUTE, pending.out, "read", f"shard-group sum {spec.label}")
    return pending.out


def finish(
    pending: PendingReduction, spec: ReduceSpec, master_dtype: torch.dtype, record: Record, tag: int = 0
) -> torch.Tensor:
    """Compute waits for the reduction and divides the shard; returned in the master dtype."""
    advance(pending, spec, record, async_op=False, tag=tag)
    streams = spec.streams
    if pending.work is not None:
        pending.work.wait()
        pending.work = None
    streams.wait(COMPUTE, pending.event)
    for held in (pending.source, pending.partial):
        if held is not None:
            streams.use(COMPUTE, held, "free", f"reduced gradient {spec.label}")
    pending.source = pending.partial = None
    out = pending.out
    before, after = spec.divide_factors
    if not (spec.groups.shard_size > 1 or spec.groups.replicate_size > 1):
        after *= before  # nothing was summed, so nothing was divided before
    elif spec.custom is not None and spec.groups.shard_size > 1:
        after /= spec.custom_op()[1]  # what the custom reduce-scatter's op divided by ([Note: custom collectives])
    streams.use(COMPUTE, out, "read", f"reduced gradient {spec.label}")
    hook = spec.hook
    if hook is not None and spec.hook_sees_sum:
        hook(out)
    if after != 1:
        out.div_(after)
    if hook is not None and not spec.hook_sees_sum:
        hook(out)
    if hook is not None:
        streams.use(COMPUTE, out, "write", f"reduced gradient {spec.label}")
    return out if out.dtype == master_dtype else out.to(master_dtype)
