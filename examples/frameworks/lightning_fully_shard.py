"""Lightning's ModelParallelStrategy driving flatshard's ``fully_shard``: train, save with the strategy's
checkpoint, load, resume. The one change from the same module on PyTorch's FSDP2 is the import in
``configure_model``:

    from flatshard import fully_shard          # was: from torch.distributed.fsdp import fully_shard

Run (Lightning starts the 2 CPU processes itself; no torchrun):

    python examples/frameworks/lightning_fully_shard.py                  # flatshard
    python examples/frameworks/lightning_fully_shard.py --fsdp torch     # the same on PyTorch's FSDP2
    python examples/frameworks/lightning_fully_shard.py --compare --json out.json

``--compare`` runs four fits in one launch: PyTorch's FSDP2 for EPOCHS epochs; flatshard for EPOCHS
epochs; flatshard for half of them, ``trainer.save_checkpoint`` (the strategy's distributed checkpoint:
a directory of DCP files plus Lightning's own ``meta.pt``, written with ``torch.save``), then a new
Trainer and a new module that ``fit(ckpt_path=...)`` loads and resumes to the end. It prints every batch's
loss of the three runs and, with ``--json``, writes each rank's (exit status 1 when flatshard's losses
differ from FSDP2's or the resumed run's from the uninterrupted one's). Gradients accumulate over 2
batches (``accumulate_grad_batches``); Lightning's Trainer reduces them after every batch on both, its
``block_backward_sync`` acting on DDP models only.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import ModelParallelStrategy
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

WORLD = 2
DIM, HIDDEN, BLOCKS = 24, 40, 3
SAMPLES, BATCH, ACCUMULATE = 48, 4, 2  # 6 batches per epoch at W = 2, an optimizer step every 2


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
        return self.head(x).squeeze(-1)


class Regression(L.LightningModule):
    def __init__(self, fsdp: str = "flatshard"):
        super().__init__()
        self.fsdp = fsdp
        torch.manual_seed(0)  # the same initial weights on every rank and in every run
        self.net = Net()
        self.losses: list[float] = []

    def configure_model(self):
        if self.fsdp == "flatshard":
            from flatshard import fully_shard
        else:
            from torch.distributed.fsdp import fully_shard
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(self.net, mesh=mesh)

    def training_step(self, batch, batch_idx):  # noqa: ARG002 - Lightning's signature
        x, y = batch
        loss = nn.functional.mse_loss(self(x), y)
        self.losses.append(loss.item())
        return loss

    def forward(self, x):
        return self.net(x)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


def data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(SAMPLES, DIM, generator=g)
    y = torch.sin(x[:, :3].sum(-1)) + 0.1 * torch.randn(SAMPLES, generator=g)
    # Lightning puts a DistributedSampler under it (shuffled, reseeded each epoch by Lightning)
    return DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=True)


def trainer(epochs: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=ModelParallelStrategy(data_parallel_size=WORLD, tensor_parallel_size=1),
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        accumulate_grad_batches=ACCUMULATE,
    )


def fit(fsdp: str, epochs: int, save: Path | None = None, resume: Path | None = None):
    """One fit; every rank's losses per batch, [rank][batch]."""
    L.seed_everything(0, verbose=False)
    model = Regression(fsdp)
    t = trainer(epochs)
    t.fit(model, data(), ckpt_path=resume)
    if save is not None:
        t.save_checkpoint(save)  # the strategy's checkpoint: DCP shards + meta.pt
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, model.losses)
    return gathered


def table(runs: dict[str, list[list[float]]]) -> str:
    names = list(runs)
    lines = ["step  " + "  ".join(f"{n:>22}" for n in names)]
    for i in range(max(len(r[0]) for r in runs.values())):
        row = []
        for n in names:
            ranks = runs[n]
            row.append(f"{sum(r[i] for r in ranks) / len(ranks):22.9f}" if i < len(ranks[0]) else " " * 22)
        lines.append(f"{i + 1:>4}  " + "  ".join(row))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--fsdp", choices=["flatshard", "torch"], default="flatshard")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--compare", action="store_true", help="FSDP2, flatshard, and flatshard saved and resumed")
    p.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    if not args.compare:
        losses = fit(args.fsdp, args.epochs)
        if dist.get_rank() == 0:
            print(table({args.fsdp: losses}))
        return 0

    half = args.epochs // 2
    runs = {"FSDP2": fit("torch", args.epochs), "flatshard": fit("flatshard", args.epochs)}
    # rank 0's path: the strategy broadcasts it (MASTER_PORT is set by Lightning's launch, alike on every rank)
    ckpt_dir = args.ckpt or Path(tempfile.gettempdir()) / f"flatshard-lightning-{os.environ['MASTER_PORT']}"
    first = fit("flatshard", half, save=ckpt_dir / "half.ckpt")
    rest = fit("flatshard", args.epochs, resume=ckpt_dir / "half.ckpt")
    runs["flatshard saved+resumed"] = [a + b for a, b in zip(first, rest)]
    ok = runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    optimizer_steps = args.epochs * SAMPLES // (BATCH * WORLD * ACCUMULATE)
    if dist.get_rank() == 0:
        print(table(runs))
        print("flatshard == FSDP2 and resumed == uninterrupted, every rank, every step:", ok)
        if args.json:
            figures = {"world": WORLD, "epochs": args.epochs, "accumulate": ACCUMULATE, "equal": ok}
            figures |= {"optimizer_steps": optimizer_steps, "runs": runs}
            args.json.write_text(json.dumps(figures))
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # [Note: process groups at exit] in examples/local_launch.py
    sys.exit(code)
