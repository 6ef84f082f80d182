"""One flat group: what a unit's parameters are stored and communicated as.

A flat group is one flat buffer with its layout, dtype, process groups, gather and reduction: its flat
shard and shard views ([Note: flatshard tensors], layout.py), its unsharded flat and all-gather
(gather.py: ``Gather``), its gradients (grad_state.py: ``GradState``) and its reduction (reduce.py). A
unit holds one flat group per (mesh, dtype, layout kind) -- one, or for a ``fully_shard`` call with frozen
parameters of another dtype one per dtype ([Note: a flat group per dtype], build/grouping.py) -- and fans its
transitions out to them (unit.py); the communication atom is the group: one all-gather per group per
pass, one reduce-scatter per group per backward, never one collective per parameter.

The group knows nothing of the schedule: when it gathers, frees and reduces is decided by the hooks
(hooks.py) and the run context (schedule.py); what it needs of the run it reads through its unit's
``Link`` (context.py).
"""

from __future__ import annotations

import dataclasses
import weakref
from typing import Any, NamedTuple, Optional

import torch
from torch.distributed import ProcessGroup

from flatshard.runtime import consistency, reduce
from flatshard.runtime.across_replicas import Pieces, fingerprint
from flatshard.runtime.chunked import ChunkedLayout
from flatshard.runtime.comm import collectives, nodes
from flatshard.runtime.comm.mesh import ShardGroups
from flatshard.runtime.comm.streams import Lane
from flatshard.runtime.context import Link, UnitSettings
from flatshard.runtime.gather import Gather
from flatshard.runtime.grad_state import GradState, WrapGrad, local
from flatshard.runtime.layout import FlatLayout, make_compute_views, make_shard_views, set_views_on_modules
from flatshard.runtime.precision import UnitPrecision


class StoragePlan(NamedTuple):
    """Which storage a flat group's flat shard and unsharded flat use."""

    aliased: bool  # F == 1, master dtype, no offload: the unsharded flat is the flat shard itself
    reuse_flat_full: bool  # the construction buffer becomes the unsharded flat tensor (storage freed)


def storage_plan(shard_size: int, mixed: bool, offload: bool) -> StoragePlan:
    aliased = shard_size == 1 and not mixed and not offload
    return StoragePlan(aliased, not aliased and (shard_size > 1 or offload) and not mixed)


class FlatGroup:
    def __init__(
        self,
        link: Link,
        settings: UnitSettings,
        layout: FlatLayout | ChunkedLayout,
        flat_full: torch.Tensor,
        groups: ShardGroups,
        *,
        precision: UnitPrecision,
        offload: bool = False,
        pieces: Optional[Pieces] = None,
        inter_node: nodes.InterNode = nodes.LOCAL,
    ):
        """``flat_full`` is the zero-padded concatenation of the group's parameters, identical on every
        rank of the shard group, on the compute device; the group keeps this rank's slice and frees the
        rest. With ``offload`` (CPUOffload) the flat shard, and so the shard views, their gradients and
        the optimizer's state, live in CPU memory (pinned when computing on CUDA): each gather copies
        the shard to the compute device first, and each reduced gradient shard is copied back. With
        ``pieces`` the shard views own only a piece of the flat shard ([Note: optimizer state across
        replicas], across_replicas.py). ``inter_node``: which peers are on other nodes (comm/nodes.py)."""
        self.link = link
        self.settings = settings  # the unit's (gradient_divide_factor, unsynced_in_reduce_dtype)
        self.layout = layout
        self.groups = groups
        self.offload = offload
        self.inter_node = inter_node
        self.pieces = pieces
        # fully_shard's set_separate_reduce_scatter_group: a process group over the shard group's ranks for
        # the reduce-scatter alone, so that it need not queue behind the all-gathers (None: the shard group)
        self.reduce_scatter_group: Optional[ProcessGroup] = None
        self.owner_layout = layout if pieces is None else pieces.layout  # how the shard views cut the flat
        self.owner_rank = groups.shard_rank if pieces is None else pieces.rank
        self.requires_grad = any(i.requires_grad for i in layout.infos)
        self.trainable = tuple(i.requires_grad for i in layout.infos)  # as the shard views say, last forward
        self.grads = GradState()
        self.pending: Optional[reduce.PendingReduction] = None  # a reduction in flight
        self.position = 0  # its index among its unit's flat groups (build/units.py)
        # its unit's groups sit on several meshes: [Note: order checks of units on several meshes] (consistency.py)
        self.several_meshes = False
        self.reduced_in_backward = False  # post_backward ran in this backward (reset at its end)
        self.grad_waiting = False  # its flat gradient waits for the unit's inputs' backward (hooks.py)
        self.post_backward_hook: Optional[Any] = None  # the unsharded flat's post-accumulate-grad hook (hooks.py)
        self.open_splits = 0  # splits of the unsharded flat whose backward has not run (hooks.py)
        self.view_grad_bytes = 0  # per-parameter gradients autograd holds for the split's backward
        self.compute_views_set = False
        self.wrap_compute: Optional[list] = None  # fully_shard + TP: per parameter, compute view -> its DTensor
        self.originals: dict[int, weakref.ref] = {}  # id -> the parameters flattened here (build/placement.py)
        self._set_storage(flat_full, self._keep_shard(flat_full, groups.shard_rank), precision)
        if pieces is not None:  # every replica built the same flat shard: the pieces agree
            pieces.synced = fingerprint(pieces.piece(self.flat_shard))
        self.shard_views = make_shard_views(self.owner_layout, self.owned, self.owner_rank)
        set_views_on_modules(layout, self.shard_views, as_params=True)

    def _keep_shard(self, flat_full: torch.Tensor, rank: int) -> torch.Tensor:
        if self.offload:
            shard = self.layout.segment(flat_full.detach(), rank).to("cpu", copy=True)
            return shard.pin_memory() if flat_full.device.type == "cuda" else shard
        if self.groups.shard_size == 1:  # one rank holds everything (rank-major and param-major agree)
            return flat_full
        return self.layout.segment(flat_full, rank).clone()

    def _set_storage(
        self, flat_full: torch.Tensor, flat_shard: torch.Tensor, precision: UnitPrecision, reuse: bool = True
    ) -> None:
        """The flat shard, the unsharded flat and its gather: once at construction, and again when the
        group takes back parameters the user materialised (``replace_storage``, where ``flat_full`` is the
        new flat shard itself, never ``reuse``d as the unsharded flat)."""
        self.precision = precision
        self.compute_device = flat_full.device
        self.storage = storage_plan(self.groups.shard_size, precision.mixed, self.offload)
        self.flat_shard = flat_shard
        if self.storage.aliased:
            unsharded = flat_full.data  # alias with its own version counter
        else:
            unsharded = (
                flat_full
                if self.storage.reuse_flat_full and reuse
                else torch.empty(self.layout.padded, dtype=precision.compute, device=flat_full.device)
            )
            unsharded.untyped_storage().resize_(0)
        unsharded.requires_grad_(self.requires_grad)
        self.gather = Gather(
            self.link,
            self.layout,
            self.groups,
            precision,
            unsharded,
            aliased=self.storage.aliased,
            offload=self.offload,
            inter_node=self.inter_node,
            settings=self.settings,
        )

    def replace_storage(self, flat: torch.Tensor, views: list, precision: UnitPrecision) -> None:
        """Take ``flat`` (this rank's flat shard, on the device the parameters now live on) and ``views``
        (the shard views over it) as the group's storage: the user materialised a model built on meta, or
        moved or cast it ([Note: meta parameters left to the user], build/deferred.py). The caller
        registers the post-backward hook again (the unsharded flat is a new tensor)."""
        if precision.master != self.precision.master:
            self.grads.forget_shard()
        post_forward = self.gather.post_forward
        self._set_storage(flat, flat, precision, reuse=False)
        self.gather.post_forward = post_forward
        self.shard_views = views
        set_views_on_modules(self.layout, views, as_params=True)
        self.post_backward_hook = None

    @property
    def unsharded(self) -> torch.Tensor:
        """The unsharded flat (gather.py): the tensor autograd sees, and whose ``.grad`` it fills."""
        return self.gather.unsharded

    @property
    def owned(self) -> torch.Tensor:
        """What this rank's shard views view: the flat shard, or its piece ([Note: optimizer state across
        replicas]). Laid out by ``owner_layout`` at ``owner_rank``."""
        return self.flat_shard if self.pieces is None else self.pieces.piece(self.flat_shard)

    @property
    def views_replaced(self) -> bool:
        """Whether the shard views no longer view the flat shard: the user swapped their data (fully_shard's
        ``model.to(...)``: [Note: meta parameters left to the user], build/deferred.py)."""
        if not self.shard_views or self.flat_shard.is_meta:
            return False
        view = local(self.shard_views[0])
        return view.untyped_storage().data_ptr() != self.flat_shard.untyped_storage().data_ptr()

    @property
    def owners_replicated(self) -> bool:
        """Whether other replicas own the same elements as this rank (hybrid strategies without pieces)."""
        return self.groups.replicate_size > 1 and self.pieces is None

    @property
    def wrap_grad(self) -> Optional[WrapGrad]:
        """fully_shard: (index, local gradient) -> its DTensor gradient; None for plain tensors."""
        return self.grads.wrap

    @wrap_grad.setter
    def wrap_grad(self, wrap: Optional[WrapGrad]) -> None:
        self.grads.wrap = wrap

    def start_piece_sync(self, changed: bool = False) -> None:
        """Issue the all-gather of the replicas' pieces if they may have changed: after a synchronised
        backward (``Pieces.dirty``), or ``changed`` as the ranks agreed (RunContext.sync_pieces)."""
        pieces, link = self.pieces, self.link
        if pieces is None or pieces.pending is not None or not (pieces.dirty or changed):
            return
        pieces.start_sync(self.flat_shard, link.next_tag(), link.record, link.errors, link.run.streams)
        self.gather.version = -1  # the flat shard changed under a kept unsharded flat: gather again

    # ---- transitions ---------------------------------------------------------------------
    def describe(self) -> str:
        """Its parameters and the ranks it is sharded over, for errors that name it."""
        names = [info.name for info in self.layout.infos]
        listed = ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
        pg = self.groups.shard_group
        size = torch.distributed.get_world_size(pg) if pg is not None else 1
        return f"(flat group {self.position}: {listed}; on a mesh of {size} ranks)"

    @property
    def gathered(self) -> bool:
        return self.gather.gathered

    def unshard(self, wait: bool = True) -> None:
        """Fill the unsharded flat; a no-op if it already holds (or is receiving) the current flat shard.
        With ``wait=False`` the all-gather is only issued (a prefetch)."""
        if self.storage.aliased:
            return
        if self.pieces is not None:
            self.start_piece_sync()
            self.pieces.finish_sync(self.link.errors, self.link.run.streams)
        if self.gather.unshard(self.flat_shard, wait):
            self.link.run.sample_memory()

    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded flat ([Note: reshard after forward to a smaller group]: ``after_forward``
        may keep this rank's piece of it)."""
        if self.gather.free(self.flat_shard, after_forward):
            self.link.run.sample_memory()

    def use_compute_views(self) -> Optional[torch.autograd.graph.Node]:
        """Set the compute views on the modules; returns the autograd node of their split (whose
        backward builds the flat gradient), or None when no gradient flows through them."""
        if not self.storage.aliased:
            self.link.run.streams.use(Lane.COMPUTE, self.unsharded, "read", self.gather.buffer_label())
        views = make_compute_views(self.layout, self.unsharded)
        split = next((v.grad_fn.next_functions[0][0] for v in views if v.grad_fn is not None), None)
        if self.wrap_compute is not None:  # tensor-parallel parameters: the module computes with DTensors
            views = [wrap(v) if wrap is not None else v for wrap, v in zip(self.wrap_compute, views)]
        set_views_on_modules(self.layout, views, as_params=False)
        self.compute_views_set = True
        return split

    def use_shard_views(self) -> None:
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
        spec, link = self._reduce_spec(), self.link
        if self.groups.shard_size > 1 or self.groups.replicate_size > 1:
            link.check(
                consistency.REDUCE,
                self.position,
                self.several_meshes and not self.settings.reduce_scatter_unused_params,
            )
        grad = self._take_gradient(unsharded, spec.reduce_dtype)
        partial = self.grads.take_partial() if spec.all_reduces else None  # set_requires_all_reduce(False) before
        with link.errors(self._reduction_kind()):
            self.pending = reduce.start(
                grad, spec, link.record, async_op=async_op, tag=link.next_tag(), partial=partial
            )

    def keep_unsynced_gradient(self, unsharded: torch.Tensor) -> None:
        """A backward that does not synchronise (no_sync, set_requires_gradient_sync(False)): the full-size
        gradient stays unreduced. The FSDP1 wrapper leaves it on the unsharded flat, where autograd adds
        the next micro-batch's in the compute dtype (PyTorch FSDP1's flat parameter accumulates its .grad
        so); fully_shard (``unsynced_in_reduce_dtype``) keeps it in the reduce dtype and adds each next
        micro-batch's there, as FSDP2 does, so a long accumulation in bf16 parameters loses no more than
        its reduce dtype does."""
        if not self.settings.unsynced_in_reduce_dtype or unsharded.grad is None:
            return
        grad, unsharded.grad = unsharded.grad, None
        grads = self.grads
        if grad.dtype == self.precision.reduce and grads.unsynced is None:
            unsharded.grad = grad  # nothing to cast: autograd accumulates it in place
        elif grads.unsynced is None:
            grads.unsynced = grad.to(self.precision.reduce)
        else:
            grads.unsynced.add_(grad)

    def _take_gradient(self, unsharded: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        grad, unsharded.grad = unsharded.grad, None  # the one reference left: freed when this returns
        assert grad is not None  # the post-backward hook runs once autograd has accumulated it
        if self.grads.unsynced is not None:  # fully_shard's unreduced accumulation, in the reduce dtype
            grad, self.grads.unsynced = self.grads.unsynced.add_(grad), None
        if self.layout.rank_major and self.groups.shard_size > 1:  # [Note: chunked layout]: copy in
            custom = self.settings.custom_reduce_scatter  # [Note: custom collectives] (reduce.py): its buffer
            size = (self.groups.shard_size * self.layout.shard_numel,)
            out = None if custom is None else custom.allocate(size, dtype=dtype, device=grad.device)
            grad = self.layout.to_rank_major(grad, dtype, out=out)
        elif grad.dtype != dtype:
            grad = grad.to(dtype)
        # what the reduction sends, made by compute (autograd, the cast or the copy): [Note: stream discipline]
        streams = self.link.run.streams
        streams.use(Lane.COMPUTE, grad, "alloc", f"gradient {self.link.name}")
        streams.use(Lane.COMPUTE, grad, "write", f"gradient {self.link.name}")
        return grad

    def advance_reduction(self, async_op: bool) -> None:
        """Finish the shard group's part of the reduction in flight and issue the all-reduce across
        replicas (hybrid), left in flight with ``async_op`` ([Note: reductions in flight], schedule.py)."""
        if self.pending is None:
            return
        link = self.link
        with link.errors(self._reduction_kind()):
            reduce.advance(self.pending, self._reduce_spec(), link.record, async_op=async_op, tag=link.next_tag())

    def finish_reduction(self) -> None:
        """Wait for this group's reduction (if one is in flight) and expose the result as ``.grad``."""
        if self.pending is None:
            return
        pending, self.pending = self.pending, None
        link = self.link
        if pending.shard_sum_only:  # set_requires_all_reduce(False): kept for the next all-reduce, not exposed
            with link.errors(self._reduction_kind()):
                self.grads.add_partial(
                    reduce.finish_shard_sum(pending, self._reduce_spec(), link.record, link.next_tag())
                )
            link.run.sample_memory()
            return
        with link.errors(self._reduction_kind()):
            reduced = reduce.finish(pending, self._reduce_spec(), self.precision.grad, link.record, tag=link.next_tag())
        if self.offload:
            reduced = reduced.to(self.flat_shard.device)
        self.grads.expose(reduced, self.shard_views, self.owner_layout.local_slices(self.owner_rank))
        if self.pieces is not None:  # the optimizer may step the piece next: sync before the next forward
            self.pieces.dirty = True
        link.run.sample_memory()

    def abandon(self) -> None:
        """A step that raised ([Note: a step that raised], schedule.py): wait for this group's collectives
        in flight and drop the gradients it had not exposed (a reduction in flight, an unreduced
        accumulation, the window's marks)."""
        self.gather.consume()
        if self.pieces is not None:
            self.pieces.finish_sync(self.link.errors, self.link.run.streams)
        if self.pending is not None:
            pending, self.pending = self.pending, None
            with self.link.errors(self._reduction_kind()):
                reduce.discard(pending, self._reduce_spec())
        self.gather.kept = None
        self.open_splits = 0
        self.view_grad_bytes = 0
        self.grads.drop_unreduced(self.shard_views, self.unsharded)

    @property
    def grad_shard(self) -> Optional[torch.Tensor]:
        """The tensor the trainable shard views' ``.grad`` slice, while they still do (grad_state.py)."""
        return self.grads.grad_shard(self.shard_views)

    @property
    def window_open(self) -> bool:
        """Whether this group holds an unreduced accumulation ([Note: an open accumulation window])."""
        return self.grads.window_open(self.unsharded)

    def mark_window(self) -> None:
        if self.window_open:
            self.grads.mark_window(self.shard_views)

    def drop_cleared(self) -> None:
        slices = self.layout.local_slices(self.groups.shard_rank)
        self.grads.drop_cleared(self.shard_views, self.unsharded, self.layout.split_sizes, slices)

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
        layout = self.layout
        n = self.groups.shard_size * layout.shard_numel if layout.rank_major else layout.padded
        full = torch.empty(n, dtype=shard.dtype, device=self.compute_device)
        with self.link.errors("all_gather"):
            group, tag = self.groups.shard_group, self.link.next_tag()
            assert group is not None  # F > 1: the shard group exists
            result = collectives.all_gather(full, source, group, tag=tag, sizes=layout.shard_sizes)
        self.link.record(result, "shard")
        if layout.rank_major:
            flat = torch.empty(layout.padded, dtype=shard.dtype, device=self.compute_device)
            layout.from_rank_major(full, flat)
            return flat
        return full

    def gather_owned(self, owned: torch.Tensor) -> torch.Tensor:
        """``gather_full`` of a tensor laid out like ``owned`` (parameters, gradients, optimizer state)."""
        if self.pieces is not None:
            link = self.link
            owned = self.pieces.gather(owned.to(self.compute_device), link.next_tag(), link.record, link.errors)
        return self.gather_full(owned)

    # ---- accounting ------------------------------------------------------------------------
    def _reduce_spec(self) -> reduce.ReduceSpec:
        settings = self.settings
        return reduce.ReduceSpec(
            self.groups,
            self.layout.shard_sizes,
            self.precision.reduce,
            self.link.name,
            settings.gradient_divide_factor,
            self.inter_node,
            self.pieces is not None,
            self.link.run.streams,
            across_replicas=settings.requires_all_reduce,
            force_sum=settings.force_sum_reduction_for_comms,
            hook=settings.all_reduce_hook,
            custom=settings.custom_reduce_scatter if self.layout.rank_major else None,
            scatter_group=self.reduce_scatter_group,
        )

    def _reduction_kind(self) -> str:
        return "reduce_scatter" if self.groups.shard_size > 1 else "all_reduce"

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this group holds now, by category (see ``instrument.MemoryRecorder``)."""
        grad_storages = {}
        for v in self.shard_views:
            if v.grad is not None:
                storage = local(v.grad).untyped_storage()
                grad_storages[storage.data_ptr()] = storage.nbytes()
        grads = sum(grad_storages.values())
        if self.grads.partial is not None:  # shard-group sums waiting for an all-reduce across replicas
            grads += self.grads.partial.untyped_storage().nbytes()
        gathered = self.gather.nbytes()
        for held in (self.unsharded.grad, self.grads.unsynced):
            if held is not None:
                gathered += held.untyped_storage().nbytes()
        gathered += self.view_grad_bytes
        if self.pending is not None:  # in flight: the full-size gradient and the shard it lands in
            full, out = self.pending.nbytes()
            gathered += full
            grads += out
        params = self.flat_shard.untyped_storage().nbytes()
        return {"params": params, "grads": grads, "optimizer": 0, "gathered": gathered}

    def managed_tensors(self) -> list[torch.Tensor]:
        """The tensors ``memory_bytes`` counts that a memory tracker could otherwise take for activations."""
        tensors = [self.flat_shard, self.unsharded]
        if self.unsharded.grad is not None:
            tensors.append(self.unsharded.grad)
        return tensors + [local(v.grad) for v in self.shard_views if v.grad is not None]

    def __repr__(self) -> str:
        sizes = self.layout.shard_sizes
        state = "UNSHARDED" if self.gathered or self.storage.aliased else "SHARDED"
        return f"FlatGroup({self.link.name}, T={self.layout.total}, S={sizes[self.groups.shard_rank]}, {state})"
