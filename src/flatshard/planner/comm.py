"""Collectives per step, bytes per rank and per node link, and the alpha-beta time of each collective.

[Note: planner communication model]
Per-rank bytes are ring volumes (what one rank sends; it receives as much):
    all-gather of unit u over F ranks:     (F - 1) * S_u * compute bytes
    reduce-scatter of unit u over F ranks: (F - 1) * S_u * reduce bytes
    all-reduce of n elements over R ranks: 2 * (R - 1) / R * n * reduce bytes
        (exact rationals; a figure that is not a whole number of bytes is reported as a float)
These are the engine's ``Collective.wire_bytes`` (comm/collectives.py), so recorded and predicted bytes
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

Optimizer state across replicas (the "+OptR" plans; S_u = R P_u, P_u = ceil(T_u / W), [Note: planner
memory model]): inside the shard group as the hybrid, with this S_u; across the replicas, for the all-reduce,
    reduce-scatter of unit u over R ranks (backward):                   (R - 1) * P_u * reduce bytes
    all-gather of unit u's pieces over R ranks (forward, after every optimizer step): (R - 1) * P_u * master bytes
each moved as any all-gather or reduce-scatter (``exchange``, chunk P_u bytes): M more of each per step,
counted with the all-gathers and reduce-scatters, none in ``all_reduce``. With equal reduce and master
dtypes the two move together what the all-reduce moved, 2 (R - 1) / R * S_u bytes, and cross nodes alike.
``CommEstimate.by_collective`` names every collective as the engine's recorder does
("backward/reduce_scatter/replicate", "forward/all_gather/replicate", ...).

Link classes: shard groups are contiguous ranks [kF, (k+1)F); replicate groups are strided
{j, j+F, j+2F, ...}; rank r sits on node r // G. A group whose ranks are all on one node is
intra-node; a group that spans nodes is inter-node. So the shard group is intra-node exactly when
W <= G, or F <= G and F divides G.

Which bytes cross a node's link, and how fast (measured on an emulated cluster, docs/multi_node.md).
For a group of n ranks, g of them on a rank's node (``Spread``: g, the peers off the node n - g, and
per node the sends and ring hops that leave it), chunk c = S_u bytes:
* ``exchange="ring"`` (NCCL): a ring runs at the speed of its slowest hop. Each hop carries V per
  rank (V = (n-1) c for all-gather and reduce-scatter); a node's hops out of it (h per node: one per
  ring of its ranks that leaves it) share its link:
      (n-1) alpha + max(V / intra_bw if g > 1, V / inter_bw, h V / node_bw)
  Every byte of a ring that spans nodes counts as inter-node per rank (its slowest hop's class); the
  node's link carries h V.
* ``exchange="direct"`` (flatshard's all-gather and reduce-scatter on gloo, runtime/comm/gloo_exchange.py:
  one point-to-point message per peer): of a rank's n - 1 chunks only the n - g to other nodes cross,
  and a node's link carries all its ranks' crossing chunks, s = sum over its ranks of (n - g) c:
      (n-1) alpha + (g-1) c / intra_bw + max((n-g) c / inter_bw, s / node_bw)
  per rank (n-g) c is inter-node and (g-1) c intra-node.
* all-reduces are rings either way (gloo's and NCCL's own): 2 (n-1) alpha and the ring's hop term.
* a group inside one node: (n-1) alpha + V / intra_bw (all-reduce 2 (n-1) alpha), ring or direct.
``Links.inter_node_bandwidth`` (node_bw) defaults to G x inter_bw, a NIC per rank: then h V / node_bw
never exceeds V / inter_bw and the ring figures are the classic (n-1) alpha + V / inter_bw. Where the
ranks of a node share one link, a crossing made by one rank at a time (the hop of a ring over every
rank, NO_SHARD) gets the whole link, and crossings made by all at once share it.
Not modelled: compression (``compress_inter_node``: the bytes are fp32's), per-message costs beyond
alpha (copies, summing, the threads of gloo on the same cores as compute), TCP/IP headers (the
kernel's counters read 0-5% above ``node_link``), and for ragged shards the crossing bytes are counted
at the largest shard.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
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
class UnitComm:
    """One unit's collectives in one step, in seconds each (0 for a collective it does not issue).
    ``all_reduce_s`` is its reduction across replicas: the all-reduce, or with the optimizer state across
    replicas the reduce-scatter that replaces it; ``pieces_gather_s`` the all-gather of the pieces."""

    elements: int
    is_root: bool
    all_gather_s: float
    regather: bool  # gathered again in backward (FULL_SHARD, HYBRID_SHARD; not the resident root)
    reduce_scatter_s: float
    all_reduce_s: float
    pieces_gather_s: float = 0.0


@dataclass(frozen=True)
class CommEstimate:
    """Per-rank bytes per step, by collective and by link class, and the groups' link classes.

    forward_s / backward_s are the phases' communication times (serial, one stream);
    first_forward_s is the first forward all-gather (nothing to hide it behind); last_backward_s
    is the last unit's reduce-scatter and all-reduce (nothing left to compute), of which
    last_all_reduce_s is the all-reduce; all_reduce_s is every all-reduce's time. node_link is what
    the busiest node's link sends to other nodes per step, all its ranks together; units has every
    unit's collective times, in forward order (the root first), for the step schedule (steptime.py).
    ``pieces``: the optimizer state across replicas, whose replicate reduce-scatters take the all-reduces'
    place in every ``*all_reduce_s`` figure and whose pieces' all-gathers count in ``forward_s`` (the
    root's in ``first_forward_s``). ``by_collective``: "phase/kind/group" (as the engine's recorder
    names them) -> (calls, bytes per rank) per step.
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
    node_link: int | float = 0
    units: tuple[UnitComm, ...] = ()
    pieces: bool = False
    by_collective: dict[str, tuple[int, int | float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Spread:
    """How the groups of one kind (shard or replicate groups at F) lie across nodes of G ranks."""

    size: int  # n, ranks per group
    link: str  # INTRA, INTER or NONE (n = 1)
    local: int  # g: the most ranks of one group on one node
    remote: int  # the most peers off its node any rank has (n - g for that rank)
    node_sends: int  # the most chunks leaving one node in an exchange: sum over its ranks of their peers off it
    hops_out: int  # the most ring hops leaving one node: one per ring of its ranks that leaves it


@functools.lru_cache(maxsize=256)
def spread(world: int, gpus_per_node: int, f: int, replicate: bool) -> Spread:
    """Where the shard groups (``replicate=False``) or the replicate groups at factor F put their ranks."""
    n = world // f if replicate else f
    if n == 1:
        return Spread(1, NONE, 1, 0, 0, 0)
    groups = (
        [range(j, world, f) for j in range(f)] if replicate else [range(k * f, (k + 1) * f) for k in range(world // f)]
    )
    nodes = world // gpus_per_node if world % gpus_per_node == 0 else world // gpus_per_node + 1
    sends, hops = [0] * nodes, [0] * nodes
    local = remote = 0
    for group in groups:
        node = [r // gpus_per_node for r in group]
        on = {k: node.count(k) for k in set(node)}
        local = max(local, max(on.values()))
        for i, k in enumerate(node):
            remote = max(remote, n - on[k])
            sends[k] += n - on[k]
            hops[k] += node[(i + 1) % n] != k
    return Spread(n, INTER if remote else INTRA, local, remote, max(sends), max(hops))


def group_link(world: int, gpus_per_node: int, f: int, replicate: bool) -> str:
    """Link class of the shard groups (``replicate=False``) or replicate groups at factor F."""
    return spread(world, min(gpus_per_node, world), f, replicate).link


def _number(x: Fraction) -> int | float:
    """An exact byte count as an int, or as a float when it is not a whole number."""
    return int(x) if x.denominator == 1 else float(x)


@dataclass(frozen=True)
class _Wire:
    """Seconds of one collective and where its bytes go: per rank inside and across nodes, per node link."""

    seconds: float
    intra: Fraction
    inter: Fraction
    node: Fraction


def _ring(links: Links, g: int, sp: Spread, steps: int, volume: Fraction) -> _Wire:
    """A ring collective moving ``volume`` bytes per rank in ``steps`` latency steps."""
    if sp.link == NONE or steps == 0:
        return _Wire(0.0, Fraction(0), Fraction(0), Fraction(0))
    v = float(volume)
    if sp.link == INTRA:
        return _Wire(steps * links.intra_latency_s + v / links.intra_bandwidth, volume, Fraction(0), Fraction(0))
    hop = max(
        v / links.intra_bandwidth if sp.local > 1 else 0.0,
        v / links.inter_bandwidth,
        sp.hops_out * v / links.node_bandwidth(g),
    )
    return _Wire(steps * links.inter_latency_s + hop, Fraction(0), volume, sp.hops_out * volume)


def _gather_like(links: Links, g: int, sp: Spread, exchange: str, chunk: int) -> _Wire:
    """An all-gather or reduce-scatter with ``chunk`` bytes per peer, as ``exchange`` moves it."""
    n = sp.size
    if exchange == "ring" or sp.link != INTER:
        return _ring(links, g, sp, n - 1, Fraction((n - 1) * chunk))
    cross = max(sp.remote * chunk / links.inter_bandwidth, sp.node_sends * chunk / links.node_bandwidth(g))
    seconds = (n - 1) * links.inter_latency_s + (sp.local - 1) * chunk / links.intra_bandwidth + cross
    return _Wire(
        seconds, Fraction((n - 1 - sp.remote) * chunk), Fraction(sp.remote * chunk), Fraction(sp.node_sends * chunk)
    )


def comm_estimate(inputs: PlanInputs, strategy: Strategy, f: int, pieces: bool = False) -> CommEstimate:
    """``pieces``: with the optimizer state across replicas (``inputs.across_replicas(strategy, f)``)."""
    w, links, rec = inputs.world_size, inputs.links, inputs.recipe
    g = inputs.ranks_per_node
    r = w // f
    units = units_of(inputs, f, pieces)
    shard, rep = spread(w, g, f, replicate=False), spread(w, g, f, replicate=True)
    sharded, replicated = f > 1, r > 1
    ag = [_gather_like(links, g, shard, inputs.exchange, u.shard * rec.compute_bytes) for u in units]
    rs = [_gather_like(links, g, shard, inputs.exchange, u.shard * rec.reduce_bytes) for u in units]
    if pieces:  # across replicas: a reduce-scatter to the piece, and the pieces gathered in the next forward
        ar = [_gather_like(links, g, rep, inputs.exchange, u.piece * rec.reduce_bytes) for u in units]
        pag = [_gather_like(links, g, rep, inputs.exchange, u.piece * rec.master_bytes) for u in units]
    else:
        ar = [_ring(links, g, rep, 2 * (r - 1), Fraction(2 * (r - 1) * u.shard * rec.reduce_bytes, r)) for u in units]
        pag = []
    regather = [sharded and strategy.reshard_after_forward and not u.is_root for u in units]
    calls = ag + [a for a, again in zip(ag, regather) if again] + rs + ar + pag

    ag_fwd = sum((f - 1) * u.shard * rec.compute_bytes for u in units)
    ag_bwd = sum((f - 1) * u.shard * rec.compute_bytes for u, again in zip(units, regather) if again)
    rs_bytes = sum((f - 1) * u.shard * rec.reduce_bytes for u in units)
    ar_bytes = sum((c.intra + c.inter for c in ar), Fraction(0))
    pag_bytes = sum((c.intra + c.inter for c in pag), Fraction(0))
    m = len(units)
    exact: dict[str, tuple[int, int | Fraction]] = {
        "forward/all_gather/shard": (m if sharded else 0, ag_fwd),
        "backward/all_gather/shard": (sum(regather), ag_bwd),
        "backward/reduce_scatter/shard": (m if sharded else 0, rs_bytes),
        f"backward/{'reduce_scatter' if pieces else 'all_reduce'}/replicate": (m if replicated else 0, ar_bytes),
        "forward/all_gather/replicate": (len(pag), pag_bytes),
    }
    by_collective = {k: (n, _number(Fraction(b))) for k, (n, b) in exact.items() if n}
    ag_bytes = ag_fwd + ag_bwd + (int(pag_bytes) if pieces else 0)
    if pieces:  # whole numbers: (R - 1) P_u elements each
        rs_bytes, ar_bytes = rs_bytes + int(ar_bytes), Fraction(0)
    intra = sum((c.intra for c in calls), Fraction(0))
    inter = sum((c.inter for c in calls), Fraction(0))
    node = sum((c.node for c in calls), Fraction(0))
    counts = CollectiveCounts(
        (m if sharded else 0) + len(pag),
        sum(regather),
        (m if sharded else 0) + (m if pieces else 0),
        m if replicated and not pieces else 0,
    )
    t_ag, t_rs, t_ar = [c.seconds for c in ag], [c.seconds for c in rs], [c.seconds for c in ar]
    t_pag = [c.seconds for c in pag] or [0.0] * m
    backward_s = sum(t for t, again in zip(t_ag, regather) if again) + sum(t_rs) + sum(t_ar)
    per_unit = tuple(
        UnitComm(u.elements, u.is_root, t_ag[k], regather[k], t_rs[k], t_ar[k], t_pag[k]) for k, u in enumerate(units)
    )
    return CommEstimate(
        counts,
        ag_bytes,
        rs_bytes,
        _number(ar_bytes),
        _number(intra),
        _number(inter),
        _number(ag_bytes + rs_bytes + ar_bytes),
        shard.link,
        rep.link,
        sum(t_ag) + (sum(t_pag) if pieces else 0.0),
        backward_s,
        (t_ag[0] + (t_pag[0] if pieces else 0.0)) if t_ag else 0.0,
        t_rs[0] + t_ar[0] if units else 0.0,
        t_ar[0] if units else 0.0,
        sum(t_ar),
        _number(node),
        per_unit,
        pieces,
        by_collective,
    )
