"""One rank of one replica group, under torchrun (one torchrun job per group, ``--max-restarts``):
flatshard FULL_SHARD over the group's own ranks (NO_SHARD when the group is one rank), the replica
dimension on torchft through ``flatshard.ft``. bench/faults/replica_faults.py starts it (``torchrun ... -m
bench.faults.replica_faults_worker``); it reads top to bottom (config -> groups -> model -> manager -> loop
-> fingerprint).

Every rank appends JSON lines to ``--log-dir/<replica>-r<rank>.jsonl``: a ``start`` record (pid, the
torchrun restart count) and one record per step (manager step before it, committed, participants,
loss, wall time), and at the end a ``final`` record with the SHA-256 of its parameters and optimizer
state, which bench/faults/replica_faults.py compares across groups.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from examples.gpt import GPT, PRESETS, Block
from flatshard import FullyShardedDataParallel as FSDP
from flatshard import ShardingStrategy, ft, fully_shard
from flatshard.wrap import ModuleWrapPolicy

ROOT = Path(__file__).resolve().parents[2]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0, help="model init and data")
    p.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    p.add_argument("--batch", type=int, default=8, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--front", default="fsdp", choices=["fsdp", "fully_shard"], help="flatshard's front end in a group")
    p.add_argument("--lighthouse", required=True, help="the Lighthouse's address (http://host:port)")
    p.add_argument("--replica-id", required=True, help="this group's name, the same across its restarts")
    p.add_argument("--hostname", default=None, help="the address peers reach this node at")
    p.add_argument("--log-dir", type=Path, required=True)
    p.add_argument("--timeout", type=float, default=20.0, help="seconds before a collective is given up")
    p.add_argument("--step-sleep", type=float, default=0.0, help="seconds of idle per step (paces the run)")
    p.add_argument(
        "--start-file",
        type=Path,
        default=None,
        help="wait for this file before the first step (the launcher writes it once every rank is ready, so no "
        "group starts far ahead of another)",
    )
    p.add_argument(
        "--groups",
        type=int,
        default=2,
        help="how many groups the job has: past --steps, the run goes on "
        "until a step is committed by all of them, so every group finishes with the same state",
    )
    return p.parse_args(argv)


def corpus() -> torch.Tensor:
    """The LICENSE's bytes: text that no one edits while a run goes on (a rank restarted mid-run reads it
    again, and every run must see the same bytes)."""
    text = (ROOT / "LICENSE").read_bytes()
    return torch.frombuffer(bytearray(text), dtype=torch.uint8)


def batch(data: torch.Tensor, seed: int, step: int, replica: str, rank: int, n: int, block: int):
    """The batch of (step, group, rank): the same wherever and however often that step runs."""
    key = int.from_bytes(hashlib.sha256(f"{seed}/{step}/{replica}/{rank}".encode()).digest()[:8], "little")
    gen = torch.Generator().manual_seed(key)
    starts = torch.randint(len(data) - block - 1, (n,), generator=gen)
    windows = data[starts[:, None] + torch.arange(block + 1)].long()
    return windows[:, :-1], windows[:, 1:]


def _bytes(t: torch.Tensor) -> bytes:
    t = t.to_local() if hasattr(t, "to_local") else t  # fully_shard's DTensors: this rank's shard
    return t.detach().reshape(-1).contiguous().view(torch.uint8).numpy().tobytes()


def fingerprint(model: torch.nn.Module, optim: torch.optim.Optimizer) -> dict[str, str]:
    """SHA-256 of this rank's parameter shards and of its optimizer state (every tensor, in order)."""
    params = hashlib.sha256()
    for name, p in model.named_parameters():
        params.update(name.encode())
        params.update(_bytes(p))
    state = hashlib.sha256()
    for i, s in sorted(optim.state_dict()["state"].items()):
        for key, value in sorted(s.items()):
            state.update(f"{i}/{key}".encode())
            if isinstance(value, torch.Tensor):
                state.update(_bytes(value))
            else:
                state.update(repr(value).encode())
    return {"parameters": params.hexdigest(), "optimizer": state.hexdigest()}


def main(argv=None) -> None:
    args = parse_args(argv)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    restart = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    args.log_dir.mkdir(parents=True, exist_ok=True)
    log = open(args.log_dir / f"{args.replica_id}-r{rank}.jsonl", "a", buffering=1)
    log.write(json.dumps({"kind": "start", "pid": os.getpid(), "restart": restart, "t": time.time()}) + "\n")

    # this group's own ranks: flatshard's collectives never leave the group
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    torch.manual_seed(args.seed)
    cfg = PRESETS[args.preset]
    if args.front == "fsdp":
        strategy = ShardingStrategy.FULL_SHARD if world > 1 else ShardingStrategy.NO_SHARD
        model = FSDP(GPT(cfg), sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}))
    else:
        model = GPT(cfg)
        for block in model.blocks:
            fully_shard(block)
        fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    # across groups: the quorum of the groups alive at each step
    manager = ft.Manager(
        model,
        optim,
        min_replica_size=1,
        lighthouse_addr=args.lighthouse,
        replica_id=args.replica_id,
        hostname=args.hostname,
        store_addr=args.hostname or os.environ["MASTER_ADDR"],
        store_port=int(os.environ["MASTER_PORT"]),
        timeout=timedelta(seconds=args.timeout),
        quorum_timeout=timedelta(seconds=120),
    )
    optimizer = ft.Optimizer(manager, optim)
    data = corpus()
    log.write(json.dumps({"kind": "ready", "t": time.time()}) + "\n")
    while args.start_file is not None and not args.start_file.exists():
        time.sleep(0.05)

    participants = 0
    while manager.current_step() < args.steps or participants < args.groups:
        step = manager.current_step()  # a group that heals in this step learns the step in its quorum
        optimizer.zero_grad()  # starts this step's quorum (in the background, beside forward)
        x, y = batch(data, args.seed, step, args.replica_id, rank, args.batch, cfg.block_size)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        loss.backward()
        participating = manager.is_participating()
        committed = optimizer.step()  # averaged over the quorum's groups, stepped only if all commit
        participants = manager.num_participants() if committed else 0
        record = {
            "kind": "step",
            "step": manager.current_step() - 1 if committed else manager.current_step(),  # the step it trained
            "committed": committed,
            "participants": manager.num_participants(),
            "participating": participating,
            "loss": loss.item(),
            "t": time.time(),
        }
        log.write(json.dumps(record) + "\n")
        if args.step_sleep:
            time.sleep(args.step_sleep)

    final = {"kind": "final", "step": manager.current_step(), "t": time.time(), **fingerprint(model, optim)}
    log.write(json.dumps(final) + "\n")
    manager.shutdown(wait=False)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
