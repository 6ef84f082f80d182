"""Communication and memory recorders: where the bytes go, per rank.

``CommRecorder`` counts every collective flatshard issues, by kind, group and phase
(forward / backward / optimizer / other), with the tensor bytes and the per-rank ring bytes.
``MemoryRecorder`` follows the bytes of the tensors flatshard manages (flat shards, gradient
shards, unsharded flats and their full-size gradients, optimizer state) and keeps their peak; it
samples at every unit transition, which is exactly when those bytes change.
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Iterable, Optional

import torch


@dataclass(frozen=True)
class CommEvent:
    kind: str
    group: str  # "shard" | "replicate" | "world"
    group_size: int
    phase: str  # "forward" | "backward" | "optimizer" | "other"
    unit: str
    tensor_bytes: int
    wire_bytes: float


class CommRecorder:
    def __init__(self) -> None:
        self.events: list[CommEvent] = []

    def record(self, event: CommEvent) -> None:
        self.events.append(event)

    def reset(self) -> None:
        self.events.clear()

    def _select(self, kind, phase, group) -> Iterable[CommEvent]:
        return (
            e
            for e in self.events
            if (kind is None or e.kind == kind) and (phase is None or e.phase == phase) and (group is None or e.group == group)
        )

    def count(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(1 for _ in self._select(kind, phase, group))

    def wire_bytes(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> float:
        return sum(e.wire_bytes for e in self._select(kind, phase, group))

    def tensor_bytes(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(e.tensor_bytes for e in self._select(kind, phase, group))

    def summary(self) -> dict:
        """{(phase, kind, group): {"count", "tensor_bytes", "wire_bytes"}} as a nested plain dict."""
        out: dict = defaultdict(lambda: {"count": 0, "tensor_bytes": 0, "wire_bytes": 0.0})
        for e in self.events:
            row = out[f"{e.phase}/{e.kind}/{e.group}"]
            row["count"] += 1
            row["tensor_bytes"] += e.tensor_bytes
            row["wire_bytes"] += e.wire_bytes
        return dict(out)


CATEGORIES = ("params", "grads", "optimizer", "gathered")


class MemoryRecorder:
    """Live and peak bytes by category of what flatshard manages on this rank.

    * params     flat shards (and parameters flatshard does not manage, e.g. ignored modules)
    * grads      gradient shards exposed as ``.grad`` (and unmanaged parameters' grads)
    * optimizer  tensors in the optimizer's state (when an optimizer is attached)
    * gathered   unsharded flats with storage, plus their full-size gradients before reduction
    """

    def __init__(self, units, optimizer: Optional[torch.optim.Optimizer] = None, extra_params=()):
        self._units = list(units)
        self.optimizer = optimizer
        self._extra = list(extra_params)
        self.peak: dict[str, int] = {c: 0 for c in CATEGORIES}
        self.peak_total = 0

    def current(self) -> dict[str, int]:
        now = {c: 0 for c in CATEGORIES}
        for unit in self._units:
            for category, nbytes in unit.memory_bytes().items():
                now[category] += nbytes
        for p in self._extra:
            now["params"] += p.numel() * p.element_size()
            if p.grad is not None:
                now["grads"] += p.grad.numel() * p.grad.element_size()
        if self.optimizer is not None:
            now["optimizer"] = optimizer_state_bytes(self.optimizer)
        return now

    def sample(self) -> dict[str, int]:
        now = self.current()
        for c in CATEGORIES:
            self.peak[c] = max(self.peak[c], now[c])
        self.peak_total = max(self.peak_total, sum(now.values()))
        return now

    def reset_peak(self) -> None:
        self.peak = {c: 0 for c in CATEGORIES}
        self.peak_total = 0
        self.sample()


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if torch.is_tensor(value) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total
