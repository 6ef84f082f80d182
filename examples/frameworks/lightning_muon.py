"""Lightning's ModelParallelStrategy training an unmodified ``torch.optim.Muon`` on whole matrices, equal to
the same training in one process, bitwise; saved half way with flatshard's checkpoint and resumed, bitwise.

``fully_shard(..., shard_boundaries="params")`` keeps each parameter whole on one rank (a DTensor on its
owner's one-rank mesh), so Muon orthogonalises each of the blocks' matrices on the rank that owns it, with no
communication in the step, and AdamW takes the rest (head, norms, biases), as torch's Muon documentation
pairs them. The model, data and sampler are examples/frameworks/lightning_fully_shard.py's. Lightning steps
two optimizers in manual optimization only, which has no ``accumulate_grad_batches``: a step every batch.

Checkpoints are flatshard's (``flatshard.checkpoint``: DCP's safetensors shards and a JSON manifest,
committed crash-safely, nothing pickled): Lightning's own ``trainer.save_checkpoint`` and
``fit(ckpt_path=)`` call them through a strategy whose ``save_checkpoint`` and ``load_checkpoint`` do, and
Lightning's loop state (epoch, progress counters) travels as the manifest's ``extra``.
``--checkpoint lightning`` keeps Lightning's own (DCP files and a pickled ``meta.pt``), which handles the
owners' one-rank meshes as well.

Every rank's optimizers hold every parameter of their kind, other ranks' too (empty DTensors here, whose
ops do nothing), so their parameter groups are alike on every rank; each rank steps what it owns
(``flatshard.owned_named_parameters``). Lightning's own checkpoint needs that: its save (through DCP)
keeps one rank's ``param_groups``, so with optimizers built on each rank's own parameters only its load
reports success and the next step fails on a rank with ``KeyError: 'lr'`` (it was given another rank's
groups). ``flatshard.checkpoint`` keeps each rank's groups where they differ (and refuses them at another
world size), but the recipe keeps them alike so that either checkpoint serves; both strategies here
refuse, on every rank and saying why, optimizers whose groups differ.

Run (Lightning starts the 2 CPU processes itself; no torchrun):

    python examples/frameworks/lightning_muon.py                       # train, print the losses
    python examples/frameworks/lightning_muon.py --compare --json out.json
    python examples/frameworks/lightning_muon.py --compare --checkpoint lightning

``--compare`` runs two fits in one launch: EPOCHS epochs, saving at the end of the first half (where
ModelCheckpoint saves), then a new Trainer and module resumed from that checkpoint to the end. Then one
process replays the batches every rank saw (recorded in ``training_step``) on the unsharded model with
the same optimizers: each step's gradient is the mean of the ranks' batch gradients, summed as flatshard's
reduction sums them and then divided by W, so the reduction order is the same and the runs compare
bitwise: every rank's loss at every step and every parameter at the end, and the resumed run against the
uninterrupted one. Every rank and the single process compute with one intra-op thread (a kernel's sums
depend on the thread count; Lightning's launcher sets one on rank 0 only). It also records what the
strategies say to owned-only optimizers. Exit status 1 unless every comparison is equal.
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
from lightning_fully_shard import BATCH, SAMPLES, WORLD, Net, data, table  # the same model and data
from torch import nn

import flatshard
from flatshard import checkpoint

EPOCHS = 2  # 6 steps per epoch at W = 2; saved after the first


def is_hidden_matrix(name: str, p: nn.Parameter) -> bool:
    return name.startswith("blocks.") and p.ndim == 2  # DTensors have the full shape on every rank


def optimizers(net: nn.Module, named=None) -> list[torch.optim.Optimizer]:
    """Muon on the blocks' matrices, AdamW on the rest (head, norms, biases); ``named`` defaults to every
    parameter (on a sharded net, other ranks' parameters as empty DTensors)."""
    named = list(named if named is not None else net.named_parameters())
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    return [
        torch.optim.Muon(hidden, lr=0.02, weight_decay=0.01, adjust_lr_fn="match_rms_adamw"),
        torch.optim.AdamW(rest, lr=0.02, betas=(0.9, 0.95)),
    ]


class MuonRegression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False  # Lightning steps several optimizers only in manual optimization
        torch.manual_seed(0)  # the same initial weights on every rank, in every run and in the single process
        self.net = Net()
        self.losses: list[float] = []
        self.batches: list[tuple[torch.Tensor, torch.Tensor]] = []

    def configure_model(self):
        torch.set_num_threads(1)  # every rank alike (Lightning's launcher sets it on rank 0 only)
        mesh = self.device_mesh["data_parallel"]
        for block in self.net.blocks:
            flatshard.fully_shard(block, mesh=mesh, shard_boundaries="params")
        flatshard.fully_shard(self.net, mesh=mesh, shard_boundaries="params")

    def configure_optimizers(self):
        return optimizers(self.net)

    def training_step(self, batch, batch_idx):  # noqa: ARG002 - Lightning's signature
        x, y = batch
        loss = nn.functional.mse_loss(self.net(x), y)
        self.manual_backward(loss)
        for opt in self.optimizers():
            opt.step()  # no communication: each rank steps the matrices it owns
        self.net.zero_grad(set_to_none=True)  # through the model: other ranks' (empty) parameters too
        self.losses.append(loss.item())
        self.batches.append((x.clone(), y.clone()))


def same_groups(module: nn.Module, optimizers: list) -> None:
    """Refuse, on every rank, optimizers whose parameter groups differ across ranks (collective)."""
    names = {id(p): n for n, p in module.named_parameters()}
    mine = [[names.get(id(p), "?") for p in g["params"]] for o in optimizers for g in o.param_groups]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    differ = [r for r, groups in enumerate(every) if groups != every[0]]
    if differ:
        raise RuntimeError(
            f"the optimizers of ranks {differ} hold other parameters than rank 0's: Lightning's checkpoint keeps "
            "one rank's param_groups, so the others would load another rank's groups. Give every rank's "
            "optimizers every parameter of their kind (those other ranks own are empty DTensors there, "
            "whose ops do nothing), not flatshard.owned_named_parameters alone"
        )


class CheckedModelParallel(ModelParallelStrategy):
    """Lightning's ModelParallelStrategy and its own checkpoint (DCP files + meta.pt), refusing optimizers
    whose groups differ across ranks."""

    def save_checkpoint(self, checkpoint, filepath, storage_options=None):
        same_groups(self.lightning_module, self.optimizers)
        super().save_checkpoint(checkpoint, filepath, storage_options)

    def load_checkpoint(self, checkpoint_path, weights_only=None):
        same_groups(self.lightning_module, self.optimizers)
        return super().load_checkpoint(checkpoint_path, weights_only)


class FlatshardCheckpoints(CheckedModelParallel):
    """ModelParallelStrategy whose checkpoints are flatshard's: the model and the optimizers' state in DCP's
    safetensors shards, Lightning's loop state (epoch, progress counters: JSON) as the manifest's ``extra``."""

    def save_checkpoint(self, checkpoint_dict, filepath, storage_options=None):
        if storage_options is not None:
            raise TypeError("FlatshardCheckpoints.save_checkpoint takes no storage_options")
        same_groups(self.lightning_module, self.optimizers)
        path = self.broadcast(str(filepath))  # rank 0's, as Lightning's own save does
        rest = {k: v for k, v in checkpoint_dict.items() if k not in ("state_dict", "optimizer_states")}
        step = checkpoint_dict["global_step"]
        checkpoint.save(path, self.lightning_module, self.optimizers, step=step, extra=rest)

    def load_checkpoint(self, checkpoint_path, weights_only=None):  # noqa: ARG002 - nothing is unpickled
        same_groups(self.lightning_module, self.optimizers)
        path = self.broadcast(str(checkpoint_path))
        _, rest = checkpoint.load(path, self.lightning_module, self.optimizers)
        return rest  # what Lightning restores its loops from; the model and optimizers are loaded


class SaveAt(L.Callback):
    """``trainer.save_checkpoint(where())`` at the end of epoch ``epoch`` (where ModelCheckpoint saves)."""

    def __init__(self, epoch: int, where):
        self.epoch, self.where = epoch, where

    def on_train_epoch_end(self, trainer, pl_module):  # noqa: ARG002 - Lightning's signature
        if trainer.current_epoch + 1 == self.epoch:
            trainer.save_checkpoint(self.where())


def fit(how: str, save=None, resume: Path | None = None) -> tuple[MuonRegression, list]:
    """One fit of EPOCHS epochs (``save``: a function giving the path to save at half way, ``resume``: a path
    to resume from); the module and every rank's (losses, batches, owned parameters)."""
    L.seed_everything(0, verbose=False)
    model = MuonRegression()
    strategy = (FlatshardCheckpoints if how == "flatshard" else CheckedModelParallel)(
        data_parallel_size=WORLD, tensor_parallel_size=1
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=WORLD,
        strategy=strategy,
        max_epochs=EPOCHS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=[SaveAt(EPOCHS // 2, save)] if save else [],
    )
    trainer.fit(model, data(), ckpt_path=resume)
    owned = {n: p.to_local().detach().clone() for n, p in flatshard.owned_named_parameters(model.net)}
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, (model.losses, model.batches, owned))
    return model, every


def single_process(batches: list[list[tuple]]) -> tuple[list[list[float]], dict]:
    """The unsharded model and the same optimizers over the global batch of every step (``batches[rank][step]``):
    each rank's loss, and the final parameters."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    net = Net()
    opts, params = optimizers(net), list(net.parameters())
    losses: list[list[float]] = [[] for _ in batches]
    for step in range(len(batches[0])):
        total = None
        for rank, rank_batches in enumerate(batches):
            x, y = rank_batches[step]
            loss = nn.functional.mse_loss(net(x), y)
            losses[rank].append(loss.item())
            grads = torch.autograd.grad(loss, params)
            total = list(grads) if total is None else [a + b for a, b in zip(total, grads)]  # the collective's sum
        for p, g in zip(params, total):
            p.grad = g / len(batches)
        for o in opts:
            o.step()
        net.zero_grad(set_to_none=True)
    return losses, {n: p.detach() for n, p in net.named_parameters()}


def same_tensors(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(t, b[n]) for n, t in a.items())


def refusal(model: MuonRegression) -> str:
    """What the strategies say to optimizers built on this rank's own parameters only."""
    try:
        same_groups(model, optimizers(model.net, flatshard.owned_named_parameters(model.net)))
    except RuntimeError as exc:
        return f"RuntimeError: {exc}"
    return "no error"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--compare", action="store_true", help="fit, save half way and resume, against one process")
    p.add_argument("--checkpoint", choices=["flatshard", "lightning"], default="flatshard")
    p.add_argument("--ckpt", type=Path, default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    if not args.compare:
        model, every = fit(args.checkpoint)
        if dist.get_rank() == 0:
            print("per-rank losses:", [[round(x, 6) for x in losses] for losses, _, _ in every])
        return 0

    def half() -> Path:  # rank 0's is used; MASTER_PORT is set by Lightning's launch, alike on every rank
        default = Path(tempfile.gettempdir()) / f"flatshard-lightning-muon-{os.environ['MASTER_PORT']}"
        return (args.ckpt or default) / "half"

    model, full = fit(args.checkpoint, save=half)  # saves at the end of the first half
    _, rest = fit(args.checkpoint, resume=half())
    losses, params = [r[0] for r in full], {n: t for r in full for n, t in r[2].items()}
    reference, reference_params = single_process([r[1] for r in full])
    # the saved run's first half, then the resumed run's second half
    resumed = [r[0][: len(r[0]) // 2] + s[0] for r, s in zip(full, rest)]
    resumed_params = {n: t for r in rest for n, t in r[2].items()}
    figures = {
        "world": WORLD,
        "epochs": EPOCHS,
        "optimizer_steps": EPOCHS * SAMPLES // (BATCH * WORLD),  # of each optimizer, on every rank
        "checkpoint": args.checkpoint,
        "losses_equal": losses == reference,
        "params_equal": same_tensors(params, reference_params),
        "resumed_equal": resumed == losses and same_tensors(resumed_params, params),
        "refusal": refusal(model),
        "owned": [sorted(r[2]) for r in full],  # the parameters each rank steps, whole
        "runs": {"single process": reference, "flatshard": losses, "flatshard saved+resumed": resumed},
    }
    figures["equal"] = figures["losses_equal"] and figures["params_equal"] and figures["resumed_equal"]
    if dist.get_rank() == 0:
        print(table(figures["runs"]))
        for key in ("losses_equal", "params_equal", "resumed_equal", "refusal"):
            print(f"{key}: {figures[key]}")
        if args.json:
            args.json.write_text(json.dumps(figures))
    return 0 if figures["equal"] else 1


if __name__ == "__main__":
    code = main()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    gc.collect()  # [Note: process groups at exit] in examples/local_launch.py
    sys.exit(code)
