"""The calibration of ``make cluster``, run in the ranks by bench/cluster/worker.py before the systems.

[Note: cluster calibration]
Link classes are measured as bytes/s per direction. Latency alpha is the median time of a 4-byte
message; bandwidth beta is the slope between the medians at 1 MiB and 8 MiB. The planner's ``Links``
takes them as flatshard.planner.calibration says: intra from "intra", one rank's rate across from
"inter, one flow", the node's link from "inter" times the ranks of a node.
* intra: the ranks of a node pair up (local ranks 2k, 2k+1) and exchange both ways at once (isend +
  irecv, as flatshard's gloo exchanges do) over the namespace's loopback, where the cost is CPU.
* inter: every rank of node 2m sends to the rank of the same local rank on node 2m+1, all at once: the
  P ranks of a node share its link, as the replicate all-reduces of a hybrid do, each getting ~1/P.
* inter, one flow: one rank sending, one receiving: what one rank gets by itself (here the link's rate).
* for reading, not for the planner: "inter, pairs both ways" (the same pairs exchanging both ways on
  one connection each: gloo moves a connection's two directions at about half the rate each, which
  flatshard's collectives, using several connections at once, do not suffer).
Compute is one rank's forward + backward on its batch, timed in the run itself: the system with no
communication is interleaved with the others, its forward + backward and its optimizer step timed
apart (the planner's ``compute_time_s`` and ``optimizer_time_s``), every rank computing at once as in
training (on a shared CPU they compete for cores), so the load of the moment weighs on compute and
systems alike.

Then the collectives themselves, one Block unit's worth of fp32 (what one unit moves), every rank at
once, each the way flatshard issues it on gloo: the all-gather as one round of point-to-point sends to
every peer of the group, the reduce-scatter as n - 1 rounds (peer r+k in round k), and the all-reduce
as gloo's own ``all_reduce`` over the group. These are set beside the planner's time for the same
collective (bench/cluster/predict.py), so a miss of a step prediction can be traced to a collective.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

SMALL, MID, LARGE = 4, 1 << 20, 8 << 20  # bytes per exchange: latency, then two sizes for the slope


def slowest(values: list[float]) -> list[float]:
    """Element-wise max over ranks (a timed step lasts as long as its slowest rank)."""
    mine = torch.tensor(values, dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    return mine.tolist()


def timed(fn, reps: int) -> float:
    """Median over ``reps`` of the slowest rank's time of ``fn`` (every rank starts after a barrier)."""
    times = []
    for _ in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(slowest(times))


# ---- links ---------------------------------------------------------------------------------------------
def _exchange(send_to: int | None, recv_from: int | None, nbytes: int):
    send = torch.ones(max(1, nbytes // 4))
    recv = torch.empty_like(send)

    def run():
        works = [] if send_to is None else [dist.isend(send, send_to)]
        works += [] if recv_from is None else [dist.irecv(recv, recv_from)]
        for w in works:
            w.wait()

    return run


def _link(send_to: int | None, recv_from: int | None, reps_small: int = 20, reps_large: int = 5) -> dict:
    timed(_exchange(send_to, recv_from, MID), 1)  # connect and warm up
    t = {
        "4B": timed(_exchange(send_to, recv_from, SMALL), reps_small),
        "1MiB": timed(_exchange(send_to, recv_from, MID), reps_large),
        "8MiB": timed(_exchange(send_to, recv_from, LARGE), reps_large),
    }
    beta = (LARGE - MID) / max(t["8MiB"] - t["1MiB"], 1e-9)
    return {"latency_s": t["4B"], "bandwidth_Bps": beta, "seconds": t}


def calibrate_links(nodes: int, nproc: int) -> dict:
    rank = dist.get_rank()
    node, local = divmod(rank, nproc)
    out = {}
    if nproc > 1:
        intra = rank ^ 1 if (local ^ 1) < nproc else None
        out["intra"] = _link(intra, intra)
    partner = node ^ 1
    peer = partner * nproc + local if partner < nodes else None
    sender, receiver = node % 2 == 0, node % 2 == 1
    out["inter"] = _link(peer if sender else None, peer if receiver else None)
    out["inter, pairs both ways"] = _link(peer, peer)
    lead = peer if local == 0 else None
    out["inter, one flow"] = _link(lead if sender else None, lead if receiver else None)
    return out


# ---- the collectives -------------------------------------------------------------------------------------
def _groups(nodes: int, nproc: int):
    """(this rank's shard group = its node, its replicate group = same local rank on every node); every
    rank creates every group, in the same order, as c10d requires."""
    rank = dist.get_rank()
    shard = replicate = None
    for n in range(nodes):
        g = dist.new_group(list(range(n * nproc, (n + 1) * nproc)))
        shard = g if rank // nproc == n else shard
    for j in range(nproc):
        g = dist.new_group(list(range(j, nodes * nproc, nproc)))
        replicate = g if rank % nproc == j else replicate
    return shard, replicate


def _all_gather(numel: int, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    shard, out = torch.ones(-(-numel // n)), torch.empty(n * -(-numel // n))
    chunks = out.chunk(n)

    def run():
        works = []
        for k in range(1, n):
            dst, src = dist.get_global_rank(group, (me + k) % n), dist.get_global_rank(group, (me - k) % n)
            works += [dist.isend(shard, dst, group=group), dist.irecv(chunks[(me - k) % n], src, group=group)]
        for w in works:
            w.wait()

    return run


def _reduce_scatter(numel: int, group):
    n, me = dist.get_world_size(group), dist.get_rank(group)
    full = torch.ones(n * -(-numel // n))
    chunks, out = full.chunk(n), torch.empty(-(-numel // n))

    def run():
        for k in range(1, n):
            dst, src = dist.get_global_rank(group, (me + k) % n), dist.get_global_rank(group, (me - k) % n)
            works = [dist.isend(chunks[(me + k) % n], dst, group=group), dist.irecv(out, src, group=group)]
            for w in works:
                w.wait()
            chunks[me].add_(out)

    return run


def _all_reduce(numel: int, group):
    t = torch.ones(numel)
    return lambda: dist.all_reduce(t, group=group)


def calibrate_collectives(unit_numel: int, nodes: int, nproc: int, reps: int = 3) -> dict:
    """Seconds of each collective flatshard's strategies issue, for one unit of ``unit_numel`` elements."""
    world = dist.group.WORLD
    shard, replicate = _groups(nodes, nproc)
    probes = {
        "all_gather, F=W (spans nodes)": _all_gather(unit_numel, world),
        "reduce_scatter, F=W (spans nodes)": _reduce_scatter(unit_numel, world),
        "all_reduce, W ranks (NO_SHARD)": _all_reduce(unit_numel, world),
    }
    if nproc > 1:
        probes["all_gather, F=P (in node)"] = _all_gather(unit_numel, shard)
        probes["reduce_scatter, F=P (in node)"] = _reduce_scatter(unit_numel, shard)
        probes["all_reduce, replicate R=N (T/P elements)"] = _all_reduce(-(-unit_numel // nproc), replicate)
    out = {}
    for name, fn in probes.items():
        timed(fn, 1)  # warm up: connections, buffers
        out[name] = timed(fn, reps)
    return out
