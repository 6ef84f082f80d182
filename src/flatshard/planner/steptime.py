"""Seconds per step: compute, the optimizer step, and the collectives as the engine schedules them.

[Note: planner step schedule]
Compute is 6 P tokens FLOPs (2 forward, 4 backward; 2 more in backward under activation
checkpointing) at ``device_flops``, or ``compute_time_s`` split 1/3 forward, 2/3 backward (1/4 and
3/4 with checkpointing); a unit's share of either is its share of the parameters. The optimizer
step is ``optimizer_time_s / F`` (a rank steps its shard). Four figures:
* serial: compute + optimizer + every collective of comm.py, one after another.
* scheduled: the engine's schedule at prefetch depth 0 as it runs on CPU today (hooks.py,
  [Note: reductions in flight] in runtime/schedule.py): forward gathers each unit before it computes;
  backward, for each unit in reverse forward order and the root last, gathers it again (FULL_SHARD,
  HYBRID_SHARD), computes its share, and reduces it, every reduction finished before the next unit
  computes, except, with ``inter_node_in_flight`` (the default), what crosses nodes:
    - the all-reduce across replicas whose group spans nodes (hybrid, NO_SHARD) is issued when the
      unit's reduce-scatter is done and left in flight until the end of backward;
    - the reduce-scatter of a shard group that spans nodes (FULL_SHARD across nodes) is left in
      flight until the next unit's post-backward, where it is finished (and its all-reduce, if its
      replicas span nodes too, issued and left in flight).
  What is in flight occupies the link between nodes one collective after another in the order
  issued; a collective of a group that spans nodes issued meanwhile (a gather in backward) waits
  for the link, one inside a node does not. The step ends when both backward's compute and the
  link are done, then the optimizer steps. With nothing crossing a node, scheduled = serial.
  With the optimizer state across replicas ("+OptR") the reduce-scatter across replicas takes the
  all-reduce's place above, in flight alike, and forward overlaps too: every unit's all-gather of
  the pieces is issued when the root's forward begins, in forward order, one after another on the
  link between nodes when the replicate groups cross it (else on a link of their own), and each unit
  waits for its own before its gather; the root's compute is counted at the end of forward (its head),
  so the pieces travel during the compute of the units before theirs. This holds with or without
  ``inter_node_in_flight`` (which decides backward only), and the optimizer step is
  ``optimizer_time_s / W`` (a rank steps its piece).
* overlapped (prefetch depth >= 1): each phase takes max(compute, communication) plus what cannot
  hide: the first forward all-gather (+OptR: with the first unit's pieces), the last unit's
  reduce-scatter and all-reduce (and every all-reduce unless ``overlap_all_reduce``).
* expected: overlapped with prefetch (d >= 1), scheduled without (the engine's d = 0).
Not modelled: BACKWARD_PRE's gather of the next unit during this unit's backward (the engine issues
it on CPU too; with the cores, not a link, the bottleneck it was not seen to help, and FULL_SHARD's
in-flight reduce-scatters, measured 5-12% faster than without, are predicted about as fast as
without, because the next gather waits for the link); the on-GPU schedule (every reduction in flight
for one unit: ``overlapped`` is the planner's figure there); the CPU time the collectives take from
compute on shared cores; load on the machine.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.planner.comm import INTER, CommEstimate, UnitComm
from flatshard.planner.inputs import PlanInputs


@dataclass(frozen=True)
class TimeEstimate:
    """Seconds per step ([Note: planner step schedule]). ``serial``: compute, optimizer and every
    collective, nothing overlapped. ``scheduled``: the engine's schedule at prefetch depth 0, serial
    but for what crosses nodes in flight. ``overlapped``: collectives hidden behind the phase's compute
    except the first forward all-gather, the last unit's reduce-scatter and all-reduce, and (unless
    ``overlap_all_reduce``) every all-reduce. ``expected`` is ``overlapped`` with prefetch (depth >= 1)
    and ``scheduled`` without, which is how the engine runs today (prefetch depth 0). Each includes
    ``optimizer_s``, the optimizer step on this rank's shard (0 unless ``optimizer_time_s`` is given)."""

    compute_forward_s: float
    compute_backward_s: float
    comm_s: float
    serial_s: float
    overlapped_s: float
    expected_s: float
    optimizer_s: float = 0.0
    scheduled_s: float = 0.0


def compute_known(inputs: PlanInputs) -> bool:
    """Whether the step has compute in it: ``compute_time_s``, or ``device_flops`` with tokens
    (micro-batch x sequence length). Without, every time is communication (and the optimizer) only."""
    tokens = inputs.micro_batch * inputs.seq_len
    return inputs.compute_time_s is not None or bool(inputs.device_flops and tokens)


def schedule_label(inputs: PlanInputs) -> str:
    """Which schedule the expected step (JSON ``step_time_s``) assumes, in words that start with its
    name, "scheduled" or "overlapped" ([Note: planner step schedule])."""
    if inputs.prefetch_depth >= 1:
        out = (
            f"overlapped: prefetch depth {inputs.prefetch_depth}, every collective hidden behind compute but "
            "the first gather and the last unit's reductions"
            + ("" if inputs.overlap_all_reduce else ", and every all-reduce (--exposed-all-reduce)")
        )
    else:
        crossing = (
            "what crosses nodes left in flight"
            if inputs.inter_node_in_flight
            else "every reduction finished before the next unit (--no-inter-node-in-flight)"
        )
        out = (
            "scheduled: the engine's schedule at prefetch depth 0 as it runs on CPU (gloo), each collective "
            f"waited for, {crossing}"
        )
    if not compute_known(inputs):
        out += "; compute not known (--compute-time, or --tflops with --micro-batch and --seq-len): "
        out += "communication and the optimizer step only" if inputs.optimizer_time_s else "communication only"
    if inputs.prefetch_depth < 1:
        out += ". A GPU run overlaps more: its figure is the overlapped step"
    return out


def compute_times(inputs: PlanInputs) -> tuple[float, float]:
    """(forward, backward) compute seconds: 6 P tokens FLOPs (2 forward, 4 backward), plus a
    second forward (2 P tokens) in backward under activation checkpointing."""
    recompute = inputs.activation_checkpointing
    if inputs.compute_time_s is not None:
        share = 0.25 if recompute else 1 / 3
        return inputs.compute_time_s * share, inputs.compute_time_s * (1 - share)
    tokens = inputs.micro_batch * inputs.seq_len
    if not inputs.device_flops or tokens == 0:
        return 0.0, 0.0
    unit = inputs.params * tokens / inputs.device_flops
    return 2 * unit, (6 if recompute else 4) * unit


def _overlapped(comm: CommEstimate, cf: float, cb: float, overlap_all_reduce: bool) -> float:
    fwd = cf
    if comm.forward_s > 0:
        fwd = comm.first_forward_s + max(cf, comm.forward_s - comm.first_forward_s)
    if overlap_all_reduce:
        exposed_ar, tail = 0.0, comm.last_backward_s
    else:
        exposed_ar, tail = comm.all_reduce_s, comm.last_backward_s - comm.last_all_reduce_s
    hideable = comm.backward_s - exposed_ar
    bwd = cb + exposed_ar
    if hideable > 0:
        tail = min(tail, hideable)
        bwd = tail + max(cb, hideable - tail) + exposed_ar
    return fwd + bwd


class _Link:
    """The link between nodes: busy until ``free`` with what was left in flight, in the order issued."""

    def __init__(self) -> None:
        self.free = 0.0

    def send(self, now: float, seconds: float) -> float:
        """Leave a collective in flight at ``now``: it is done when this returns."""
        self.free = max(now, self.free) + seconds
        return self.free

    def run(self, now: float, seconds: float, crosses: bool) -> float:
        """A collective the rank waits for: behind what is in flight if it crosses nodes."""
        if not crosses:
            return now + seconds
        self.free = max(now, self.free) + seconds
        return self.free


def _forward(comm: CommEstimate, cf: float, link: _Link, shard_x: bool, rep_x: bool) -> float:
    """Forward as the engine runs it: serial, but for the pieces' all-gathers (optimizer state across
    replicas), all issued when forward begins, one after another on their links (the link between nodes
    when the replicate groups cross), each waited for at its unit's gather; the root computes last."""
    if not comm.pieces:
        return cf + comm.forward_s  # nothing is in flight
    total = sum(u.elements for u in comm.units) or 1
    channel = link if rep_x else _Link()
    ready = [channel.send(0.0, u.pieces_gather_s) for u in comm.units]
    now = 0.0
    for u, done in zip(comm.units, ready):
        now = link.run(max(now, done), u.all_gather_s, shard_x)
        now += 0.0 if u.is_root else cf * u.elements / total
    return now + cf * sum(u.elements for u in comm.units if u.is_root) / total


def _scheduled(comm: CommEstimate, cf: float, cb: float, in_flight: bool = True) -> float:
    """Forward and backward (no optimizer) as [Note: planner step schedule] says the engine runs them,
    what crosses nodes left in flight in backward with ``in_flight`` (``inter_node_in_flight``)."""
    shard_x, rep_x = comm.shard_link == INTER, comm.replicate_link == INTER
    total = sum(u.elements for u in comm.units) or 1
    link = _Link()
    now = _forward(comm, cf, link, shard_x, rep_x)
    shard_x, rep_x = shard_x and in_flight, rep_x and in_flight  # what backward leaves in flight
    pending: tuple[float, UnitComm] | None = None  # a reduce-scatter across nodes in flight, and its unit

    def settle(now: float) -> float:
        if pending is None:
            return now
        done, unit = pending
        now = max(now, done)
        if rep_x:
            link.send(now, unit.all_reduce_s)
            return now
        return now + unit.all_reduce_s

    order = [u for u in reversed(comm.units) if not u.is_root] + [u for u in comm.units if u.is_root]
    for u in order:
        if u.regather:
            now = link.run(now, u.all_gather_s, shard_x)
        now += cb * u.elements / total
        now, pending = settle(now), None  # the previous unit's reduction in flight is finished here
        if shard_x:
            pending = (link.send(now, u.reduce_scatter_s), u)
            continue
        now += u.reduce_scatter_s
        if rep_x:
            link.send(now, u.all_reduce_s)
        else:
            now += u.all_reduce_s
    now = settle(now)
    return max(now, link.free)


def time_estimate(inputs: PlanInputs, comm: CommEstimate, f: int) -> TimeEstimate:
    """The step of one plan at sharding factor ``f`` ([Note: planner step schedule]); with the optimizer
    state across replicas (``comm.pieces``) a rank steps 1/W of the model."""
    cf, cb = compute_times(inputs)
    opt = (inputs.optimizer_time_s or 0.0) / (inputs.world_size if comm.pieces else f)
    serial = cf + cb + comm.forward_s + comm.backward_s + opt
    overlapped = _overlapped(comm, cf, cb, inputs.overlap_all_reduce) + opt
    crosses = INTER in (comm.shard_link, comm.replicate_link)
    if comm.pieces:  # the pieces' all-gathers overlap forward whether or not anything crosses
        scheduled = _scheduled(comm, cf, cb, inputs.inter_node_in_flight) + opt
    else:
        scheduled = _scheduled(comm, cf, cb) + opt if inputs.inter_node_in_flight and crosses else serial
    expected = overlapped if inputs.prefetch_depth >= 1 else scheduled
    return TimeEstimate(cf, cb, comm.forward_s + comm.backward_s, serial, overlapped, expected, opt, scheduled)
