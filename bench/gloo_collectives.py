"""One Block unit's collectives alone on gloo (30M GPT: 4,923,520 elements): gloo's own all-gather,
reduce-scatter and all-reduce against flatshard's (comm/collectives.py: point-to-point exchanges on gloo,
the same bytes per rank). Median of 9, rank 0's clock; the results are checked against gloo's.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 -m bench.gloo_collectives
"""

import statistics
import time

import torch
import torch.distributed as dist

from flatshard.runtime.comm import collectives


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world, rank = dist.get_world_size(), dist.get_rank()
    group = dist.group.WORLD
    n = 4923520 // world * world
    for dtype in (torch.float32, torch.bfloat16):
        full = (torch.arange(n, dtype=torch.float32) % 251 * (rank + 1)).to(dtype)
        shard = full[rank * (n // world) : (rank + 1) * (n // world)].clone()
        gathered, reduced = torch.empty_like(full), torch.empty_like(shard)
        ops = {
            "gloo all_gather_into_tensor": lambda: dist.all_gather_into_tensor(gathered, shard),
            "flatshard all_gather": lambda: collectives.all_gather(gathered, shard, group),
            "gloo reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(reduced, full),
            "flatshard reduce_scatter": lambda: collectives.reduce_scatter(reduced, full, group),
            "gloo all_reduce (in place)": lambda: dist.all_reduce(full.clone()),
        }
        for name, op in ops.items():
            times = []
            for _ in range(9):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            if rank == 0:
                print(f"W={world} {dtype} {name}: {statistics.median(times) * 1e3:.1f} ms", flush=True)
        expect_g, expect_r = torch.empty_like(full), torch.empty_like(shard)
        dist.all_gather_into_tensor(expect_g, shard)
        dist.reduce_scatter_tensor(expect_r, full)
        collectives.all_gather(gathered, shard, group)
        collectives.reduce_scatter(reduced, full, group)
        assert torch.equal(gathered, expect_g) and torch.equal(reduced, expect_r), (
            "flatshard's results differ from gloo's"
        )
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
