"""The step-time model this benchmark proposes for the planner, written out so its figures can be set
beside the planner's (bench/cluster_predict.py prints both). It is *not* the planner: predictions in
the tables come from ``flatshard.planner``; this file is the exact change docs/multi_node.md asks of
planner/comm.py and planner/plan.py, in runnable form.

[Note: cluster link model]
The planner charges every byte of a group that spans nodes at the per-rank inter-node bandwidth. Two
things decide what really crosses a node's link, and how fast:
* which bytes cross: a group of n ranks with g of them on each node (g = G for contiguous shard groups
  that span nodes, g = 1 for replicate groups). flatshard's all-gather and reduce-scatter on gloo are
  point-to-point exchanges: a rank sends its chunk to the n - g peers off its node and to g - 1 on it,
  so only (n - g) / (n - 1) of its bytes cross. A ring all-reduce of V bytes per rank (gloo's, NCCL's)
  runs at its slowest hop: each hop carries V, and the hops that leave a node cross.
* how much a node can send: the ranks of a node share its link. A crossing is limited both by what one
  rank can push (``rank_bw``, its NIC: here the whole link) and by what the node's link carries for all
  G / g groups at once (``node_bw``); the time is the larger of crossing bytes / rate at the two levels.
  With one NIC per rank (a GPU cluster) node_bw = G x rank_bw and the rank level decides, the planner's
  formula today; with one link per node (this emulation, many CPU clusters) a single crossing gets the
  whole link and concurrent ones share it.
Per collective, with chunk c bytes (the shard for all-gather and reduce-scatter) and latency alpha:
    exchange (all-gather, reduce-scatter): (n-1) alpha + (g-1) c / intra_bw
                                           + max((n-g) c / rank_bw, G (n-g) c / node_bw)
    ring all-reduce of V:                  2(n-1) alpha + max(V / intra_bw if g > 1,
                                                              max(V / rank_bw, (G/g) V / node_bw))
A group inside one node has only the intra term. The step adds, serially as the engine runs on CPU,
compute (forward + backward) + the optimizer step on 1/F of the model + every collective.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkModel:
    intra_bw: float
    intra_alpha: float
    rank_bw: float  # bytes/s one rank can send across nodes by itself
    node_bw: float  # bytes/s one node's link carries across, all its ranks together
    inter_alpha: float
    ranks_per_node: int


def _exchange(link: LinkModel, n: int, g: int, chunk: float) -> tuple[float, float]:
    """(seconds, bytes crossing one node's link) of an all-gather or reduce-scatter."""
    if n == 1:
        return 0.0, 0.0
    if g >= n:  # inside one node
        return (n - 1) * link.intra_alpha + (n - 1) * chunk / link.intra_bw, 0.0
    node_bytes = link.ranks_per_node * (n - g) * chunk
    cross = max((n - g) * chunk / link.rank_bw, node_bytes / link.node_bw)
    return (n - 1) * link.inter_alpha + (g - 1) * chunk / link.intra_bw + cross, node_bytes


def _ring_all_reduce(link: LinkModel, n: int, g: int, volume: float) -> tuple[float, float]:
    """(seconds, bytes crossing one node's link) of a ring all-reduce moving ``volume`` per rank."""
    if n == 1:
        return 0.0, 0.0
    if g >= n:
        return 2 * (n - 1) * link.intra_alpha + volume / link.intra_bw, 0.0
    node_bytes = (link.ranks_per_node / g) * volume
    cross = max(volume / link.rank_bw, node_bytes / link.node_bw)
    hop = max(volume / link.intra_bw if g > 1 else 0.0, cross)
    return 2 * (n - 1) * link.inter_alpha + hop, node_bytes


def step_time(
    link: LinkModel,
    strategy: str,
    world: int,
    f: int,
    root: int,
    units: tuple[int, ...],
    compute_s: float,
    optimizer_s: float,
    elem_bytes: int = 4,
) -> dict:
    """Seconds of one step (serial), its parts, and the bytes crossing one node's link per step, for
    ``strategy`` at sharding factor ``f``."""
    G = link.ranks_per_node
    r = world // f
    g_shard = min(f, G)  # contiguous shard groups: G ranks per node when they span nodes
    g_rep = max(1, G // f) if f < G else 1  # replicate groups: strided, one rank per node when f >= G
    calls: list[tuple[float, float]] = []
    sizes = ([(root, True)] if root else []) + [(t, False) for t in units]
    for numel, is_root in sizes:
        if strategy == "NO_SHARD":
            calls.append(_ring_all_reduce(link, world, min(world, G), 2 * (world - 1) / world * numel * elem_bytes))
            continue
        chunk = math.ceil(numel / f) * elem_bytes
        gathers = 1 + (strategy in ("FULL_SHARD", "HYBRID_SHARD") and not is_root)
        calls += [_exchange(link, f, g_shard, chunk)] * (gathers + 1)  # all-gathers, then the reduce-scatter
        if r > 1:
            calls.append(_ring_all_reduce(link, r, g_rep, 2 * (r - 1) / r * chunk))
    comm = sum(t for t, _ in calls)
    opt = optimizer_s / f
    return {
        "step_s": compute_s + opt + comm,
        "comm_s": comm,
        "optimizer_s": opt,
        "node_crossing_bytes": sum(b for _, b in calls),
    }


def link_model(calibration: dict, ranks_per_node: int) -> LinkModel:
    """The model's figures from the calibration (cluster_calibrate.py): intra from the pairs, the node's
    link from every rank sending at once (their sum), one rank's from the single flow."""
    links = calibration["links"]
    intra = links.get("intra", links["inter"])
    return LinkModel(
        intra_bw=intra["bandwidth_Bps"],
        intra_alpha=intra["latency_s"],
        rank_bw=links["inter, one flow"]["bandwidth_Bps"],
        node_bw=links["inter"]["bandwidth_Bps"] * ranks_per_node,
        inter_alpha=links["inter"]["latency_s"],
        ranks_per_node=ranks_per_node,
    )
