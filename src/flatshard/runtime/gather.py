"""A unit's all-gather into its unsharded flat, issued on the gather stream and consumed on compute
([Note: stream discipline], comm/streams.py). ``Unit.unshard`` decides whether to gather; this file gathers.

Buffers are allocated by compute before the gather stream is ordered after it, written by the gather,
and read (the copy-out of a rank-major gather, the forward and backward) only after compute waited for
the gather's event; what the gather alone needed (the staging buffer of a rank-major gather, the
compute-dtype copy of the flat shard) is dropped then, by compute.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Optional

import torch

from flatshard.runtime import consistency
from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.streams import Lane

if TYPE_CHECKING:
    from flatshard.runtime.unit import Unit

COMPUTE, GATHER = Lane.COMPUTE, Lane.GATHER


@dataclass
class InFlight:
    """An all-gather issued and not yet waited for by compute."""

    work: Any  # the collective's handle on a host-ordered backend (gloo), else None
    event: Any  # the gather stream's event after it (None without streams)
    then: Optional[Callable[[], None]] = None  # a rank-major gather's copy into the unsharded flat
    buffer: Optional[torch.Tensor] = None  # where a rank-major gather lands first (counted as gathered)
    temporaries: list = field(default_factory=list)  # dropped by compute once it waited: staging, cast source


def what(unit: Unit, prefetch: bool = False) -> str:
    """How the log names a unit's gathered buffer (``check_schedule`` counts those not of the root)."""
    return f"gathered {unit.name}" + (" (root)" if unit.is_root else "") + (" (prefetch)" if prefetch else "")


def issue(unit: Unit, wait: bool) -> None:
    """All-gather the flat shard into the unsharded flat; with ``wait`` compute waits for it at once."""
    streams = unit.ctx.streams
    rank_major = unit.layout.rank_major and unit.groups.shard_size > 1
    if not rank_major:  # a rank-major gather lands in a buffer of its own first (_copy_out)
        unit.allocate(prefetch=not wait)
    source, temporaries = unit.flat_shard, []
    if unit.offload or unit.precision.mixed:  # to the compute device and dtype (pinned: asynchronous)
        source = unit.flat_shard.to(unit.compute_device, unit.precision.compute, non_blocking=True, copy=True)
        streams.use(COMPUTE, source, "alloc", f"{unit.name} flat shard in the compute dtype")
        streams.use(COMPUTE, source, "write", f"{unit.name} flat shard in the compute dtype")
        temporaries.append(source)
    if unit.groups.shard_size == 1:  # nothing to gather: compute copies
        streams.use(COMPUTE, source, "read", f"{unit.name} flat shard")
        unit._gather_target.copy_(source)
        streams.use(COMPUTE, unit._gather_target, "write", what(unit))
        unit.gather_in_flight = InFlight(None, None, temporaries=temporaries)
        consume(unit)
        return
    unit.ctx.checker.check(consistency.GATHER, unit, unit.ctx.phase)
    group, tag = unit.groups.shard_group, unit.ctx.next_tag(unit)
    target, then, staging = unit._gather_target, None, None
    if rank_major:  # [Note: chunked layout]: gather rank after rank, then copy out
        staging = torch.empty(
            unit.groups.shard_size * unit.layout.shard_numel, dtype=source.dtype, device=source.device
        )
        streams.use(COMPUTE, staging, "alloc", what(unit, prefetch=not wait))
        target, then = staging, functools.partial(_copy_out, unit, staging)
        temporaries.append(staging)
    streams.order(COMPUTE, GATHER)
    with streams.on(GATHER), torch.profiler.record_function(f"flatshard::all_gather ({unit.name})"):
        streams.use(GATHER, source, "read", f"{unit.name} flat shard")
        with unit._errors("all_gather"):
            result = collectives.all_gather(
                target,
                source,
                group,
                async_op=not wait and streams.host_ordered,
                tag=tag,
                sizes=unit.layout.shard_sizes,
                remote=unit.inter_node.gather_remote(),
            )
        streams.use(GATHER, target, "write", what(unit))
    unit.record(result, "shard")
    unit.gather_in_flight = InFlight(result.work, streams.record(GATHER), then, staging, temporaries)
    if wait:
        consume(unit)


def issue_from(unit: Unit, piece: torch.Tensor, wait: bool) -> None:
    """All-gather the unsharded flat from the pieces the post-forward group kept."""
    streams, group = unit.ctx.streams, unit.post_forward
    unit.allocate(prefetch=not wait)
    unit.ctx.checker.check(consistency.GATHER, unit, unit.ctx.phase)
    tag = unit.ctx.next_tag(unit)
    streams.order(COMPUTE, GATHER)
    with streams.on(GATHER), torch.profiler.record_function(f"flatshard::all_gather ({unit.name})"):
        streams.use(GATHER, piece, "read", f"{unit.name} post-forward piece")
        with unit._errors("all_gather"):
            result = collectives.all_gather(
                unit._gather_target,
                piece,
                group.group,
                async_op=not wait and streams.host_ordered,
                tag=tag,
                sizes=group.sizes,
            )
        streams.use(GATHER, unit._gather_target, "write", what(unit))
    unit.record(result, "post_forward")
    unit.gather_in_flight = InFlight(result.work, streams.record(GATHER), temporaries=[piece])
    if wait:
        consume(unit)


def consume(unit: Unit) -> None:
    """Compute waits for the unit's gather in flight (if any), copies a rank-major gather out, and drops
    what the gather alone needed."""
    gather, streams = unit.gather_in_flight, unit.ctx.streams
    if gather is None:
        return
    if gather.work is not None:
        with unit._errors("all_gather"):
            gather.work.wait()
    streams.wait(COMPUTE, gather.event)
    unit.gather_in_flight = None
    if gather.then is not None:
        gather.then()
    for t in gather.temporaries:
        streams.use(COMPUTE, t, "free", f"{unit.name} gather buffer")


def _copy_out(unit: Unit, staging: torch.Tensor) -> None:
    """A rank-major gather has arrived: only now does the unsharded flat take memory, so a gather in
    flight (a prefetch) holds one copy of the unit, as FSDP2's does, not two."""
    streams = unit.ctx.streams
    unit.allocate()
    streams.use(COMPUTE, staging, "read", what(unit))
    unit.layout.from_rank_major(staging, unit._gather_target)
    streams.use(COMPUTE, unit._gather_target, "write", what(unit))
