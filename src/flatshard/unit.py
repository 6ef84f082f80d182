"""One unit: its flat shard, its unsharded flat and its gradient shard, and the transitions between them.

States: SHARDED (only the flat shard holds data) and UNSHARDED (the unsharded flat holds the full
parameters). ``unshard`` and ``reshard`` are idempotent. Terms as in [Note: flatshard tensors]
(flat_param.py).

When F == 1 and the compute dtype is the master dtype, the unsharded flat aliases the flat shard's
storage (through ``.data``, so it has its own version counter and the optimizer's in-place updates
never invalidate what autograd saved): nothing is gathered and nothing is freed.

Collectives may be issued asynchronously (prefetch): ``unshard(wait=False)`` issues the all-gather
and returns; whoever needs the parameters waits (``unshard()`` does), and ``reshard`` waits before
it frees. Gradient reductions likewise (reduce.py).
"""
from __future__ import annotations

import enum
from typing import Optional

import torch

from flatshard import collectives, reduce
from flatshard.flat_param import FlatLayout, make_compute_views, make_shard_views, set_views_on_modules
from flatshard.mesh import ShardGroups
from flatshard.precision import UnitPrecision


class UnitState(enum.Enum):
    SHARDED = enum.auto()
    UNSHARDED = enum.auto()


class Unit:
    def __init__(
        self,
        name: str,
        layout: FlatLayout,
        flat_full: torch.Tensor,
        groups: ShardGroups,
        *,
        full_shard: bool,
        precision: UnitPrecision,
        offload: bool = False,
    ):
        """``flat_full`` is the zero-padded concatenation of the unit's parameters, identical on every
        rank of the shard group, on the compute device; the unit keeps this rank's slice and frees the
        rest. With ``offload`` (CPUOffload) the flat shard, and so the shard views, their gradients and
        the optimizer's state, live in CPU memory (pinned when computing on CUDA): each gather copies
        the shard to the compute device first, and each reduced gradient shard is copied back."""
        self.name = name or "<root>"
        self.layout = layout
        self.groups = groups
        self.full_shard = full_shard  # FULL_SHARD: free after forward and after each backward
        self.is_root = False  # set by the root on first use; the root stays gathered from forward to backward
        self.ctx = None  # RunContext, set by the root on first use
        self.precision = precision
        self.requires_grad = any(i.requires_grad for i in layout.infos)
        S, rank = layout.shard_numel, groups.shard_rank
        self.compute_device = flat_full.device
        self.offload = offload
        self._aliased = groups.shard_size == 1 and not precision.mixed and not offload
        if offload:
            self.flat_shard = flat_full.detach()[rank * S : (rank + 1) * S].to("cpu", copy=True)
            if self.compute_device.type == "cuda":
                self.flat_shard = self.flat_shard.pin_memory()
        elif groups.shard_size == 1:
            self.flat_shard = flat_full
        else:
            self.flat_shard = flat_full[rank * S : (rank + 1) * S].clone()
        if self._aliased:
            self.unsharded = flat_full.data  # alias with its own version counter
        else:
            same = (groups.shard_size > 1 or offload) and not precision.mixed
            self.unsharded = flat_full if same else torch.empty(layout.padded, dtype=precision.compute, device=flat_full.device)
            self.unsharded.untyped_storage().resize_(0)
        self.unsharded.requires_grad_(self.requires_grad)
        self._gather_target = self.unsharded.data  # what collectives write into (own version counter)
        self.shard_views = make_shard_views(layout, self.flat_shard, rank)
        self._gathered_version = -1
        self._gather: Optional[tuple] = None  # (work, source) of an all-gather in flight
        self.reduction: Optional[reduce.PendingReduction] = None
        self.state = UnitState.UNSHARDED if self._aliased else UnitState.SHARDED
        self._compute_views_set = False
        self._open_splits = 0  # splits of the unsharded flat whose backward has not run (see use_compute_views)
        self._view_grad_bytes = 0  # per-parameter gradients autograd holds for the split's backward
        set_views_on_modules(layout, self.shard_views, as_params=True)
        if self.requires_grad:
            self.unsharded.register_post_accumulate_grad_hook(self._post_backward)

    # ---- transitions ---------------------------------------------------------------------
    def unshard(self, wait: bool = True) -> None:
        """Fill the unsharded flat; a no-op if it already holds (or is receiving) the current flat shard.
        With ``wait=False`` the all-gather is only issued (a prefetch)."""
        if self._aliased:
            return
        if self.state is UnitState.UNSHARDED and self._gathered_version == self.flat_shard._version:
            if wait:
                self.wait_for_unshard()
            return
        self.wait_for_unshard()
        storage = self.unsharded.untyped_storage()
        nbytes = self.layout.padded * self.unsharded.element_size()
        if storage.nbytes() != nbytes:
            storage.resize_(nbytes)
        source = self.flat_shard
        if self.offload or self.precision.mixed:  # to the compute device and dtype (pinned: asynchronous)
            source = self.flat_shard.to(self.compute_device, self.precision.compute, non_blocking=True, copy=True)
        if self.groups.shard_size == 1:
            self._gather_target.copy_(source)
        else:
            with torch.profiler.record_function(f"flatshard::all_gather ({self.name})"):
                result = collectives.all_gather(self._gather_target, source, self.groups.shard_group,
                                                async_op=not wait, tag=self.next_tag())
            self._record(result, "shard")
            if result.work is not None:
                self._gather = (result.work, source)
        self._gathered_version = self.flat_shard._version
        self.state = UnitState.UNSHARDED
        self._sample_memory()

    def wait_for_unshard(self) -> None:
        if self._gather is not None:
            self._gather[0].wait()
            self._gather = None

    @property
    def gathered(self) -> bool:
        """Whether this unit holds (or is receiving) its unsharded flat in memory of its own."""
        return not self._aliased and self.state is UnitState.UNSHARDED

    def reshard(self) -> None:
        """Free the unsharded flat (its tensor object stays, for autograd's saved views)."""
        if self.state is UnitState.SHARDED or self._aliased:
            return
        self.wait_for_unshard()  # never free memory a collective is still writing
        self.unsharded.untyped_storage().resize_(0)
        self.state = UnitState.SHARDED
        self._sample_memory()

    def use_compute_views(self) -> None:
        views = make_compute_views(self.layout, self.unsharded)
        set_views_on_modules(self.layout, views, as_params=False)
        self._compute_views_set = True
        split = next((v.grad_fn.next_functions[0][0] for v in views if v.grad_fn is not None), None)
        if split is not None and not self._in_backward():  # its backward will build the flat gradient
            self._open_splits += 1
            split.register_prehook(self._views_done)

    # [Note: free before the flat gradient]
    # Backward of the compute views' split concatenates their gradients into one flat gradient, a
    # buffer the size of the unsharded flat. By the time it runs, every operator that reads these views
    # has run its backward, so when it is the last open split of this unit (a unit run twice in one pass
    # has two) the unsharded flat is freed first: backward then holds the gradients and the flat
    # gradient, never the parameters as well, and the peak of a unit's backward drops by one unsharded
    # flat. Only splits made outside backward count: a recomputation's split (activation checkpointing)
    # never runs its backward (non-reentrant) or runs it with the parameters no longer needed after
    # (reentrant, where the unit then reshards in post-backward). A split made before the last backward
    # ended (counts reset there) leaves the count off zero: the unit then reshards in post-backward.
    def _views_done(self, grad_outputs):
        self._open_splits -= 1
        # The unit's backward peak: its parameters and every per-parameter gradient, about to be joined.
        self._view_grad_bytes = sum(g.untyped_storage().nbytes() for g in grad_outputs if g is not None)
        self._sample_memory()
        if self._open_splits == 0 and self._in_backward() and (self.ctx.sync_gradients or self.full_shard):
            self.use_shard_views()
            self.reshard()
        return None

    def use_shard_views(self) -> None:
        if self._compute_views_set:
            set_views_on_modules(self.layout, self.shard_views, as_params=True)
            self._compute_views_set = False

    # ---- forward and backward --------------------------------------------------------------
    # [Note: recomputation in backward]
    # Activation checkpointing runs a unit's forward again during backward. Whether the checkpoint
    # wraps the unit (its forward, with these hooks, runs again) or sits inside it (the module reads
    # its parameters directly), the unit must be gathered with compute views set on its modules until
    # its post-backward; so a forward that runs in the backward phase neither reshards nor puts the
    # shard views back, and pre-backward sets compute views too.
    def _in_backward(self) -> bool:
        return self.ctx is not None and self.ctx.phase == "backward"

    def pre_forward(self) -> None:
        self.unshard()
        self.use_compute_views()
        if self.ctx is not None and not self._in_backward():
            self.ctx.record_forward(self)
            self.ctx.prefetch_forward(self)

    def post_forward(self) -> None:
        if self._in_backward():
            return
        self.use_shard_views()
        if (self.full_shard and not self.is_root) or not torch.is_grad_enabled():
            self.reshard()

    def pre_backward(self) -> None:
        if self.ctx is not None:
            self.ctx.begin_backward()
        self.unshard()
        if not self._compute_views_set:
            self.use_compute_views()
        if self.ctx is not None:
            self.ctx.prefetch_backward(self, pre=True)

    def _post_backward(self, unsharded: torch.Tensor) -> None:
        """The unsharded flat's gradient is complete: start reducing it to this rank's shard, reshard."""
        ctx = self.ctx
        self._view_grad_bytes = 0  # joined into the flat gradient by now
        if ctx is not None:
            ctx.begin_backward()
            # The reduction left in flight by the previous unit has had this unit's backward to finish:
            # finish it now, so at most one full-size gradient is ever waiting for its reduce-scatter.
            ctx.settle_reductions(keep=0)
        self._sample_memory()
        self.use_shard_views()
        if ctx is not None and not ctx.sync_gradients:
            # no_sync: the full-size gradient stays on the unsharded flat and accumulates there.
            if self.full_shard:
                self.reshard()
            return
        if ctx is not None:
            ctx.prefetch_backward(self, pre=False)  # BACKWARD_POST: the next gather goes before this reduction
        grad, unsharded.grad = unsharded.grad, None
        in_flight = ctx is not None and ctx.overlap_reductions
        self.reduction = reduce.start(grad, self.groups, self.layout.shard_numel, self.precision.reduce,
                                      self._record, self.name, async_op=in_flight, tag=self.next_tag())
        del grad
        self.reshard()
        if in_flight:
            ctx.pending_reductions.append(self)  # finished at the next post-backward or the end of backward
        else:
            self.finish_reduction()

    def finish_reduction(self) -> None:
        """Wait for this unit's reduction (if one is in flight) and expose the result as ``.grad``."""
        if self.reduction is None:
            return
        pending, self.reduction = self.reduction, None
        self._expose_grads(reduce.finish(pending, self.groups, self.precision.grad, self._record, self.name))
        self._sample_memory()

    def finish_backward(self, synced: bool) -> None:
        """End of backward: put shard views back and reshard what is still gathered."""
        self._open_splits = 0
        self.use_shard_views()
        if synced or self.full_shard:
            self.reshard()

    def _expose_grads(self, reduced: torch.Tensor) -> None:
        """Make ``reduced`` this rank's gradient: after ``zero_grad()`` (set_to_none, PyTorch's default)
        it becomes the grad shard, each trainable shard view's ``.grad`` a slice of it; where a view still
        holds a gradient (``zero_grad(set_to_none=False)``, or no zero_grad at all) the new gradient is
        added to it in place, as ``torch.autograd`` accumulates, and ``reduced`` is dropped."""
        if self.offload:
            reduced = reduced.to(self.flat_shard.device)
        slices = self.layout.local_slices(self.groups.shard_rank)
        trainable = [(v, lo, hi) for v, (lo, hi) in zip(self.shard_views, slices) if v.requires_grad]
        if all(v.grad is None for v, _, _ in trainable):
            for view, lo, hi in trainable:
                _set_grad(view, reduced[lo:hi])
            return
        for view, lo, hi in trainable:
            if view.grad is None:
                _set_grad(view, reduced[lo:hi].clone())
            else:
                view.grad.add_(reduced[lo:hi])

    # ---- accounting ------------------------------------------------------------------------
    def _record(self, result: collectives.Collective, group: str) -> None:
        if self.ctx is not None:
            self.ctx.record(result, group, self.name)

    def next_tag(self) -> int:
        return self.ctx.next_tag() if self.ctx is not None else 0

    def _sample_memory(self) -> None:
        if self.ctx is not None:
            self.ctx.sample_memory()

    def memory_bytes(self) -> dict[str, int]:
        """Bytes this unit holds now, by category (see ``instrument.MemoryRecorder``)."""
        storages = {v.grad.untyped_storage().data_ptr(): v.grad.untyped_storage().nbytes() for v in self.shard_views if v.grad is not None}
        grads = sum(storages.values())
        gathered = 0 if self._aliased else self.unsharded.untyped_storage().nbytes()
        if self.unsharded.grad is not None:
            gathered += self.unsharded.grad.untyped_storage().nbytes()
        gathered += self._view_grad_bytes
        if self.reduction is not None:  # in flight: the full-size gradient and the shard it lands in
            full, out = self.reduction.nbytes()
            gathered += full
            grads += out
        return {
            "params": self.flat_shard.untyped_storage().nbytes(),
            "grads": grads,
            "optimizer": 0,
            "gathered": gathered,
        }

    def __repr__(self) -> str:
        return f"Unit({self.name}, T={self.layout.total}, S={self.layout.shard_numel}, {self.state.name})"


def _set_grad(view: torch.Tensor, grad: torch.Tensor) -> None:
    """``view.grad = grad``, also when ``grad`` is in another dtype (keep_low_precision_grads): autograd
    refuses that assignment, so a same-dtype placeholder that allocates nothing (a broadcast scalar) is
    assigned first and its ``.data`` swapped for ``grad``."""
    if grad.dtype == view.dtype:
        view.grad = grad
        return
    view.grad = torch.zeros((), dtype=view.dtype, device=view.device).expand(view.shape)
    view.grad.data = grad
