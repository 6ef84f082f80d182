"""The run context of one root: what spans units.

One ``RunContext`` per root, created lazily on the root's first use and handed to every unit under
it (never a global). It holds the phase (for the recorders), whether this backward synchronises
gradients (``no_sync``), the recorded forward execution order, the end-of-backward callback, and
the attached recorders.
"""
from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch.autograd import Variable

from flatshard.api import BackwardPrefetch
from flatshard.collectives import Collective
from flatshard.instrument import CommEvent, CommRecorder, MemoryRecorder

if TYPE_CHECKING:
    from flatshard.unit import Unit

logger = logging.getLogger("flatshard")


class RunContext:
    def __init__(self, units: list["Unit"], root: "Unit"):
        self.units = units  # every unit under the root, root first, in module order
        self.root = root
        self.phase = "other"
        self.sync_gradients = True
        self.forward_order: list["Unit"] = []  # units in the order their forward ran in the last pass
        self._order_this_pass: list["Unit"] = []
        self._end_of_backward_queued = False
        self.comm_recorders: list[CommRecorder] = []
        self.memory_recorders: list[MemoryRecorder] = []
        self.backward_prefetch: Optional[BackwardPrefetch] = None
        self.forward_prefetch = False
        self.limit_all_gathers = True
        self.overlap_reductions = False  # leave each reduction in flight while the next unit computes
        self.pending_reductions: list["Unit"] = []
        self._order_changed_warned = False
        self._exchanges = 0  # tags for point-to-point exchanges (collectives.py), the same sequence on every rank

    def configure(self, backward_prefetch: Optional[BackwardPrefetch], forward_prefetch: bool, limit_all_gathers: bool,
                  device: torch.device) -> None:
        self.backward_prefetch = backward_prefetch
        self.forward_prefetch = forward_prefetch
        self.limit_all_gathers = limit_all_gathers
        # [Note: reductions in flight]
        # On an accelerator a reduction left in flight overlaps the next unit's backward at the cost of
        # one full-size gradient held a little longer. On CPU (gloo) the collective's threads share the
        # cores with compute, so nothing is hidden (docs/bench.md: every overlap setting within noise)
        # while the memory is still paid: there each reduction finishes before the next unit computes.
        self.overlap_reductions = backward_prefetch is not None and device.type != "cpu"

    # ---- phases -------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase_scope(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def begin_forward(self) -> None:
        self.phase = "forward"
        self._order_this_pass = []

    def end_forward(self) -> None:
        self.phase = "optimizer"
        if self._order_this_pass:
            if self._order_this_pass != self.forward_order:
                self._order_changed_warned = False
            self.forward_order = self._order_this_pass
        for unit in self.units:  # a forward prefetch the pass did not use: free it now
            if unit.full_shard and not unit.is_root and unit.gathered and unit not in self._order_this_pass:
                unit.reshard()

    def record_forward(self, unit: "Unit") -> None:
        self._order_this_pass.append(unit)

    def begin_backward(self) -> None:
        """Called from the first pre-backward (or post-backward) hook of a backward pass."""
        if self._end_of_backward_queued:
            return
        self._end_of_backward_queued = True
        self.phase = "backward"
        Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        """Runs once, when the autograd engine finishes the backward pass."""
        try:
            pending, self.pending_reductions = self.pending_reductions, []
            for unit in pending:  # in the order issued: the same on every rank
                unit.finish_reduction()
            for unit in self.units:
                unit.finish_backward(self.sync_gradients)
            self.sample_memory()
        finally:
            self._end_of_backward_queued = False
            self.phase = "optimizer"

    # ---- prefetch: the schedule that spans units ------------------------------------------
    # [Note: prefetch]
    # Forward prefetch gathers the unit that ran after this one in the last recorded forward, if this
    # pass has followed that order so far; otherwise the order has changed and nothing is prefetched
    # (logged once) until the end of this pass records the new order. Backward prefetch gathers the
    # unit that ran before this one in this pass's forward: in pre-backward (BACKWARD_PRE, before this
    # unit's gradients are computed) or in post-backward before this unit's reduce-scatter
    # (BACKWARD_POST). The root unit is never prefetched: it stays gathered. With limit_all_gathers,
    # no prefetch is issued while two units (besides the root) are already gathered.
    def prefetch_forward(self, unit: "Unit") -> None:
        if not self.forward_prefetch or not self.forward_order:
            return
        k = len(self._order_this_pass)
        if self._order_this_pass != self.forward_order[:k]:
            if not self._order_changed_warned:
                logger.warning("flatshard: the forward order of units changed; forward prefetch is off until "
                               "this pass has recorded the new order")
                self._order_changed_warned = True
            return
        if k < len(self.forward_order):
            self._prefetch(self.forward_order[k])

    def prefetch_backward(self, unit: "Unit", *, pre: bool) -> None:
        wanted = BackwardPrefetch.BACKWARD_PRE if pre else BackwardPrefetch.BACKWARD_POST
        if self.backward_prefetch is not wanted or unit not in self.forward_order:
            return
        k = len(self.forward_order) - 1 - self.forward_order[::-1].index(unit)
        if k > 0:
            self._prefetch(self.forward_order[k - 1])

    def _prefetch(self, target: "Unit") -> None:
        if target.is_root or target.gathered:
            return
        if self.limit_all_gathers and sum(u.gathered and not u.is_root for u in self.units) >= 2:
            return
        target.unshard(wait=False)

    def settle_reductions(self, keep: int) -> None:
        """Finish all but the ``keep`` newest reductions in flight, oldest first (same order on every rank).

        A reduction is left in flight for one unit's backward compute; the next post-backward finishes
        it (by then it is done, so the wait is short) and frees its full-size gradient. (gloo's
        ``Work.is_completed()`` does not report completion before ``wait()``, so polling cannot work.)"""
        while len(self.pending_reductions) > keep:
            self.pending_reductions.pop(0).finish_reduction()

    def next_tag(self) -> int:
        self._exchanges = (self._exchanges + 1) % (1 << 20)
        return self._exchanges

    # ---- recorders ----------------------------------------------------------------------
    def record(self, result: Collective, group: str, unit: str) -> None:
        if not self.comm_recorders:
            return
        event = CommEvent(result.kind, group, result.group_size, self.phase, unit, result.tensor_bytes, result.wire_bytes)
        for recorder in self.comm_recorders:
            recorder.record(event)

    def sample_memory(self) -> None:
        for recorder in self.memory_recorders:
            recorder.sample()

