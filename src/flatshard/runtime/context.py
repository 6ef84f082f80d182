"""What a unit and its parts know of the run: the ``Context`` protocol and a unit's ``Link`` to it.

A unit's parts (its flat groups, their gathers, the parameters that gather themselves) communicate on
the unit's behalf: they tag their exchanges, check the order of their collectives across ranks, record
them, name them in errors and profiler ranges, and use the device's streams. All of that comes from
the run context of the unit's root (schedule.py's ``RunContext``, which implements ``Context``), and a
root adopts units built earlier (manual nesting), so the context, the unit's name and its index change
after the parts are built. Each part therefore holds the unit's ``Link``, one small object shared by
the unit and its parts, never the unit itself: a part needs nothing else of the unit, and nothing here
imports unit.py or schedule.py.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Protocol

import torch

from flatshard.api import MixedPrecision, ShardingStrategy
from flatshard.runtime import consistency
from flatshard.runtime.comm.collectives import CollectiveResult
from flatshard.runtime.comm.streams import Streams
from flatshard.runtime.consistency import Checker, Phase


class Context(Protocol):
    """The run context of a root, as a unit and its parts use it (schedule.py: ``RunContext``)."""

    phase: Phase
    sync_gradients: bool  # False inside no_sync(): no unit reduces this backward
    checker: Checker  # [Note: order checks] (consistency.py)

    @property
    def streams(self) -> Streams: ...

    @property
    def in_backward(self) -> bool: ...

    def next_tag(self, index: int) -> int: ...

    def record(self, result: CollectiveResult, group: str, unit: str, phase: Optional[Phase] = None) -> None: ...

    def sample_memory(self) -> None: ...

    def start(self) -> None: ...

    def recover(self, force: bool = False) -> bool: ...


@dataclass
class UnitSettings:
    """What a unit's wrap call asked for, and what fully_shard's ``set_*`` methods change later (the
    FSDP1 wrapper keeps its call's values); one object shared by the unit and its parts, so a change
    reaches every flat group."""

    strategy: ShardingStrategy  # what the wrap call asked for (checkpoint manifests)
    reshard_after_forward: bool = True  # free after forward, gather again in backward (the root never)
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True  # False: gradients accumulate unreduced (set_requires_gradient_sync)
    # False (HSDP): reduce-scatter, but keep the shard group's sum for the next all-reduce across replicas
    # (set_requires_all_reduce; [Note: an open accumulation window], grad_state.py)
    requires_all_reduce: bool = True
    unsynced_in_reduce_dtype: bool = False  # fully_shard: that accumulation kept in the reduce dtype, as FSDP2
    gradient_divide_factor: Optional[float] = None  # None: divide by the data-parallel size
    force_sum_reduction_for_comms: bool = (
        False  # set_force_sum_reduction_for_comms (reduce.py: ReduceSpec.hook_sees_sum)
    )
    all_reduce_hook: Optional[Callable[[torch.Tensor], None]] = None  # set_all_reduce_hook: on the reduced shard
    # set_custom_all_gather / set_custom_reduce_scatter: FSDP2's AllGather / ReduceScatter objects, which
    # allocate the buffers of the shard group's collective and issue it ([Note: custom collectives], reduce.py)
    custom_all_gather: Optional[Any] = None
    custom_reduce_scatter: Optional[Any] = None
    # set_reduce_scatter_unused_params: a trainable group that got no gradient reduces zeros ([Note: unused
    # parameters in a reduction], hooks.py)
    reduce_scatter_unused_params: bool = False
    reduce_scatter_max_input_buffers: int = 1  # reductions left in flight at most, where any are (schedule.py)
    forward_prefetch: list[Any] = field(default_factory=list)  # explicit targets (units), else the schedule's
    backward_prefetch: list[Any] = field(default_factory=list)
    mixed_precision: Optional[MixedPrecision] = None  # the policy the groups' precision was resolved from


@dataclass(eq=False)
class Link:
    """One unit as its parts see it: its name, its root's run context and its index there (the order
    checks and exchange tags name units by index), and whether it is that root. Set when a run context
    adopts the unit (``bind``)."""

    name: str
    ctx: Optional[Context] = None
    index: int = 0
    is_root: bool = True

    def bind(self, ctx: Context, index: int, is_root: bool) -> None:
        self.ctx, self.index, self.is_root = ctx, index, is_root

    @property
    def run(self) -> Context:
        """The run context (every built unit has one: build.py binds it before the unit is used)."""
        assert self.ctx is not None, f"unit {self.name!r} is not bound to a run context"
        return self.ctx

    def next_tag(self) -> int:
        """The tag of this unit's next point-to-point exchange ([Note: exchange tags], comm/gloo_exchange.py)."""
        return self.run.next_tag(self.index)

    def check(self, what: int, part: int = 0, always: bool = False) -> None:
        """This rank's part of the order check before a gather or a reduction of the unit's flat group
        ``part`` ([Note: order checks]); ``always``: in every step."""
        self.run.checker.check(what, self.index, self.run.phase, part, always)

    def record(self, result: CollectiveResult, group: str) -> None:
        self.run.record(result, group, self.name)

    def errors(self, collective: str) -> contextlib.AbstractContextManager[None]:
        """A failing collective of this unit raises naming the rank, the unit, the phase and the collective."""
        return consistency.collective_errors(self.name, str(self.run.phase), collective)
