"""CPU offload of one strategy at one sharding factor: device and host bytes, copies, CPU optimizer.

[Note: planner CPU offload model]
flatshard's ``CPUOffload(offload_params=True)`` (unit.py) keeps each unit's flat shard in host memory
(pinned when computing on CUDA), so the shard views, their gradients (grad shards) and the optimizer
state are host tensors and the optimizer steps on the CPU. Before every gather the shard is copied
host->device in the compute dtype; each reduced gradient shard is copied device->host after its
reduction. Collectives are unchanged (comm.py). Per rank, with S_u (the largest shard under
``shard_boundaries`` "rows" and "params"), g_u, ug_u as in [Note: planner memory model] and c, r, m
the compute, reduce and grad-shard bytes (host and copy figures are the largest rank's):

host (per rank): params + grads + optimizer = the non-offload ``steady`` (S_u * (master + grad
    shard + optimizer) summed, plus AdamW's step tensors). pinned: the flat shards (params).
host (per node): per rank * ranks per node (min(G, W)): the node's ranks share its host memory.
device: no persistent parameter state. The transients of the memory model, except that the F = 1
    in-place case does not exist (the unsharded flat is always a device buffer of its own:
    g_u = N_u * c, N_u = F * S_u for "flat"), plus
    staging = the largest min(d + 1, M) of S_u * c: the host->device copy a gather reads from
        (alive until its all-gather is done; with prefetch depth d up to d + 1 are in flight);
        counted at the forward peak, and at the backward peak of the strategies that gather again
        in backward (FULL_SHARD, HYBRID_SHARD);
    reduced = max_u S_u * (r + cast): the reduce-scatter's output before its copy back, and its
        cast to the master dtype when the reduce dtype differs (cast = m, else 0); at F = 1 the
        all-reduced gradient is ug_u itself, so only the cast counts; counted at the backward peak.
    forward_peak = activations + forward transient + staging;
    backward_peak = activations + backward transient + reduced (+ staging when regathering);
    device_peak = max. Staging and reduced are counted at every backward position, so the backward
    peak is an upper bound (at d = 0 the cast happens after the unit is resharded).
fits: device_peak <= (1 - headroom) * device memory AND host per node <= (1 - headroom) * host
    memory per node; with host memory unknown, ``host_fits`` and ``fits`` are None when the device
    fits (False when it does not).

Time per step, added to the non-offload ``expected`` time:
    host_to_device = sum of S_u * c over every gather (M in forward, plus the backward regathers of
        FULL_SHARD and HYBRID_SHARD: the same count as the all-gathers; at F = 1 a copy per unit per
        forward although nothing is all-gathered);
    device_to_host = sum_u S_u * m (one reduced shard per unit per step);
    copy_s = (host_to_device + device_to_host) / pcie_bandwidth (per rank per direction);
    optimizer_bytes = 2 * (params + optimizer) + grads per rank (read and write master and state,
        read the gradient: the minimum; 28 bytes per element with Adam in fp32);
    optimizer_s = optimizer_bytes * ranks per node / host_bandwidth (the node's ranks step at once
        and share its memory bandwidth).
None of this overlaps anything in flatshard today: the copies run on the compute stream (the
device->host copy is blocking), and the optimizer step follows backward. The non-offload time does
not count the device optimizer step, so the difference between the two is a slight overstatement.

Not counted: the optimizer's temporaries (CPU Adam's denominators), a host-side dtype conversion
buffer (with a dtype change PyTorch may convert on the host before the copy), the ranks' own host
footprint (Python, CUDA context, data loaders: what the headroom is for), the full model a rank may
materialize in host memory before wrapping, per-copy latency, PCIe links shared by two GPUs behind
one switch (pass a lower ``pcie_bandwidth``), and limits on pinned memory (``ulimit -l``).
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.planner.inputs import PlanInputs, Strategy
from flatshard.planner.memory import MemoryEstimate, transients, units_of


@dataclass(frozen=True)
class OffloadEstimate:
    """One plan with CPU offload. Device figures are per rank; host figures per rank and per node;
    copy bytes per rank per step; seconds per step (``step_time_s`` includes the non-offload time)."""

    gather_buffer: int
    unsharded_grad: int
    staging: int
    reduced: int
    activations: int
    forward_peak: int
    backward_peak: int
    device_peak: int
    device_fits: bool
    host_params: int
    host_grads: int
    host_optimizer: int
    host_per_rank: int
    host_per_node: int
    host_pinned: int
    host_fits: bool | None
    fits: bool | None
    host_to_device: int
    device_to_host: int
    copy_s: float
    optimizer_bytes: int
    optimizer_s: float
    step_time_s: float


def regathers(unit_is_root: bool, strategy: Strategy, f: int) -> bool:
    """Whether a unit is gathered again in backward: FULL_SHARD and HYBRID_SHARD, the root excepted."""
    return f > 1 and strategy.reshard_after_forward and not unit_is_root


def offload_estimate(
    inputs: PlanInputs, strategy: Strategy, f: int, memory: MemoryEstimate, expected_s: float
) -> OffloadEstimate:
    """The offload figures of ``strategy`` at F; ``memory`` is its non-offload estimate (for the host
    parts and the activations), ``expected_s`` its non-offload step time."""
    rec, d = inputs.recipe, inputs.prefetch_depth
    units = units_of(inputs, f)
    c, r, m = rec.compute_bytes, rec.reduce_bytes, rec.grad_shard_bytes
    gathered = [u.padded * c for u in units]
    ugrad = [u.padded * r for u in units]
    fwd, bwd, buffer = transients(units, gathered, ugrad, strategy, d)
    shards_c = sorted((u.shard * c for u in units), reverse=True)
    staging = sum(shards_c[: d + 1])
    cast = m if m != r else 0
    out = r if f > 1 else 0
    reduced = max((u.shard * (out + cast) for u in units), default=0)
    again = any(regathers(u.is_root, strategy, f) for u in units)
    acts = memory.activations
    forward_peak = acts + fwd + staging
    backward_peak = acts + bwd + reduced + (staging if again else 0)
    device_peak = max(forward_peak, backward_peak)
    device_fits = device_peak <= inputs.budget_bytes

    per_rank = memory.steady
    per_node = per_rank * inputs.ranks_per_node
    budget = inputs.host_budget_bytes
    host_fits = None if budget is None else per_node <= budget
    fits = False if not device_fits else host_fits

    h2d = sum(u.shard * c * (2 if regathers(u.is_root, strategy, f) else 1) for u in units)
    d2h = sum(u.shard * m for u in units)
    copy_s = (h2d + d2h) / inputs.pcie_bandwidth
    opt_bytes = 2 * (memory.params + memory.optimizer) + memory.grads
    opt_s = opt_bytes * inputs.ranks_per_node / inputs.host_bandwidth
    return OffloadEstimate(
        buffer,
        max(ugrad, default=0),
        staging,
        reduced,
        acts,
        forward_peak,
        backward_peak,
        device_peak,
        device_fits,
        memory.params,
        memory.grads,
        memory.optimizer,
        per_rank,
        per_node,
        memory.params,
        host_fits,
        fits,
        h2d,
        d2h,
        copy_s,
        opt_bytes,
        opt_s,
        expected_s + copy_s + opt_s,
    )
