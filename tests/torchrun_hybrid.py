"""Run under torchrun on two "nodes": HYBRID_SHARD with its default groups (one node = one shard group).

    torchrun --nnodes=2 --nproc-per-node=2 --rdzv-backend=c10d --rdzv-endpoint=HOST:PORT \
        tests/torchrun_hybrid.py OUT_DIR        (once per node)

Each rank trains the tiny GPT beside the single-process reference (parity every step), counts its
collectives by group, and writes what it saw to OUT_DIR/rank<R>.json for the test to check.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

import flatshard  # noqa: E402
from tests.helpers.cases import PER_RANK, build, run_case  # noqa: E402


def main(out_dir: str) -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = run_case(rank, world, "gpt_tie_in_root", "HYBRID_SHARD", "adamw")  # parity, every step of cases.STEPS
    root = flatshard.units(model)[0]
    _, fresh, batch, loss_fn = build("gpt_tie_in_root", "HYBRID_SHARD")
    x, y = batch(0, PER_RANK)
    with fresh.record_comms(events=True) as rec:
        loss_fn(fresh(x), y).backward()
    result = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "shard_size": root.shard_size,
        "replicate_size": root.replicate_size,
        "shard_members": list(root.shard_group_ranks),
        "counts": {f"{e.kind}/{e.group}": rec.count(e.kind, group=e.group) for e in rec.events},
        "units": len(fresh.fsdp_modules(fresh)),
        "parity_steps": 10,
    }
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1])
