"""Accelerate and flatshard's ``fully_shard`` on CPU: what Accelerate refuses, and what runs.

Accelerate does not run FSDP on CPU. ``Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(
fsdp_version=2))`` (or ``accelerate launch --cpu``) sets its distributed type to MULTI_CPU, which is not
among the types its FSDP branch accepts (accelerate/state.py): the plugin is dropped without a warning
(``accelerator.state`` then has no ``fsdp_plugin``), and ``prepare`` wraps the model in
DistributedDataParallel. A model already sharded by ``fully_shard`` (flatshard's or PyTorch's) then fails
inside DDP's constructor on its DTensor parameters. ``--show-refusal`` prints all three.

What a user can do on CPU: shard the model with ``flatshard.fully_shard`` and give ``prepare`` the
optimizer and the data loader only; ``accelerator.backward`` and Accelerate's data sharding work as
usual. Checkpoints: DCP's ``get_state_dict`` / ``set_state_dict`` (as for any fully_shard model), here
saved after half the steps, loaded into a fresh model and optimizer, and resumed.

On GPUs (not run here): Accelerate's FSDP2 path leaves a model that already is a
``torch.distributed.fsdp.FSDPModule`` as it is (``fsdp2_prepare_model``), which flatshard's modules are,
so ``flatshard.fully_shard`` applied before ``accelerator.prepare(model, optimizer)`` would keep
flatshard's sharding under the plugin.

Run (starts 2 local CPU ranks itself; or ``accelerate launch --cpu --num_processes 2 <this file>``):

    python examples/frameworks/accelerate_fully_shard.py --show-refusal
    python examples/frameworks/accelerate_fully_shard.py --compare --json out.json

``--compare`` shows the refusal, then trains the same loop with PyTorch's ``fully_shard`` and with
flatshard's, and flatshard again saved at half way and resumed, and exits 1 unless every rank's losses
are equal.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.utils.data import DataLoader, TensorDataset

WORLD = 2
DIM, HIDDEN, BLOCKS = 24, 40, 3
SAMPLES, BATCH, EPOCHS = 48, 4, 2  # 6 steps per epoch at W = 2


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(BLOCKS))
        self.head = nn.Linear(DIM, 1)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def sharded_net(fsdp: str) -> Net:
    if fsdp == "flatshard":
        from flatshard import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    net = Net()
    for block in net.blocks:
        fully_shard(block)
    fully_shard(net)
    return net


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = torch.sin(x[:, :3].sum(-1, keepdim=True)) + 0.1 * torch.randn(SAMPLES, 1, generator=g)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)


def show_refusal() -> list[str]:
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin

    acc = Accelerator(cpu=True, fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))
    lines = [
        f"distributed type: {acc.distributed_type}",
        f"FSDP plugin kept: {'fsdp_plugin' in acc.state.__dict__}",
        f"a plain model after prepare: {type(acc.prepare(Net())).__name__}",
    ]
    try:
        acc.prepare(sharded_net("flatshard"))
        lines.append("a flatshard-sharded model after prepare: accepted")
    except RuntimeError as exc:
        lines.append(f"a flatshard-sharded model after prepare: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    return lines


def train(fsdp: str, ckpt: Path | None = None, save_at: int = 0, resume: bool = False) -> list[float]:
    """EPOCHS epochs of the Accelerate loop; this rank's loss per step. ``save_at``: save a DCP checkpoint
    after that step and stop; ``resume``: load it and train the steps after it."""
    from accelerate import Accelerator

    acc = Accelerator(cpu=True)  # no FSDP plugin: on CPU it would be dropped (see the docstring)
    net = sharded_net(fsdp)
    opt = torch.optim.SGD(net.parameters(), lr=0.02, momentum=0.9)
    opt, loader = acc.prepare(opt, data())  # not the model: prepare would wrap it in DDP
    start = 0
    if resume:
        state = {"model": {}, "optim": {}}
        state["model"], state["optim"] = get_state_dict(net, opt.optimizer)
        dcp.load(state, checkpoint_id=str(ckpt))
        set_state_dict(net, opt.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        start = save_at
    losses, step = [], 0
    for _ in range(EPOCHS):
        for x, y in loader:
            step += 1
            if step <= start:
                continue
            loss = nn.functional.mse_loss(net(x), y)
            acc.backward(loss)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
            if step == save_at and not resume:
                model_sd, optim_sd = get_state_dict(net, opt.optimizer)
                dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(ckpt))
                return losses
    return losses


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=WORLD, help="ranks to start when not under a launcher")
    p.add_argument("--fsdp", choices=["flatshard", "torch"], default="flatshard")
    p.add_argument("--show-refusal", action="store_true", help="what Accelerate does with the FSDP2 plugin on CPU")
    p.add_argument("--compare", action="store_true", help="FSDP2, flatshard, and flatshard saved and resumed")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    if "RANK" not in os.environ:  # not under a launcher: start the ranks, every socket on 127.0.0.1
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from local_launch import run_local
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        with contextlib.suppress(ChildFailedError):
            run_local(args.nproc, os.path.abspath(__file__), sys.argv[1:])
            return 0
        return 1

    refusal = show_refusal() if args.show_refusal or args.compare else []
    if dist.get_rank() == 0:
        print("\n".join(refusal))
    if args.show_refusal:
        return 0
    if not args.compare:
        runs = {args.fsdp: train(args.fsdp)}
    else:
        runs = {"FSDP2": train("torch"), "flatshard": train("flatshard")}
        half = len(runs["flatshard"]) // 2
        ckpt = Path(tempfile.gettempdir()) / f"flatshard-accelerate-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
        first = train("flatshard", ckpt, save_at=half)
        runs["flatshard saved+resumed"] = first + train("flatshard", ckpt, save_at=half, resume=True)
    every_rank = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, runs)
    ok = not args.compare or all(
        r["flatshard"] == r["FSDP2"] and r["flatshard saved+resumed"] == r["flatshard"] for r in every_rank
    )
    if dist.get_rank() == 0:
        names = list(runs)
        print("step  " + "  ".join(f"{n:>24}" for n in names))
        for i in range(len(runs[names[0]])):
            mean = [sum(r[n][i] for r in every_rank) / len(every_rank) for n in names]
            print(f"{i + 1:>4}  " + "  ".join(f"{m:24.9f}" for m in mean))
        if args.compare:
            print("flatshard == FSDP2 and resumed == uninterrupted, every rank, every step:", ok)
        if args.json:
            per_rank = {n: [r[n] for r in every_rank] for n in names}
            figures = {"world": dist.get_world_size(), "equal": ok, "refusal": refusal, "runs": per_rank}
            args.json.write_text(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # [Note: process groups at exit] in examples/local_launch.py
    sys.exit(code)
