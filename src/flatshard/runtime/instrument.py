"""Communication and memory recorders: where the bytes go, per rank.

``CommRecorder`` counts every collective flatshard issues, by kind, group and phase
(forward / backward / optimizer / other), with the tensor bytes and the per-rank ring bytes.
``MemoryRecorder`` follows the bytes of the tensors flatshard manages (flat shards, gradient
shards, unsharded flats and their full-size gradients, optimizer state) and keeps their peak; it
samples at every unit transition, which is exactly when those bytes change. Inside
``recorder.tracking_activations()`` it also counts *activations*: every tensor that an operator
creates while the block runs (saved for backward, recomputed by activation checkpointing,
temporaries) and that is still alive, less what the other categories count.

[Note: bounded recorders]
A recorder may stay open for a whole training run, so by default it keeps aggregates only: a
CommRecorder keeps one row of totals per (phase, kind, group), a MemoryRecorder its current and peak
bytes per category; their size does not grow with the number of steps. The per-collective event list
(``CommRecorder.events``: one record per collective, e.g. to see which unit a collective served) and
the memory timeline (``MemoryRecorder.timeline``: one sample per unit transition, for plotting one
step) grow with every step, so each is opt-in: ``record_comms(events=True)``,
``record_memory(timeline=True)``. Reading one that was not asked for is an error that says how to
ask for it, never an empty list that reads as "nothing happened".
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def label(what: str, unit: Optional[str] = None) -> torch.profiler.record_function:
    """The profiler range of one hook or entry point, named ``flatshard::<what> (<unit>)`` as FSDP2 labels
    ``FSDP::pre_forward (layers.3)``: hooks.py's hooks, and the public entry points that communicate
    (clip_grad_norm_, summon_full_params, state dicts, checkpoints) under the entry point's name."""
    return torch.profiler.record_function(f"flatshard::{what}" + (f" ({unit})" if unit is not None else ""))


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
    """Totals of the collectives recorded, by phase, kind and group ([Note: bounded recorders]).

    ``count``, ``wire_bytes``, ``tensor_bytes`` and ``summary`` read the totals; with ``events=True``
    every collective is also kept, in order, in ``events``."""

    def __init__(self, events: bool = False) -> None:
        self.keeps_events = bool(events)
        self._events: list[CommEvent] = []
        self._totals: dict[tuple[str, str, str], list] = {}  # (phase, kind, group) -> [count, tensor, wire]

    @property
    def events(self) -> list[CommEvent]:
        """Every collective recorded, in order (only with ``record_comms(events=True)``)."""
        if not self.keeps_events:
            raise RuntimeError(
                "this recorder keeps totals only (count, wire_bytes, tensor_bytes, summary); "
                "open it with record_comms(events=True) to keep every collective in .events"
            )
        return self._events

    def record(self, event: CommEvent) -> None:
        row = self._totals.setdefault((event.phase, event.kind, event.group), [0, 0, 0.0])
        row[0] += 1
        row[1] += event.tensor_bytes
        row[2] += event.wire_bytes
        if self.keeps_events:
            self._events.append(event)

    def reset(self) -> None:
        self._events.clear()
        self._totals.clear()

    def _select(self, kind, phase, group) -> Iterable[list]:
        return (
            row
            for (p, k, g), row in self._totals.items()
            if (kind is None or k == kind) and (phase is None or p == phase) and (group is None or g == group)
        )

    def count(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(row[0] for row in self._select(kind, phase, group))

    def wire_bytes(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> float:
        return sum(row[2] for row in self._select(kind, phase, group))

    def tensor_bytes(self, kind: Optional[str] = None, phase: Optional[str] = None, group: Optional[str] = None) -> int:
        return sum(row[1] for row in self._select(kind, phase, group))

    def summary(self) -> dict:
        """{"phase/kind/group": {"count", "tensor_bytes", "wire_bytes"}} as a plain dict."""
        return {
            f"{p}/{k}/{g}": {"count": n, "tensor_bytes": t, "wire_bytes": w}
            for (p, k, g), (n, t, w) in self._totals.items()
        }


CATEGORIES = ("params", "grads", "optimizer", "gathered")
ACTIVATIONS = "activations"


class MemoryRecorder:
    """Live and peak bytes by category of what flatshard manages on this rank.

    * params       flat shards (and parameters flatshard does not manage, e.g. ignored modules)
    * grads        gradient shards exposed as ``.grad`` (and unmanaged parameters' grads)
    * optimizer    tensors in the optimizer's state (when an optimizer is attached)
    * gathered     unsharded flats with storage, plus their full-size gradients before reduction
    * activations  only inside ``tracking_activations()``: tensors that operators created while tracking,
                   still alive and not held in the categories above: saved activations, recomputed
                   ones, temporaries, and a unit's full-size gradient from the moment autograd makes
                   it until the unit claims it (then it counts as gathered). Its peak is exact (taken
                   after every operator); the other categories' peaks are taken at samples

    With ``timeline=True`` (``record_memory(timeline=True)``), ``timeline`` holds
    ``(seconds, {category: bytes})`` for every sample, for plotting one step; by default no sample is
    kept ([Note: bounded recorders]).
    """

    def __init__(
        self, units, optimizer: Optional[torch.optim.Optimizer] = None, extra_params=(), *, timeline: bool = False
    ):
        self._units = list(units)
        self.optimizer = optimizer
        self._extra = list(extra_params)
        self.categories: tuple[str, ...] = CATEGORIES
        self.peak: dict[str, int] = dict.fromkeys(CATEGORIES, 0)
        self.peak_total = 0
        self.keeps_timeline = bool(timeline)
        self._timeline: list[tuple[float, dict[str, int]]] = []
        self._t0 = time.perf_counter()
        self._tracker: Optional[LiveTensors] = None

    def current(self) -> dict[str, int]:
        now = dict.fromkeys(self.categories, 0)
        for unit in self._units:
            for category, nbytes in unit.memory_bytes().items():
                now[category] += nbytes
        for p in self._extra:
            now["params"] += p.numel() * p.element_size()
            if p.grad is not None:
                now["grads"] += p.grad.numel() * p.grad.element_size()
        if self.optimizer is not None:
            now["optimizer"] = optimizer_state_bytes(self.optimizer)
        if self._tracker is not None:
            now[ACTIVATIONS] = self._tracker.unmanaged_bytes(self._managed_storages())
        return now

    def sample(self) -> dict[str, int]:
        now = self.current()
        for c in self.categories:
            self.peak[c] = max(self.peak[c], now[c])
        if self._tracker is not None:
            self.peak[ACTIVATIONS] = max(self.peak[ACTIVATIONS], self._tracker.peak)
        self.peak_total = max(self.peak_total, sum(now.values()))
        if self.keeps_timeline:
            self._timeline.append((time.perf_counter() - self._t0, now))
        return now

    @property
    def timeline(self) -> list[tuple[float, dict[str, int]]]:
        """``(seconds, {category: bytes})`` per sample (only with ``record_memory(timeline=True)``)."""
        if not self.keeps_timeline:
            raise RuntimeError(
                "this recorder keeps the current and peak bytes only (current(), peak, peak_total); "
                "open it with record_memory(optimizer, timeline=True) to keep every sample in .timeline"
            )
        return self._timeline

    def reset_peak(self) -> None:
        self.peak = dict.fromkeys(self.categories, 0)
        self.peak_total = 0
        if self._tracker is not None:
            self._tracker.peak = 0
        self.sample()

    def reset_timeline(self) -> None:
        """Forget the samples so far; times count from now."""
        self.timeline.clear()  # (raises, saying what to pass, on a recorder without a timeline)
        self._t0 = time.perf_counter()

    @contextlib.contextmanager
    def tracking_activations(self) -> Iterator[MemoryRecorder]:
        """Count activations (see the class) while the block runs, on this thread; adds the category.
        Every operator passes through a Python hook meanwhile: a few microseconds each."""
        if self._tracker is not None:
            raise RuntimeError("tracking_activations() is already active on this recorder")
        self.categories = (*CATEGORIES, ACTIVATIONS)
        self.peak.setdefault(ACTIVATIONS, 0)
        tracker = LiveTensors()
        self._tracker = tracker
        try:
            with tracker:
                self.sample()
                yield self
                self.sample()
        finally:
            self._tracker = None
            self.categories = CATEGORIES

    def _managed_storages(self) -> set[int]:
        """data_ptr of every storage counted in the other categories."""
        tensors: list[torch.Tensor] = []
        for unit in self._units:
            tensors += unit.managed_tensors()
        for p in self._extra:
            tensors += [p] + ([p.grad] if p.grad is not None else [])
        if self.optimizer is not None:
            tensors += [v for state in self.optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
        return {t.untyped_storage().data_ptr() for t in tensors}


class LiveTensors(TorchDispatchMode):
    """Bytes of the storages that operators create while the mode is active and that are still alive.

    A storage stops counting when Python frees it (a finaliser) or once it is found to be managed (a
    parameter, gradient or optimizer state, counted elsewhere). ``peak`` is the largest unmanaged
    total seen after any operator."""

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, tuple[weakref.ref, int]] = {}  # id(storage) -> (storage, bytes)
        self._managed: set[int] = set()  # ids of live storages found managed
        self.now = 0  # unmanaged live bytes
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # in-place and out= operators and views return storages that existed before: not new
        inputs = {id(t.untyped_storage()) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = id(storage)
                if key not in self._live and key not in inputs:
                    self._live[key] = (weakref.ref(storage), storage.nbytes())
                    self.now += storage.nbytes()
                    weakref.finalize(storage, self._freed, key)
        self.peak = max(self.peak, self.now)
        return out

    def _freed(self, key: int) -> None:
        _, nbytes = self._live.pop(key)
        if key in self._managed:
            self._managed.discard(key)
        else:
            self.now -= nbytes

    def unmanaged_bytes(self, managed_ptrs: set[int]) -> int:
        for key, (ref, nbytes) in list(self._live.items()):
            storage = ref()
            if key not in self._managed and storage is not None and storage.data_ptr() in managed_ptrs:
                self._managed.add(key)
                self.now -= nbytes
        return self.now


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    seen, total = set(), 0
    for state in optimizer.state.values():
        for value in state.values():
            if not torch.is_tensor(value):
                continue
            storage = getattr(value, "_local_tensor", value).untyped_storage()  # a DTensor's: its local tensor's
            if storage.data_ptr() not in seen:
                seen.add(storage.data_ptr())
                total += storage.nbytes()
    return total
