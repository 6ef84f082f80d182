"""The recorders attached to a root's run context, for both front ends' ``record_comms``,
``record_memory`` and ``memory_bytes`` ([Note: bounded recorders], instrument.py)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch

from flatshard.runtime.instrument import CommRecorder, MemoryRecorder
from flatshard.runtime.schedule import RunContext


@contextlib.contextmanager
def record_comms(ctx: RunContext, *, events: bool = False) -> Iterator[CommRecorder]:
    recorder = CommRecorder(events=events)
    ctx.comm_recorders.append(recorder)
    try:
        yield recorder
    finally:
        ctx.comm_recorders.remove(recorder)


@contextlib.contextmanager
def record_memory(
    ctx: RunContext, optimizer: Optional[torch.optim.Optimizer], extra_params: list, *, timeline: bool = False
) -> Iterator[MemoryRecorder]:
    recorder = MemoryRecorder(ctx.units, optimizer, extra_params=extra_params, timeline=timeline)
    recorder.sample()
    ctx.memory_recorders.append(recorder)
    try:
        yield recorder
    finally:
        ctx.memory_recorders.remove(recorder)


def memory_bytes(ctx: RunContext, optimizer: Optional[torch.optim.Optimizer], extra_params: list) -> dict[str, int]:
    return MemoryRecorder(ctx.units, optimizer, extra_params=extra_params).current()
