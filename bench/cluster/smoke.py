"""A small job for the emulated cluster's test (tests/test_cluster.py), run in every rank by torchrun:

    python -m bench.cluster run --nodes 2 --nproc 2 --rate 200mbit -- -m bench.cluster.smoke --out DIR

flatshard HYBRID_SHARD with its default groups (F = LOCAL_WORLD_SIZE: one shard group per node, the
replicate groups across the link) trains examples/gpt.py's tiny GPT for a few steps. Each rank also
trains a plain copy on the *global* batch (every rank's rows, the same seed) and records, every step,
its loss on its own rows and that reference's loss. Around the training steps (between barriers)
local rank 0 of each node reads its link interface's byte counters, so the bytes that crossed the
slow link are known. Each rank writes DIR/rank<R>.json; ``--sleep S`` only sleeps (a job to time out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

import flatshard
from bench import compare  # the GPT, the data and the batches of the benchmark
from flatshard import FullyShardedDataParallel as FSDP
from flatshard import ShardingStrategy
from flatshard.wrap import ModuleWrapPolicy

LINK_STATS = Path("/sys/class/net/fs0/statistics")
KINDS = (("all_gather", "shard"), ("reduce_scatter", "shard"), ("all_reduce", "replicate"))


def link_counters() -> dict[str, int]:
    if not LINK_STATS.exists():
        return {"tx": 0, "rx": 0}
    return {k: int((LINK_STATS / f"{k}_bytes").read_text()) for k in ("tx", "rx")}


def train(out: Path, steps: int) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    gpt, cfg = compare.load_gpt_module(), compare.sizes()["tiny"]
    torch.manual_seed(0)
    model = FSDP(
        gpt.GPT(cfg), sharding_strategy=ShardingStrategy.HYBRID_SHARD, auto_wrap_policy=ModuleWrapPolicy({gpt.Block})
    )
    torch.manual_seed(0)
    ref = gpt.GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    data = compare.load_corpus()
    every = [compare.batches(data, steps, 2, cfg.block_size, r, world, seed=7) for r in range(world)]
    losses, ref_losses = [], []
    dist.barrier()
    before = link_counters()
    with model.record_comms() as rec:
        for step in range(steps):
            x, y = every[rank][step]
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            gx = torch.cat([every[r][step][0] for r in range(world)])
            gy = torch.cat([every[r][step][1] for r in range(world)])
            ref_loss = F.cross_entropy(ref(gx).flatten(0, 1), gy.flatten())
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            ref_losses.append(ref_loss.item())
    dist.barrier()
    after = link_counters()
    root = flatshard.units(model)[0]
    result = {
        "rank": rank,
        "node": int(os.environ["GROUP_RANK"]),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "shard_members": list(root.shard_group_ranks),
        "replicate_size": root.replicate_size,
        "units": len(flatshard.units(model)),
        "steps": steps,
        "counts": {f"{k}/{g}": rec.count(k, group=g) for k, g in KINDS},
        "wire_bytes": {g: rec.wire_bytes(group=g) for g in ("shard", "replicate")},
        "losses": losses,
        "ref_losses": ref_losses,
        "link_bytes": {k: after[k] - before[k] for k in after},
    }
    (out / f"rank{rank}.json").write_text(json.dumps(result))
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.smoke", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--sleep", type=float, help="only sleep this many seconds (a job for the timeout test)")
    args = p.parse_args(argv)
    if args.sleep is not None:
        time.sleep(args.sleep)
        return 0
    train(args.out, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
