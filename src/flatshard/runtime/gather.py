"""A flat group's unsharded flat and its all-gather: ``Gather``, one per flat group.

The unsharded flat is either SHARDED (its storage freed: the tensor object stays, for autograd's saved
views) or UNSHARDED (it holds, or is receiving, the parameters of the flat shard at the version it
gathered). ``unshard`` and ``free`` are idempotent. The all-gather is issued on the gather stream and
consumed on compute ([Note: stream discipline], comm/streams.py): buffers are allocated by compute before
the gather stream is ordered after it, written by the gather, and read (the copy-out of a rank-major
gather, the forward and backward) only after compute waited for the gather's event; what the gather
alone needed (the staging buffer of a rank-major gather, the compute-dtype copy of the flat shard) is
dropped then, by compute.

When F == 1 and the compute dtype is the master dtype, the unsharded flat aliases the flat shard's
storage (through ``.data``, so it has its own version counter and the optimizer's in-place updates
never invalidate what autograd saved): nothing is gathered and nothing is freed (``aliased``).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from flatshard.runtime import consistency
from flatshard.runtime.chunked import ChunkedLayout
from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.comm.nodes import InterNode
from flatshard.runtime.comm.streams import Lane
from flatshard.runtime.context import Link, UnitSettings
from flatshard.runtime.layout import FlatLayout
from flatshard.runtime.post_forward import PostForwardGroup
from flatshard.runtime.precision import UnitPrecision

COMPUTE, GATHER = Lane.COMPUTE, Lane.GATHER


class GatherState(enum.Enum):
    SHARDED = enum.auto()
    UNSHARDED = enum.auto()


@dataclass
class InFlight:
    """An all-gather issued and not yet waited for by compute."""

    work: Optional[collectives.Handle]  # the collective's handle on a host-ordered backend (gloo), else None
    event: Any  # the gather stream's event after it (None without streams)
    then: Optional[Callable[[], None]] = None  # a rank-major gather's copy into the unsharded flat
    buffer: Optional[torch.Tensor] = None  # where a rank-major gather lands first (counted as gathered)
    temporaries: list = field(default_factory=list)  # dropped by compute once it waited: staging, cast source


@dataclass(frozen=True)
class KeptPiece:
    """This rank's piece of the unsharded flat kept after forward ([Note: reshard after forward to a
    smaller group]), and the flat shard's version it was cut from (a later version makes it stale)."""

    piece: torch.Tensor
    version: int


class Gather:
    """The unsharded flat of one flat group (``unsharded``, the tensor autograd sees; ``target``, an alias
    with its own version counter that collectives write) and the all-gather that fills it."""

    def __init__(
        self,
        link: Link,
        layout: FlatLayout | ChunkedLayout,
        groups: ShardGroups,
        precision: UnitPrecision,
        unsharded: torch.Tensor,
        *,
        aliased: bool,
        offload: bool,
        inter_node: InterNode,
        settings: Optional[UnitSettings] = None,
    ):
        self.link = link
        self.layout = layout
        self.groups = groups
        self.precision = precision
        self.aliased = aliased
        self.offload = offload
        self.inter_node = inter_node
        self.settings = settings  # the unit's: set_custom_all_gather's comm
        self.unsharded = unsharded
        self.target = unsharded.data  # what collectives write into (own version counter)
        self.state = GatherState.UNSHARDED if aliased else GatherState.SHARDED
        self.version = -1  # the flat shard's version last gathered
        self.in_flight: Optional[InFlight] = None
        self.post_forward: Optional[PostForwardGroup] = None  # fully_shard's reshard_after_forward=int
        self.kept: Optional[KeptPiece] = None

    @property
    def gathered(self) -> bool:
        """Whether the unsharded flat holds (or is receiving) the parameters in memory of its own."""
        return not self.aliased and self.state is GatherState.UNSHARDED

    def buffer_label(self, prefetch: bool = False) -> str:
        """How the stream log names this gathered buffer (``check_schedule`` counts those not of the root)."""
        link = self.link
        return f"gathered {link.name}" + (" (root)" if link.is_root else "") + (" (prefetch)" if prefetch else "")

    # ---- transitions ---------------------------------------------------------------------------
    def unshard(self, flat_shard: torch.Tensor, wait: bool) -> bool:
        """Fill the unsharded flat from ``flat_shard``; a no-op if it already holds (or is receiving) this
        version of it. With ``wait=False`` the all-gather is only issued (a prefetch). True if it gathered."""
        if self.state is GatherState.UNSHARDED and self.version == flat_shard._version:
            if wait:
                self.consume()
            return False
        self.consume()
        kept, self.kept = self.kept, None
        if kept is not None and kept.version == flat_shard._version:  # the smaller group's gather
            self._issue_from(kept.piece, wait)
        else:
            self._issue(flat_shard, wait)
        self.version = flat_shard._version
        self.state = GatherState.UNSHARDED
        return True

    def free(self, flat_shard: torch.Tensor, after_forward: bool = False) -> bool:
        """Free the unsharded flat's storage; ``after_forward`` with a post-forward group keeps this rank's
        piece of it for backward's gather within that group. True if it freed."""
        if self.state is GatherState.SHARDED or self.aliased:
            return False
        self.consume()  # never free memory a collective is still writing
        streams, name = self.link.run.streams, self.link.name
        if after_forward and self.post_forward is not None:
            piece = self.post_forward.piece(self.unsharded.data).clone()
            streams.use(COMPUTE, piece, "alloc", f"{name} post-forward piece")
            streams.use(COMPUTE, piece, "write", f"{name} post-forward piece")
            self.kept = KeptPiece(piece, flat_shard._version)
        streams.use(COMPUTE, self.unsharded, "free", self.buffer_label())
        self.unsharded.untyped_storage().resize_(0)
        self.state = GatherState.SHARDED
        return True

    def allocate(self, prefetch: bool = False) -> None:
        """Give the unsharded flat its memory (compute allocates it: [Note: stream discipline])."""
        storage = self.unsharded.untyped_storage()
        nbytes = self.layout.padded * self.unsharded.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
            self.link.run.streams.use(COMPUTE, self.unsharded, "alloc", self.buffer_label(prefetch))

    def consume(self) -> None:
        """Compute waits for the gather in flight (if any), copies a rank-major gather out, and drops what
        the gather alone needed."""
        gather, streams = self.in_flight, self.link.run.streams
        if gather is None:
            return
        if gather.work is not None:
            with self.link.errors("all_gather"):
                gather.work.wait()
        streams.wait(COMPUTE, gather.event)
        self.in_flight = None
        if gather.then is not None:
            gather.then()
        for t in gather.temporaries:
            streams.use(COMPUTE, t, "free", f"{self.link.name} gather buffer")

    def nbytes(self) -> int:
        """Bytes this gather holds now: the unsharded flat, a kept piece, a rank-major gather's landing buffer."""
        held = 0 if self.aliased else self.unsharded.untyped_storage().nbytes()
        if self.kept is not None:
            held += self.kept.piece.untyped_storage().nbytes()
        if self.in_flight is not None and self.in_flight.buffer is not None:
            held += self.in_flight.buffer.untyped_storage().nbytes()
        return held

    # ---- the all-gather ------------------------------------------------------------------------
    def _issue(self, flat_shard: torch.Tensor, wait: bool) -> None:
        """All-gather the flat shards into the unsharded flat; with ``wait`` compute waits for it at once."""
        link, layout, streams = self.link, self.layout, self.link.run.streams
        rank_major = layout.rank_major and self.groups.shard_size > 1
        if not rank_major:  # a rank-major gather lands in a buffer of its own first (_copy_out)
            self.allocate(prefetch=not wait)
        source, temporaries = flat_shard, []
        if self.offload or self.precision.mixed:  # to the compute device and dtype (pinned: asynchronous)
            device = self.unsharded.device
            source = flat_shard.to(device, self.precision.compute, non_blocking=True, copy=True)
            streams.use(COMPUTE, source, "alloc", f"{link.name} flat shard in the compute dtype")
            streams.use(COMPUTE, source, "write", f"{link.name} flat shard in the compute dtype")
            temporaries.append(source)
        if self.groups.shard_size == 1:  # nothing to gather: compute copies
            streams.use(COMPUTE, source, "read", f"{link.name} flat shard")
            self.target.copy_(source)
            streams.use(COMPUTE, self.target, "write", self.buffer_label())
            self.in_flight = InFlight(None, None, temporaries=temporaries)
            self.consume()
            return
        link.check(consistency.GATHER)
        group, tag = self.groups.shard_group, link.next_tag()
        assert group is not None  # F > 1: the shard group exists
        target, then, staging = self.target, None, None
        custom = None if self.settings is None else self.settings.custom_all_gather
        if rank_major:  # [Note: chunked layout]: gather rank after rank, then copy out
            size, dtype, device = self.groups.shard_size * layout.shard_numel, source.dtype, source.device
            if custom is not None:  # [Note: custom collectives] (reduce.py): the comm allocates what it writes
                staging = custom.allocate((size,), dtype=dtype, device=device)
            else:
                staging = torch.empty(size, dtype=dtype, device=device)
            streams.use(COMPUTE, staging, "alloc", self.buffer_label(prefetch=not wait))
            target, then = staging, lambda: self._copy_out(staging)
            temporaries.append(staging)
        streams.order(COMPUTE, GATHER)
        with streams.on(GATHER), torch.profiler.record_function(f"flatshard::all_gather ({link.name})"):
            streams.use(GATHER, source, "read", f"{link.name} flat shard")
            with link.errors("all_gather"):
                result = collectives.all_gather(
                    target,
                    source,
                    group,
                    async_op=not wait and streams.host_ordered,
                    tag=tag,
                    sizes=layout.shard_sizes,
                    remote=self.inter_node.gather_remote(),
                    custom=custom if rank_major else None,  # set only on fully_shard's (rank-major) units
                )
            streams.use(GATHER, target, "write", self.buffer_label())
        link.record(result, "shard")
        self.in_flight = InFlight(result.work, streams.record(GATHER), then, staging, temporaries)
        if wait:
            self.consume()

    def _issue_from(self, piece: torch.Tensor, wait: bool) -> None:
        """All-gather the unsharded flat from the pieces the post-forward group kept."""
        link, streams, group = self.link, self.link.run.streams, self.post_forward
        assert group is not None  # a kept piece exists only with a post-forward group
        self.allocate(prefetch=not wait)
        link.check(consistency.GATHER)
        tag = link.next_tag()
        streams.order(COMPUTE, GATHER)
        with streams.on(GATHER), torch.profiler.record_function(f"flatshard::all_gather ({link.name})"):
            streams.use(GATHER, piece, "read", f"{link.name} post-forward piece")
            with link.errors("all_gather"):
                result = collectives.all_gather(
                    self.target,
                    piece,
                    group.group,
                    async_op=not wait and streams.host_ordered,
                    tag=tag,
                    sizes=group.sizes,
                )
            streams.use(GATHER, self.target, "write", self.buffer_label())
        link.record(result, "post_forward")
        self.in_flight = InFlight(result.work, streams.record(GATHER), temporaries=[piece])
        if wait:
            self.consume()

    def _copy_out(self, staging: torch.Tensor) -> None:
        """A rank-major gather has arrived: only now does the unsharded flat take memory, so a gather in
        flight (a prefetch) holds one copy of the unit, as FSDP2's does, not two."""
        streams, layout = self.link.run.streams, self.layout
        assert layout.rank_major  # only a rank-major gather lands in staging
        self.allocate()
        streams.use(COMPUTE, staging, "read", self.buffer_label())
        layout.from_rank_major(staging, self.target)
        streams.use(COMPUTE, self.target, "write", self.buffer_label())
