"""The run context of one root: what spans units.

One ``RunContext`` per root, created lazily on the root's first use and handed to every unit under
it (never a global). It holds the phase (for the recorders), whether this backward synchronises
gradients (``no_sync``), the recorded forward execution order, the end-of-backward callback, and
the attached recorders.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, Optional

import torch
from torch.autograd import Variable

from flatshard.collectives import Collective
from flatshard.instrument import CommEvent, CommRecorder, MemoryRecorder

if TYPE_CHECKING:
    from flatshard.unit import Unit


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
            self.forward_order = self._order_this_pass

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
            for unit in self.units:
                unit.finish_backward(self.sync_gradients)
            self.sample_memory()
        finally:
            self._end_of_backward_queued = False
            self.phase = "optimizer"

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


def current_phase(ctx: Optional[RunContext]) -> str:
    return ctx.phase if ctx is not None else "other"


def is_grad_needed() -> bool:
    return torch.is_grad_enabled()
