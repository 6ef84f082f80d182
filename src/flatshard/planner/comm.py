"""Collectives per step, bytes per rank on each link class, and their ring alpha-beta times.

[Note: planner communication model]
Per-rank bytes are ring volumes (what one rank sends; it receives as much):
    all-gather of unit u over F ranks:     (F - 1) * S_u * compute bytes
    reduce-scatter of unit u over F ranks: (F - 1) * S_u * reduce bytes
    all-reduce of n elements over R ranks: 2 * (R - 1) / R * n * reduce bytes
        (exact rationals; a figure that is not a whole number of bytes is reported as a float)
These are the engine's ``Collective.wire_bytes`` (collectives.py), so recorded and predicted bytes
compare directly. Under ``shard_boundaries`` "rows" and "params" the shards of a unit differ and S_u
is the largest, max_k s_{k,u} ([Note: planner memory model]): every rank receives every shard, so a
unit's all-gather takes as long as its largest shard's sends, and its reduce-scatter as long as the
largest chunk's receives. The bytes are the largest rank's: on NCCL, which pads every shard to the
largest, every rank's; on gloo the all-gather's largest sender's, and at least what any rank sends
in the reduce-scatter (rank k sends T_u - s_{k,u} <= (F - 1) * S_u). The hybrid all-reduce of the
shard over the replicas likewise.
Per step, M units (the root counted when it holds parameters):
    FULL_SHARD, HYBRID_SHARD:   forward M all-gathers; backward M-1 all-gathers (the resident root
                                is not gathered again; M if root-less) and M reduce-scatters
    SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2: forward M all-gathers; backward M reduce-scatters
    hybrid: plus M all-reduces of the S_u-element shard over the replicate group (backward)
    NO_SHARD (F = 1): M all-reduces of T_u elements over all W ranks (backward)
So with no root and F | T_u: FULL_SHARD moves 3 P b (F-1)/F, SHARD_GRAD_OP 2 P b (F-1)/F, NO_SHARD
2 P b (W-1)/W, and the hybrid all-reduces 2 (P/F) b (R-1)/R. The documents' "3P" and "2P" drop the
ring factor (N-1)/N; ratios are unchanged (FULL_SHARD / DDP = 1.5 exactly).

Link classes: shard groups are contiguous ranks [kF, (k+1)F); replicate groups are strided
{j, j+F, j+2F, ...}; rank r sits on node r // G. A group whose ranks are all on one node is
intra-node; a group that spans nodes is inter-node, all of its bytes: a ring runs at the speed of
its slowest hop. So the shard group is intra-node exactly when W <= G, or F <= G and F divides G.

Time of one collective over n ranks with per-rank bytes V on a link (alpha, beta):
    all-gather, reduce-scatter: (n - 1) alpha + V / beta;  all-reduce: 2 (n - 1) alpha + V / beta.
"""

from __future__ import annotations

from dataclasses import dataclass
from fractions import Fraction

from flatshard.planner.inputs import Links, PlanInputs, Strategy
from flatshard.planner.memory import units_of

INTRA, INTER, NONE = "intra_node", "inter_node", "none"


@dataclass(frozen=True)
class CollectiveCounts:
    """How many collectives of each kind one step issues, per phase."""

    all_gather_forward: int
    all_gather_backward: int
    reduce_scatter_backward: int
    all_reduce_backward: int

    @property
    def all_gather(self) -> int:
        return self.all_gather_forward + self.all_gather_backward

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter_backward + self.all_reduce_backward


@dataclass(frozen=True)
class CommEstimate:
    """Per-rank bytes per step, by collective and by link class, and the groups' link classes.

    forward_s / backward_s are the phases' communication times (serial, one stream);
    first_forward_s is the first forward all-gather (nothing to hide it behind); last_backward_s
    is the last unit's reduce-scatter and all-reduce (nothing left to compute), of which
    last_all_reduce_s is the all-reduce; all_reduce_s is every all-reduce's time.
    """

    counts: CollectiveCounts
    all_gather: int
    reduce_scatter: int
    all_reduce: int | float
    intra_node: int | float
    inter_node: int | float
    total: int | float
    shard_link: str
    replicate_link: str
    forward_s: float
    backward_s: float
    first_forward_s: float
    last_backward_s: float
    last_all_reduce_s: float
    all_reduce_s: float


def group_link(world: int, gpus_per_node: int, f: int, replicate: bool) -> str:
    """Link class of the shard groups (``replicate=False``) or replicate groups at factor F."""
    size = world // f if replicate else f
    if size == 1:
        return NONE
    groups = (
        [range(j, world, f) for j in range(f)] if replicate else [range(k * f, (k + 1) * f) for k in range(world // f)]
    )
    spans = any(len({r // gpus_per_node for r in g}) > 1 for g in groups)
    return INTER if spans else INTRA


def _number(x: Fraction) -> int | float:
    """An exact byte count as an int, or as a float when it is not a whole number."""
    return int(x) if x.denominator == 1 else float(x)


def _ring_time(links: Links, link: str, steps: int, volume: int) -> float:
    if link == NONE or steps == 0:
        return 0.0
    alpha, beta = (
        (links.intra_latency_s, links.intra_bandwidth)
        if link == INTRA
        else (links.inter_latency_s, links.inter_bandwidth)
    )
    return steps * alpha + volume / beta


def comm_estimate(inputs: PlanInputs, strategy: Strategy, f: int) -> CommEstimate:
    w, links, rec = inputs.world_size, inputs.links, inputs.recipe
    r = w // f
    units = units_of(inputs, f)
    shard_link = group_link(w, inputs.gpus_per_node, f, replicate=False)
    rep_link = group_link(w, inputs.gpus_per_node, f, replicate=True)
    sharded, replicated = f > 1, r > 1
    ag = [(f - 1) * u.shard * rec.compute_bytes if sharded else 0 for u in units]
    rs = [(f - 1) * u.shard * rec.reduce_bytes if sharded else 0 for u in units]
    ar = [Fraction(2 * (r - 1) * u.shard * rec.reduce_bytes, r) if replicated else Fraction(0) for u in units]
    regather = [sharded and strategy.reshard_after_forward and not u.is_root for u in units]

    t_ag = [_ring_time(links, shard_link, f - 1, v) for v in ag]
    t_rs = [_ring_time(links, shard_link, f - 1, v) for v in rs]
    t_ar = [_ring_time(links, rep_link, 2 * (r - 1), float(v)) for v in ar]
    ag_bytes = sum(ag) + sum(v for v, again in zip(ag, regather) if again)
    ar_bytes = sum(ar)
    by_link = {INTRA: Fraction(0), INTER: Fraction(0), NONE: Fraction(0)}
    by_link[shard_link] += ag_bytes + sum(rs)
    by_link[rep_link] += ar_bytes
    m = len(units)
    counts = CollectiveCounts(m if sharded else 0, sum(regather), m if sharded else 0, m if replicated else 0)
    backward_s = sum(t for t, again in zip(t_ag, regather) if again) + sum(t_rs) + sum(t_ar)
    return CommEstimate(
        counts,
        ag_bytes,
        sum(rs),
        _number(ar_bytes),
        _number(by_link[INTRA]),
        _number(by_link[INTER]),
        _number(ag_bytes + sum(rs) + ar_bytes),
        shard_link,
        rep_link,
        sum(t_ag),
        backward_s,
        t_ag[0] if t_ag else 0.0,
        t_rs[0] + t_ar[0] if units else 0.0,
        t_ar[0] if units else 0.0,
        sum(t_ar),
    )
