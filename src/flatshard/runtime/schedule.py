"""The run context of one root: what spans units.

Every unit has a ``RunContext`` from the moment it is built (never a global): the units one
constructor call builds share one, and a later call that wraps them (manual nesting) hands its own
to every unit under it (build/units.py, ``become_root``). A context binds its units' links
(context.py) when it is made; units see it through the ``Context`` protocol, the layers above as
``run_context(unit)``. It holds the phase (for the recorders), whether
this backward synchronises gradients (``no_sync``), the recorded forward execution order, the
prefetch schedule and rate limiter, the reductions in flight, and the attached recorders. The hooks
that drive it live in hooks.py.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Protocol, cast

import torch
from torch import nn
from torch.distributed import ReduceOp

from flatshard.api import BackwardPrefetch
from flatshard.runtime import precision
from flatshard.runtime.comm import agree, collectives
from flatshard.runtime.comm.collectives import CollectiveResult
from flatshard.runtime.comm.streams import Lane, Streams
from flatshard.runtime.comm.streams import for_device as streams_for
from flatshard.runtime.consistency import END_BACKWARD, END_FORWARD, Checker, Phase, exchange_tag
from flatshard.runtime.instrument import CommEvent, CommRecorder

if TYPE_CHECKING:
    from flatshard.runtime.flat_group import FlatGroup
    from flatshard.runtime.unit import Unit

logger = logging.getLogger("flatshard")


@dataclass(frozen=True)
class ScheduleConfig:
    """How a root schedules its units' collectives (FSDP's prefetch keywords)."""

    backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    # [Note: reductions in flight]
    # On an accelerator a reduction left in flight overlaps the next unit's backward at the cost of
    # one full-size gradient held a little longer. On CPU (gloo) the collective's threads share the
    # cores with compute, so nothing is hidden while the memory is still paid: there each reduction
    # finishes before the next unit computes (build/units.py, ``schedule_config``).
    # Across nodes it is the link, not the cores, that a collective waits on (docs/multi_node.md
    # measures it), so ``inter_node_in_flight`` leaves what crosses in flight, on CPU too:
    # * the all-reduce across replicas (hybrid, NO_SHARD) when its replicate group spans nodes: issued
    #   as soon as the shard group's reduce-scatter is done and finished at the end of backward, every
    #   unit's in the order issued (the same on every rank). It costs no memory: the shard it reduces
    #   is the gradient shard the optimizer reads.
    # * the reduce-scatter of a shard group that spans nodes (FULL_SHARD across nodes): every round
    #   posted at once and finished at the next post-backward, as on an accelerator: memory allows one
    #   full-size gradient in flight, not more.
    # Where nothing crosses a node the setting changes nothing, so on by default is right in every case:
    # one node keeps the CPU rule above; several nodes measured faster with it (docs/multi_node.md).
    # Which ranks share a node: comm/nodes.py, ``Nodes``. The results are the same bits either way.
    overlap_reductions: bool = False
    inter_node_in_flight: bool = True


class Sampler(Protocol):
    """What the run context calls at every unit transition: instrument.py's ``MemoryRecorder``, or any
    object with its ``sample`` (flatshard.testing's ``on_transition``); what it returns is dropped."""

    def sample(self) -> object: ...


def run_context(unit: Unit) -> RunContext:
    """The run context ``unit`` is bound to, as this module's class (units see it as ``context.Context``)."""
    return cast(RunContext, unit.ctx)


class RunContext:
    def __init__(self, units: list[Unit], root: Unit, config: ScheduleConfig):
        """``units``: every unit under ``root``, root first, in module order; each is bound to this context."""
        self.units = units
        self.root = root
        self.config = config
        self.phase = Phase.IDLE
        self.sync_gradients = True
        self.forward_order: list[Unit] = []  # units in the order their forward ran in the last pass
        self.order_this_pass: list[Unit] = []
        self.end_of_backward_queued = False
        self.raised = False  # a forward raised ([Note: a step that raised])
        self.comm_recorders: list[CommRecorder] = []
        self.memory_recorders: list[Sampler] = []
        self.pending_reductions: list[FlatGroup] = []  # reduce-scatters in flight, finished at the next post-backward
        self.cross_node_reductions: list[FlatGroup] = []  # all-reduces across nodes, finished at the end of backward
        self.buffer_cast: Optional[tuple[nn.Module, torch.dtype]] = None  # MixedPrecision.buffer_dtype
        self.started = False
        # [Note: order checks] (consistency.py)
        group = root.flat_groups[0].groups.process_group if root.flat_groups else None
        self.checker = Checker([u.name for u in units], group, lambda r: self.record(r, "world", "<order check>"))
        self.checker.parts = [[g.describe() for g in u.flat_groups] for u in units]
        self.passes = 0  # forward passes the root has begun
        self.backward_since_forward = False  # [Note: a forward with no backward after it]
        self._order_changed_warned = False
        self._exchanges = 0  # tags for point-to-point exchanges ([Note: exchange tags], comm/gloo_exchange.py)
        self._streams: Optional[Streams] = None
        for index, unit in enumerate(units):
            unit.link.bind(self, index, unit is root)

    @property
    def streams(self) -> Streams:
        """The device's streams ([Note: stream discipline], comm/streams.py), made at first use."""
        if self._streams is None:
            self._streams = streams_for(self.root.flat_groups[0].compute_device)
        return self._streams

    @streams.setter
    def streams(self, value: Streams) -> None:
        self._streams = value

    def start(self) -> None:
        """First use (a forward, summon, clip, a recorder): cast the buffers to the root's buffer dtype."""
        if self.started:
            return
        self.started = True
        if self.buffer_cast is not None:
            precision.cast_buffers(*self.buffer_cast)
            self.buffer_cast = None

    @property
    def in_backward(self) -> bool:
        return self.phase is Phase.BACKWARD

    # ---- phases -------------------------------------------------------------------------
    @contextlib.contextmanager
    def phase_scope(self, phase: Phase) -> Iterator[None]:
        """An entry point between steps (summon, state dicts, checkpoints): ends a step that raised first."""
        self.recover()
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def begin_forward(self) -> None:
        self.recover()
        if torch._C._current_graph_task_id() == -1:  # not a recomputation inside backward
            for unit in self.units:  # the loop cleared gradients since the last backward: [Note: an open
                unit.drop_cleared()  # accumulation window] (grad_state.py)
            if self.passes >= 1 and not self.backward_since_forward:
                self.reshard_kept()
        self.backward_since_forward = False
        if self.passes >= 1:  # a second forward: the first step (checked) is over, with or without a backward
            self.checker.first_step = False
        self.passes += 1
        self.phase = Phase.FORWARD
        self.order_this_pass = []
        for unit in self.units:  # the optimizer (or the user) wrote the flat shards on compute since
            for group in unit.flat_groups:
                self.streams.use(Lane.COMPUTE, group.flat_shard, "write", f"{unit.name} flat shard")
        self.sync_pieces()

    def sync_pieces(self) -> None:
        """Pieces that changed travel while the first units compute ([Note: optimizer state across
        replicas], across_replicas.py): every unit after a synchronised backward; otherwise those whose piece
        changed on any rank, agreed by one all-reduce of a flag per unit."""
        groups = [
            (g, g.pieces)
            for u in self.units
            for g in u.flat_groups
            if g.pieces is not None and g.pieces.pending is None
        ]
        unsure = [(g, pieces) for g, pieces in groups if not pieces.dirty]
        changed = set()
        if unsure:
            group = self.root.flat_groups[0].groups.process_group
            flags = [pieces.changed(g.flat_shard) for g, pieces in unsure]
            agreed = torch.tensor(flags, dtype=torch.int32, device=agree.collective_device(group))
            self.record(collectives.all_reduce(agreed, group, op=ReduceOp.MAX), "world", "<pieces changed>")
            changed = {id(g) for (g, _), flag in zip(unsure, agreed.tolist()) if flag}
        for g, _ in groups:
            g.start_piece_sync(changed=id(g) in changed)

    def end_forward(self, completed: bool = True) -> None:
        """The root's forward returned (``completed``) or raised: record the order, free unused prefetches."""
        if completed:
            self.checker.check(END_FORWARD, -1, self.phase)
        else:
            self.raised = True
        self.phase = Phase.IDLE
        if self.order_this_pass:
            if self.order_this_pass != self.forward_order:
                self._order_changed_warned = False
            self.forward_order = self.order_this_pass
        for unit in self.units:  # a forward prefetch the pass did not use: free it now
            kept = not unit.settings.reshard_after_forward or unit.is_root or unit in self.order_this_pass
            if not kept and unit.gathered:
                unit.reshard()
        if not completed:  # the root too, and what the step held, at once ([Note: a step that raised])
            self.recover()

    def record_forward(self, unit: Unit) -> None:
        self.order_this_pass.append(unit)

    def begin_backward(self) -> bool:
        """The first pre-backward (or post-backward) hook of a backward pass: True if this call began it."""
        self.backward_since_forward = True
        if self.end_of_backward_queued:
            return False
        self.end_of_backward_queued = True
        self.phase = Phase.BACKWARD
        return True

    def end_of_backward(self) -> None:
        """Runs once, when the autograd engine finishes the backward pass (hooks.py queues it)."""
        try:
            unchecked = any(  # [Note: order checks of units on several meshes] (consistency.py)
                any(g.several_meshes for g in u.flat_groups[:1]) and not u.settings.reduce_scatter_unused_params
                for u in self.units
            )
            self.checker.check(END_BACKWARD, -1, self.phase, always=unchecked)
            pending, self.pending_reductions = self.pending_reductions, []
            for group in pending:  # in the order issued: the same on every rank
                self.settle(group)
            crossing, self.cross_node_reductions = self.cross_node_reductions, []
            for group in crossing:
                group.finish_reduction()
            for unit in self.units:
                unit.end_backward()
            self.sample_memory()
            self.checker.first_step = False
        finally:
            self.end_of_backward_queued = False
            self.phase = Phase.OPTIMIZER

    # ---- a step that raised ------------------------------------------------------------------
    # [Note: a step that raised]
    # A loop may catch an exception from forward or backward and go on: an out-of-memory guard, a NaN
    # guard, a bad sample. A forward that raises still runs every unit's post-forward (the FSDP1 wrapper's
    # ``finally``; fully_shard's forward hook is registered with ``always_call``), so its units reshard at
    # once. A backward that raises leaves the step as it was: autograd drops the end-of-backward callback
    # it had queued, so units stay gathered, reductions stay in flight and, without this, the next
    # backward would queue no callback at all (its gradients never exposed). ``recover`` ends such a step:
    # when the root's next forward begins, before clip_grad_norm_, summon_full_params, state dicts and
    # checkpoints, and at once on fully_shard's ``reset_iter_state()``. It waits for every collective in
    # flight, each rank in the same order (the order issued, then unit order), and discards the gradients
    # the step had not yet put on ``.grad``: reductions in flight, and what accumulated unreduced under
    # no_sync / set_requires_gradient_sync(False) -- the accumulation window is lost, after a forward that
    # raised as after a backward, as PyTorch FSDP2's reset_iter_state discards it. Gradients already on
    # ``.grad`` stay, as on an unwrapped model; the loop's ``optimizer.zero_grad()`` drops them, and the
    # next steps then equal a run that skipped the batch (tests/test_loops.py). Every rank must raise at
    # the same point, as an error in the data or the model does on every rank; an exception on one rank
    # alone leaves its peers in a collective until the group's timeout, whose error names the unit.
    # A backward that raises before it reaches any unit's hook (in a hook on the model's output or the
    # loss) sets neither flag: there is nothing in flight to put back, and an accumulation window it
    # leaves open follows the loop's zero_grad ([Note: an open accumulation window], grad_state.py).
    # [Note: a forward with no backward after it]
    # What a forward leaves gathered (the root; units that do not reshard after forward) is its backward's,
    # which reshards it. A forward whose backward never reaches a unit -- it raised in a hook on the loss,
    # or the loop skipped a non-finite loss -- leaves it gathered for the next forward, and the loop may
    # change the parameters meanwhile in ways no version counter sees (``p.data`` writes, fused optimizers),
    # so the next forward would compute with the parameters as they were. So a forward that follows a
    # forward with no backward in between first reshards what the earlier one left gathered, and gathers
    # afresh (every rank runs the same loop, so they agree without a collective). A forward after a
    # backward reuses what is gathered as before: no_sync's micro-batches, a user's ``unshard()``.
    def reshard_kept(self) -> None:
        for unit in self.units:
            if unit.gathered:
                unit.use_shard_views()
                unit.reshard()  # waits for a gather still in flight first

    @property
    def interrupted(self) -> bool:
        """Whether the last forward or backward raised and its state is not yet put back."""
        return self.raised or self.end_of_backward_queued

    def recover(self, force: bool = False) -> bool:
        """End a step that raised ([Note: a step that raised]); True if there was one (or ``force``)."""
        if not (force or self.interrupted) or torch._C._current_graph_task_id() != -1:
            return False  # nothing raised, or a backward is running now (a recomputation's forward)
        in_flight, self.pending_reductions = self.pending_reductions, []
        in_flight += self.cross_node_reductions
        self.cross_node_reductions = []
        for group in in_flight:
            group.abandon()
        for unit in self.units:
            unit.abandon_step()
        self.raised = self.end_of_backward_queued = False
        self.phase = Phase.IDLE
        self.order_this_pass = []
        self.sample_memory()
        return True

    # ---- prefetch: the schedule that spans units ------------------------------------------
    # [Note: prefetch]
    # Forward prefetch gathers the unit that ran after this one in the last recorded forward, if this
    # pass has followed that order so far; otherwise the order has changed and nothing is prefetched
    # (logged once) until the end of this pass records the new order. Backward prefetch gathers the
    # unit that ran before this one in this pass's forward: in pre-backward (BACKWARD_PRE, before this
    # unit's gradients are computed) or in post-backward before this unit's reduce-scatter
    # (BACKWARD_POST). The root unit is never prefetched: it stays gathered. With limit_all_gathers,
    # no prefetch is issued while two units (besides the root) are already gathered.
    def prefetch_forward(self) -> None:
        if not self.config.forward_prefetch or not self.forward_order:
            return
        k = len(self.order_this_pass)
        if self.order_this_pass != self.forward_order[:k]:
            if not self._order_changed_warned:
                logger.warning(
                    "flatshard: the forward order of units changed; forward prefetch is off until "
                    "this pass has recorded the new order"
                )
                self._order_changed_warned = True
            return
        if k < len(self.forward_order):
            self._prefetch(self.forward_order[k])

    def prefetch_backward(self, unit: Unit, *, pre: bool) -> None:
        wanted = BackwardPrefetch.BACKWARD_PRE if pre else BackwardPrefetch.BACKWARD_POST
        if self.config.backward_prefetch is not wanted or unit not in self.forward_order:
            return
        k = len(self.forward_order) - 1 - self.forward_order[::-1].index(unit)
        if k > 0:
            self._prefetch(self.forward_order[k - 1])

    def _prefetch(self, target: Unit) -> None:
        if target.is_root or target.gathered:
            return
        if self.config.limit_all_gathers and sum(u.gathered and not u.is_root for u in self.units) >= 2:
            return
        target.unshard(wait=False)

    @property
    def max_reductions_in_flight(self) -> int:
        """How many reductions may be in flight at once where any are: 1, or the most any unit asks for
        (fully_shard's set_reduce_scatter_max_input_buffers)."""
        return max((u.settings.reduce_scatter_max_input_buffers for u in self.units), default=1)

    def settle_reductions(self, keep: int) -> None:
        """Finish all but the ``keep`` newest reductions in flight, oldest first (same order on every rank).

        A reduction is left in flight for one unit's backward compute; the next post-backward finishes
        it (by then it is done, so the wait is short) and frees its full-size gradient. (gloo's
        ``Work.is_completed()`` does not report completion before ``wait()``, so polling cannot work.)"""
        while len(self.pending_reductions) > keep:
            self.settle(self.pending_reductions.pop(0))

    # ---- reductions across nodes ([Note: reductions in flight]) ----------------------------
    def reduction_in_flight(self, group: FlatGroup) -> bool:
        """Whether ``group``'s reduce-scatter (or F = 1 all-reduce) is left in flight for one unit's backward."""
        inter = group.inter_node
        first_crosses = inter.shard_spans if group.groups.shard_size > 1 else inter.replicate_spans
        return self.config.overlap_reductions or (self.config.inter_node_in_flight and first_crosses)

    def settle(self, group: FlatGroup) -> None:
        """``group``'s reduction is due: finish it, except an all-reduce across nodes, which is issued and
        left in flight until the end of backward."""
        if self.config.inter_node_in_flight and group.inter_node.replicate_spans:
            group.advance_reduction(async_op=True)
            self.cross_node_reductions.append(group)
        else:
            group.finish_reduction()

    def finish_in_flight(self, group: FlatGroup) -> None:
        """Before ``group`` reduces again in this backward (a unit whose gradient arrives twice): finish
        its reduction still in flight, so the two add up (those issued before it first, in order)."""
        while group in self.pending_reductions:
            self.settle(self.pending_reductions.pop(0))
        if group in self.cross_node_reductions:
            self.cross_node_reductions.remove(group)
            group.finish_reduction()

    def next_tag(self, index: int) -> int:
        """The tag of the next point-to-point exchange of the unit at ``index`` ([Note: order checks])."""
        self._exchanges = (self._exchanges + 1) % (1 << 16)
        return exchange_tag(self._exchanges, index)

    # ---- recorders ----------------------------------------------------------------------
    def record(self, result: CollectiveResult, group: str, unit: str, phase: Optional[Phase] = None) -> None:
        """Hand a collective to every attached recorder, under ``phase`` (default: the current phase)."""
        if not self.comm_recorders:
            return
        event = CommEvent(
            result.kind, group, result.group_size, phase or self.phase, unit, result.tensor_bytes, result.wire_bytes
        )
        for recorder in self.comm_recorders:
            recorder.record(event)

    def sample_memory(self) -> None:
        for recorder in self.memory_recorders:
            recorder.sample()
