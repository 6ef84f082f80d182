"""Where a step's time goes: flatshard FULL_SHARD against flatshard NO_SHARD, FSDP2 and DDP, phase by phase,
the cost of one unit's collectives alone, and torch.profiler's busiest operators for flatshard FULL_SHARD (rank 0).

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 -m bench.profile_step [30M|3M] [fp32|bf16]

Each system runs interleaved steps (as the benchmark does); every step is split into forward (to the
loss), backward and optimizer.step(), each timed on rank 0 after a barrier at the step's start; medians
of the steps after two warmups. Then one profiled step of flatshard FULL_SHARD with its collectives'
labels (``flatshard::all_gather (unit)``, ``flatshard::reduce_scatter (unit)``).
"""

from __future__ import annotations

import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from bench import compare
from flatshard.runtime.comm import collectives


def timed_step(system, x, y) -> tuple[float, float, float]:
    dist.barrier()
    t0 = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=system.autocast):
        logits = system.model(x)
    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    system.opt.step()
    system.opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    return t1 - t0, t2 - t1, t3 - t2


def collective_costs(flat_system, rank: int) -> None:
    """flatshard's synchronous collectives (comm/collectives.py: point-to-point on gloo) of one Block unit's size,
    alone (median of 5, rank 0's clock)."""
    unit = next(u for u in flatshard.units(flat_system.model) if not u.is_root)
    world = dist.get_world_size()
    full = torch.randn(unit.padded_numel, dtype=unit.compute_dtype)
    shard = torch.empty(unit.padded_numel // world, dtype=unit.compute_dtype)
    group = dist.group.WORLD
    ops = {
        "all_gather": lambda: collectives.all_gather(full, shard, group),
        "reduce_scatter": lambda: collectives.reduce_scatter(shard, full, group),
        "all_reduce": lambda: collectives.all_reduce(full, group),
    }
    for name, op in ops.items():
        times = []
        for _ in range(5):
            dist.barrier()
            t0 = time.perf_counter()
            op()
            times.append(time.perf_counter() - t0)
        if rank == 0:
            mb = full.numel() * full.element_size() / 2**20
            print(
                f"{name} of one Block unit ({mb:.1f} MiB full, {full.dtype}): {statistics.median(times) * 1e3:.1f} ms"
            )


def main() -> None:
    size = sys.argv[1] if len(sys.argv) > 1 else "30M"
    bf16 = len(sys.argv) > 2 and sys.argv[2] == "bf16"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    gpt, cfg = compare.load_gpt_module(), compare.sizes()[size]
    data = compare.load_corpus()
    systems = compare.make_systems(gpt, cfg, bf16, 1337, None)
    torch.manual_seed(1337)
    no_shard = compare.build_flatshard(gpt, cfg, bf16, strategy="NO_SHARD")
    systems.insert(1, compare.System("flatshard NO_SHARD", no_shard, torch.optim.AdamW(no_shard.parameters(), lr=1e-3)))
    steps, warmup = 8, 2
    phases = {s.name: [] for s in systems}
    for i, (x, y) in enumerate(compare.batches(data, steps, 4, cfg.block_size, rank, world, 1337)):
        k = i % len(systems)
        for s in systems[k:] + systems[:k]:
            t = timed_step(s, x, y)
            if i >= warmup:
                phases[s.name].append(t)
    if rank == 0:
        print(f"{size} {'bf16' if bf16 else 'fp32'} W={world}: median seconds per phase (rank 0)")
        print(f"{'system':<20}{'forward':>10}{'backward':>10}{'optimizer':>10}{'total':>10}")
        for name, ts in phases.items():
            med = [statistics.median(t[j] for t in ts) for j in range(3)]
            print(f"{name:<20}{med[0]:>10.3f}{med[1]:>10.3f}{med[2]:>10.3f}{sum(med):>10.3f}")

    collective_costs(systems[0], rank)
    flat = systems[0]
    x, y = compare.batches(data, 1, 4, cfg.block_size, rank, world, 7)[0]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timed_step(flat, x, y)
    if rank == 0:
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=48))
        labels = {}
        for e in prof.key_averages():
            if e.key.startswith("flatshard::"):
                kind = e.key.split(" ")[0]
                labels[kind] = labels.get(kind, 0.0) + e.cpu_time_total / 1e3
        print("flatshard labels, ms (issue time; asynchronous collectives finish in gloo's threads):", labels)
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
