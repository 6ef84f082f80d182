"""One unit: its flat shard, its unsharded flat and its gradient shard, and the transitions between them.

States: SHARDED (only the flat shard holds data) and UNSHARDED (the unsharded flat holds the full
parameters). ``unshard`` and ``reshard`` are idempotent. Terms as in [Note: flatshard tensors]
(layout.py). When each transition runs is decided by the hooks (hooks.py); this file only knows
how a unit changes state.

When F == 1 and the compute dtype is the master dtype, the unsharded flat aliases the flat shard's
storage (through ``.data``, so it has its own version counter and the optimizer's in-place updates
never invalidate what autograd saved): nothing is gathered and nothing is freed.

Collectives may be issued asynchronously (prefetch): ``unshard(wait=False)`` issues the all-gather
and returns; whoever needs the parameters waits (``unshard()`` does), and ``reshard`` waits before
it frees. Gradient reductions likewise (reduce.py).
"""

from __future__ import annotations

import dataclasses
import enum
import weakref
from typing import Any, NamedTuple, Optional

import torch

from flatshard.api import MixedPrecision, ShardingStrategy
from flatshard.runtime import consistency, exposure, gather, reduce
from flatshard.runtime.across_replicas import Pieces, fingerprint
from flatshard.runtime.comm import collectives, nodes
from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.comm.streams import Lane
from flatshard.runtime.exposure import local
from flatshard.runtime.layout import FlatLayout, make_compute_views, make_shard_views, set_views_on_modules
from flatshard.runtime.post_forward import PostForwardGroup
from flatshard.runtime.precision import UnitPrecision
from flatshard.runtime.schedule import RunContext, ScheduleConfig


class UnitState(enum.Enum):
    SHARDED = enum.auto()
    UNSHARDED = enum.auto()


class StoragePlan(NamedTuple):
    """Which storage a unit's flat shard and unsharded flat use."""

    aliased: bool  # F == 1, master dtype, no offload: the unsharded flat is the flat shard itself
    reuse_flat_full: bool  # the construction buffer becomes the unsharded flat tensor (storage freed)


def storage_plan(shard_size: int, mixed: bool, offload: bool) -> StoragePlan:
    aliased = shard_size == 1 and not mixed and not offload
    return StoragePlan(aliased, not aliased and (shard_size > 1 or offload) and not mixed)


class Unit:
    def __init__(
        self,
        name: str,
        layout: FlatLayout,
        flat_full: torch.Tensor,
        groups: ShardGroups,
        *,
        reshard_after_forward: bool,
        precision: UnitPrecision,
        offload: bool = False,
        pieces: Optional[Pieces] = None,
    ):
        """``flat_full`` is the zero-padded concatenation of the unit's parameters, identical on every
        rank of the shard group, on the compute device; the unit keeps this rank's slice and frees the
        rest. With ``offload`` (CPUOffload) the flat shard, and so the shard views, their gradients and
        the optimizer's state, live in CPU memory (pinned when computing on CUDA): each gather copies
        the shard to the compute device first, and each reduced gradient shard is copied back. With
        ``pieces`` the shard views own only a piece of the flat shard ([Note: optimizer state across
        replicas], across_replicas.py).

        The unit starts with a run context of its own; the root that builds or adopts it hands it the
        root's (build/units.py)."""
        self.name = name or "<root>"
        self.layout = layout
        self.groups = groups
        self.reshard_after_forward = reshard_after_forward  # free after forward, gather again in backward
        self.precision = precision
        self.requires_grad = any(i.requires_grad for i in layout.infos)
        self.compute_device = flat_full.device
        self.offload = offload
        self.plan = storage_plan(groups.shard_size, precision.mixed, offload)
        self.flat_shard = self._keep_shard(flat_full)
        if self.plan.aliased:
            self.unsharded = flat_full.data  # alias with its own version counter
        else:
            self.unsharded = (
                flat_full
                if self.plan.reuse_flat_full
                else torch.empty(layout.padded, dtype=precision.compute, device=flat_full.device)
            )
            self.unsharded.untyped_storage().resize_(0)
        self.unsharded.requires_grad_(self.requires_grad)
        self._gather_target = self.unsharded.data  # what collectives write into (own version counter)
        self.pieces = pieces
        if pieces is not None:  # every replica built the same flat shard: the pieces agree
            pieces.synced = fingerprint(pieces.piece(self.flat_shard))
        self.owner_layout = layout if pieces is None else pieces.layout  # how the shard views cut the flat
        self.owner_rank = groups.shard_rank if pieces is None else pieces.rank
        self.shard_views = make_shard_views(self.owner_layout, self.owned, self.owner_rank)
        self.state = UnitState.UNSHARDED if self.plan.aliased else UnitState.SHARDED
        self.ctx = RunContext([self], self, ScheduleConfig())
        self.reduction: Optional[reduce.PendingReduction] = None
        self.compute_views_set = False
        self.open_splits = 0  # splits of the unsharded flat whose backward has not run (hooks.py)
        self.view_grad_bytes = 0  # per-parameter gradients autograd holds for the split's backward
        self._gathered_version = -1
        self.gather_in_flight: Optional[gather.InFlight] = None
        self._grad_shard: Optional[weakref.ref] = None
        self.trainable = tuple(i.requires_grad for i in layout.infos)  # as the shard views say, last forward
        self.post_backward_hook: Optional[Any] = None  # the unsharded flat's post-accumulate-grad hook (hooks.py)
        self.originals: dict[int, weakref.ref] = {}  # id -> the parameters flattened here (build/placement.py)
        # per-unit settings of the fully_shard front end (FSDP2's set_* methods); FSDP1 leaves the defaults
        self.requires_gradient_sync = True  # False: this unit's gradients accumulate unreduced (no_sync)
        self.unsynced_in_reduce_dtype = False  # fully_shard: accumulate unreduced in the reduce dtype, as FSDP2
        self.unsynced: Optional[torch.Tensor] = None  # that accumulation (keep_unsynced_gradient)
        self.window_marks: list = []  # [Note: an open accumulation window] (exposure.py)
        self.reshard_after_backward = True
        self.gradient_divide_factor: Optional[float] = None  # None: divide by the data-parallel size
        self.forward_prefetch: list[Unit] = []  # explicit prefetch targets (else the run context's schedule)
        self.backward_prefetch: list[Unit] = []
        self.forward_entries: list = []  # fully_shard: the exception being handled as each forward began (hooks.py)
        self.summoned = False  # inside summon_full_params, its modules hold the full parameters (summon.py)
        self.grad_as: Optional[Any] = None  # fully_shard: (index, local gradient) -> its DTensor gradient
        self.compute_as: Optional[list] = None  # fully_shard + TP: per parameter, compute view -> its DTensor
        self.post_forward: Optional[PostForwardGroup] = None  # fully_shard's reshard_after_forward=int
        self.inter_node = nodes.LOCAL  # which of its peers are on other nodes; int8 across them (build/units.py)
        self._partial: Optional[tuple[torch.Tensor, int]] = None  # (this rank's piece, flat shard version)
        self.strategy: Optional[ShardingStrategy] = None  # what the wrap call asked for (checkpoint manifests)
        self.mixed_precision: Optional[MixedPrecision] = None  # the policy ``precision`` was resolved from
        # fully_shard: parameters kept out of the flat shard that gather themselves ([Note: parameters that
        # gather themselves], fsdp2/extensions.py); it gathers beside the compute views, frees beside reshard
        self.side: Optional[Any] = None
        set_views_on_modules(layout, self.shard_views, as_params=True)

    def _keep_shard(self, flat_full: torch.Tensor) -> torch.Tensor:
        rank = self.groups.shard_rank
        if self.offload:
            shard = self.layout.segment(flat_full.detach(), rank).to("cpu", copy=True)
            return shard.pin_memory() if self.compute_device.type == "cuda" else shard
        if self.groups.shard_size == 1:  # one rank holds everything (rank-major and param-major agree)
            return flat_full
        return self.layout.segment(flat_full, rank).clone()

    @property
    def owned(self) -> torch.Tensor:
        """What this rank's shard views view: the flat shard, or its piece ([Note: optimizer state across
        replicas]). Laid out by ``owner_layout`` at ``owner_rank``."""
        return self.flat_shard if self.pieces is None else self.pieces.piece(self.flat_shard)

    @property
    def owners_replicated(self) -> bool:
        """Whether other replicas own the same elements as this rank (hybrid strategies without pieces)."""
        return self.groups.replicate_size > 1 and self.pieces is None

    def start_piece_sync(self, changed: bool = False) -> None:
        """Issue the all-gather of the replicas' pieces if they may have changed: after a synchronised
        backward (``Pieces.dirty``), or ``changed`` as the ranks agreed (RunContext.sync_pieces)."""
        pieces = self.pieces
        if pieces is None or pieces.pending is not None or not (pieces.dirty or changed):
            return
        pieces.start_sync(self.flat_shard, self.ctx.next_tag(self), self.record, self._errors, self.ctx.streams)
        self._gathered_version = -1  # the flat shard changed under a kept unsharded flat: gather again

    @property
    def is_root(self) -> bool:
        """The root is the outermost unit of a model; it stays gathered from forward to backward."""
        return self.ctx.root is self

    # ---- transitions ---------------------------------------------------------------------
    def unshard(self, wait: bool = True) -> None:
        """Fill the unsharded flat; a no-op if it already holds (or is receiving) the current flat shard.
        With ``wait=False`` the all-gather is only issued (a prefetch)."""
        if self.plan.aliased:
            return
        if self.pieces is not None:
            self.start_piece_sync()
            self.pieces.finish_sync(self._errors, self.ctx.streams)
        if self.state is UnitState.UNSHARDED and self._gathered_version == self.flat_shard._version:
            if wait:
                self.wait_for_unshard()
            return
        self.wait_for_unshard()
        partial, self._partial = self._partial, None
        if partial is not None and partial[1] == self.flat_shard._version:  # the smaller group's gather
            gather.issue_from(self, partial[0], wait)
        else:
            gather.issue(self, wait)
        self._gathered_version = self.flat_shard._version
        self.state = UnitState.UNSHARDED
        self.ctx.sample_memory()

    def allocate(self, prefetch: bool = False) -> None:
        """Give the unsharded flat its memory (compute allocates it: [Note: stream discipline])."""
        storage = self.unsharded.untyped_storage()
        nbytes = self.layout.padded * self.unsharded.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
            self.ctx.streams.use(Lane.COMPUTE, self.unsharded, "alloc", gather.what(self, prefetch))

    def wait_for_unshard(self) -> None:
        """Compute waits for this unit's all-gather in flight, if one is (gather.py)."""
        gather.consume(self)

    @property
    def gathered(self) -> bool:
        """Whether this unit holds (or is receiving) its unsharded flat in memory of its own."""
        return not self.plan.aliased and self.state is UnitState.UNSHARDED

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded flat (its tensor object stays, for autograd's saved views). ``after_forward``
        with a post-forward group ([Note: reshard after forward to a smaller group]): keep this rank's
        piece of it for the backward's gather within that group."""
        if self.side is not None and not self.ctx.in_backward:  # in backward: at its end (finish_backward)
            self.side.free()
        if self.state is UnitState.SHARDED or self.plan.aliased:
            return
        self.wait_for_unshard()  # never free memory a collective is still writing
        streams = self.ctx.streams
        if after_forward and self.post_forward is not None:
            piece = self.post_forward.piece(self.unsharded.data).clone()
            streams.use(Lane.COMPUTE, piece, "alloc", f"{self.name} post-forward piece")
            streams.use(Lane.COMPUTE, piece, "write", f"{self.name} post-forward piece")
            self._partial = (piece, self.flat_shard._version)
        streams.use(Lane.COMPUTE, self.unsharded, "free", gather.what(self))
        self.unsharded.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self.ctx.sample_memory()

    def use_compute_views(self) -> Optional[torch.autograd.graph.Node]:
        """Set the compute views on the modules; returns the autograd node of their split (whose
        backward builds the flat gradient), or None when no gradient flows through them."""
        if not self.plan.aliased:
            self.ctx.streams.use(Lane.COMPUTE, self.unsharded, "read", gather.what(self))
        views = make_compute_views(self.layout, self.unsharded)
        split = next((v.grad_fn.next_functions[0][0] for v in views if v.grad_fn is not None), None)
        if self.compute_as is not None:  # tensor-parallel parameters: the module computes with DTensors
            views = [wrap(v) if wrap is not None else v for wrap, v in zip(self.compute_as, views)]
        set_views_on_modules(self.layout, views, as_params=False)
        if self.side is not None:
            self.side.use_compute(self)
        self.compute_views_set = True
        return split

    def use_shard_views(self) -> None:
        if self.side is not None:
            self.side.use_sharded()
        if self.compute_views_set:
            set_views_on_modules(self.layout, self.shard_views, as_params=True)
            self.compute_views_set = False

    def refresh_requires_grad(self) -> bool:
        """Follow ``requires_grad`` set on the shard views after wrapping (a parameter unfrozen or frozen):
        the layout, the compute views and the reduction then follow the new set. True if it changed.
        Every rank must change the same parameters (a rank that differs reduces other gradients)."""
        now = tuple(v.requires_grad for v in self.shard_views)
        if now == self.trainable:
            return False
        self.trainable = now
        self.layout.infos[:] = [dataclasses.replace(i, requires_grad=r) for i, r in zip(self.layout.infos, now)]
        self.requires_grad = any(now)
        self.unsharded.requires_grad_(self.requires_grad)
        return True

    # ---- gradients -----------------------------------------------------------------------
    def start_reduction(self, unsharded: torch.Tensor, async_op: bool) -> None:
        """Issue the reduction of the unsharded flat's full-size gradient to this rank's grad shard. The
        gradient is taken off ``unsharded``; what the collective sends is made from it in the reduce dtype
        (a cast, or [Note: chunked layout]'s rank-major copy) before the reduction starts, and the
        original is released then, so the two never wait out the collective together."""
        spec = self._reduce_spec()
        if self.groups.shard_size > 1 or self.groups.replicate_size > 1:
            self.ctx.checker.check(consistency.REDUCE, self, self.ctx.phase)
        grad = self._take_gradient(unsharded, spec.reduce_dtype)
        with self._errors(self._reduction_kind()):
            self.reduction = reduce.start(grad, spec, self.record, async_op=async_op, tag=self.ctx.next_tag(self))

    def keep_unsynced_gradient(self, unsharded: torch.Tensor) -> None:
        """A backward that does not synchronise (no_sync, set_requires_gradient_sync(False)): the full-size
        gradient stays unreduced. The FSDP1 wrapper leaves it on the unsharded flat, where autograd adds
        the next micro-batch's in the compute dtype (PyTorch FSDP1's flat parameter accumulates its .grad
        so); fully_shard (``unsynced_in_reduce_dtype``) keeps it in the reduce dtype and adds each next
        micro-batch's there, as FSDP2 does, so a long accumulation in bf16 parameters loses no more than
        its reduce dtype does."""
        if not self.unsynced_in_reduce_dtype or unsharded.grad is None:
            return
        grad, unsharded.grad = unsharded.grad, None
        if grad.dtype == self.precision.reduce and self.unsynced is None:
            unsharded.grad = grad  # nothing to cast: autograd accumulates it in place
        elif self.unsynced is None:
            self.unsynced = grad.to(self.precision.reduce)
        else:
            self.unsynced.add_(grad)

    def _take_gradient(self, unsharded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        grad, unsharded.grad = unsharded.grad, None  # the one reference left: freed when this returns
        if self.unsynced is not None:  # fully_shard's unreduced accumulation, in the reduce dtype
            grad, self.unsynced = self.unsynced.add_(grad), None
        if self.layout.rank_major and self.groups.shard_size > 1:  # [Note: chunked layout]: copy in
            grad = self.layout.to_rank_major(grad, dtype)
        elif grad.dtype != dtype:
            grad = grad.to(dtype)
        # what the reduction sends, made by compute (autograd, the cast or the copy): [Note: stream discipline]
        self.ctx.streams.use(Lane.COMPUTE, grad, "alloc", f"gradient {self.name}")
        self.ctx.streams.use(Lane.COMPUTE, grad, "write", f"gradient {self.name}")
        return grad

    def advance_reduction(self, async_op: bool) -> None:
        """Finish the shard group's part of the reduction in flight and issue the all-reduce across
        replicas (hybrid), left in flight with ``async_op`` ([Note: reductions in flight], schedule.py)."""
        if self.reduction is None:
            return
        with self._errors(self._reduction_kind()):
            tag = self.ctx.next_tag(self)
            reduce.advance(self.reduction, self._reduce_spec(), self.record, async_op=async_op, tag=tag)

    def finish_reduction(self) -> None:
        """Wait for this unit's reduction (if one is in flight) and expose the result as ``.grad``."""
        if self.reduction is None:
            return
        pending, self.reduction = self.reduction, None
        spec = self._reduce_spec()
        with self._errors(self._reduction_kind()):
            reduced = reduce.finish(pending, spec, self.precision.grad, self.record, tag=self.ctx.next_tag(self))
        self._expose_grads(reduced)
        if self.pieces is not None:  # the optimizer may step the piece next: sync before the next forward
            self.pieces.dirty = True
        self.ctx.sample_memory()

    def abandon_step(self) -> None:
        """A step that raised ([Note: a step that raised], schedule.py): wait for this unit's collectives in
        flight, drop the gradients it had not exposed (a reduction in flight, an unreduced accumulation),
        put the shard views back and reshard."""
        self.wait_for_unshard()
        if self.pieces is not None:
            self.pieces.finish_sync(self._errors, self.ctx.streams)
        if self.reduction is not None:
            pending, self.reduction = self.reduction, None
            with self._errors(self._reduction_kind()):
                reduce.discard(pending, self._reduce_spec())
        self._partial = None
        self.open_splits = 0
        self.view_grad_bytes = 0
        self.unsharded.grad = self.unsynced = None
        if self.side is not None:
            self.side.abandon()
        exposure.unmark(self)
        self.use_shard_views()
        self.reshard()

    @property
    def sync(self) -> bool:
        """Whether this backward reduces this unit's gradient (not under no_sync / set_requires_gradient_sync)."""
        return self.ctx.sync_gradients and self.requires_gradient_sync

    def finish_backward(self) -> None:
        """End of backward: put shard views back and reshard what is still gathered."""
        self.open_splits = 0
        self.use_shard_views()
        if self.reshard_after_backward and (self.sync or self.reshard_after_forward):
            if self.side is not None:
                self.side.free()
            self.reshard()

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """The tensor the trainable shard views' ``.grad`` slice, while they still do (exposure.py)."""
        return exposure.grad_shard(self)

    def _expose_grads(self, reduced: torch.Tensor) -> None:
        exposure.expose_grads(self, reduced)

    # ---- whole flats for summon and state dicts --------------------------------------------
    def gather_full(self, shard: torch.Tensor) -> torch.Tensor:
        """The shard group's ``shard`` tensors (S elements each, e.g. the flat shard or optimizer state
        laid out like it) concatenated: the padded flat, on the compute device; ``shard`` itself when
        there is nothing to gather. Recorded under the run context's current phase."""
        if self.groups.shard_size == 1 and shard.device == self.compute_device:
            return shard
        source = shard.to(self.compute_device).contiguous()
        if self.groups.shard_size == 1:
            return source
        n = self.groups.shard_size * self.layout.shard_numel if self.layout.rank_major else self.layout.padded
        full = torch.empty(n, dtype=shard.dtype, device=self.compute_device)
        with self._errors("all_gather"):
            group, tag, sizes = self.groups.shard_group, self.ctx.next_tag(self), self.layout.shard_sizes
            result = collectives.all_gather(full, source, group, tag=tag, sizes=sizes)
        self.record(result, "shard")
        if self.layout.rank_major:
            flat = torch.empty(self.layout.padded, dtype=shard.dtype, device=self.compute_device)
            self.layout.from_rank_major(full, flat)
            return flat
        return full

    def gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """``gather_full`` of a tensor laid out like ``owned`` (parameters, gradients, optimizer state)."""
        if self.pieces is not None:
            owned = self.pieces.gather(
                owned.to(self.compute_device), self.ctx.next_tag(self), self.record, self._errors
            )
        return self.gather_full(owned)

    # ---- accounting ------------------------------------------------------------------------
    def _errors(self, collective: str):
        return consistency.collective_errors(self, collective)

    def _reduce_spec(self) -> reduce.ReduceSpec:
        return reduce.ReduceSpec(
            self.groups,
            self.layout.shard_sizes,
            self.precision.reduce,
            self.name,
            self.gradient_divide_factor,
            self.inter_node,
            self.pieces is not None,
            self.ctx.streams,
        )

    def _reduction_kind(self) -> str:
        return "reduce_scatter" if self.groups.shard_size > 1 else "all_reduce"

    def record(self, result: collectives.CollectiveResult, group: str) -> None:
        self.ctx.record(result, group, self.name)

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this unit holds now, by category (see ``instrument.MemoryRecorder``)."""
        grad_storages = {}
        for v in self.shard_views:
            if v.grad is not None:
                storage = local(v.grad).untyped_storage()
                grad_storages[storage.data_ptr()] = storage.nbytes()
        grads = sum(grad_storages.values())
        gathered = 0 if self.plan.aliased else self.unsharded.untyped_storage().nbytes()
        for held in (self.unsharded.grad, self.unsynced):
            if held is not None:
                gathered += held.untyped_storage().nbytes()
        gathered += self.view_grad_bytes
        if self._partial is not None:
            gathered += self._partial[0].untyped_storage().nbytes()
        in_flight = self.gather_in_flight
        if in_flight is not None and in_flight.buffer is not None:
            gathered += in_flight.buffer.untyped_storage().nbytes()
        if self.reduction is not None:  # in flight: the full-size gradient and the shard it lands in
            full, out = self.reduction.nbytes()
            gathered += full
            grads += out
        held = {
            "params": self.flat_shard.untyped_storage().nbytes(),
            "grads": grads,
            "optimizer": 0,
            "gathered": gathered,
        }
        if self.side is not None:  # parameters that gather themselves (fsdp2/extensions.py)
            for kind, nbytes in self.side.memory_bytes().items():
                held[kind] += nbytes
        return held

    def __repr__(self) -> str:
        sizes = self.layout.shard_sizes
        return f"Unit({self.name}, T={self.layout.total}, S={sizes[self.groups.shard_rank]}, {self.state.name})"
