"""One Block unit's collectives alone on gloo (30M GPT: 4,923,520 elements), two ways each: what flatshard
uses now (all_gather_into_tensor, reduce_scatter_tensor) against W in-place broadcasts into the chunks
of the output and an in-place all_reduce of the full-size tensor. Median of 9, rank 0's clock.

    .venv/bin/python -m torch.distributed.run --standalone --nproc-per-node=2 bench/gloo_collectives.py
"""
import statistics
import time

import torch
import torch.distributed as dist


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    world = dist.get_world_size()
    n = 4923520 // world * world
    for dtype in (torch.float32, torch.bfloat16):
        full = torch.randn(n).to(dtype)
        shard = torch.empty(n // world, dtype=dtype)
        chunks = list(full.chunk(world))  # rank r's shard would be written (cast) straight into chunks[r]
        ops = {
            "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
            "W broadcasts into chunks": lambda: [dist.broadcast(chunks[r], src=r) for r in range(world)],
            "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
            "all_reduce (in place)": lambda: dist.all_reduce(full),
        }
        for name, op in ops.items():
            times = []
            for _ in range(9):
                dist.barrier()
                t0 = time.perf_counter()
                op()
                times.append(time.perf_counter() - t0)
            if dist.get_rank() == 0:
                print(f"W={world} {dtype} {name}: {statistics.median(times) * 1e3:.1f} ms", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
