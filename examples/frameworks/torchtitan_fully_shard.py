"""torchtitan's llama3 debug model sharded by flatshard's ``fully_shard``, through torchtitan's own FSDP
function, loss, optimizer, LR schedule, data loader and checkpointer, on CPU.

What a torchtitan user changes: the one import of ``fully_shard`` in torchtitan/distributed/fsdp.py,

    from flatshard import fully_shard      # was: fully_shard, in `from torch.distributed.fsdp import (...)`

(or, without editing torchtitan, ``torchtitan.distributed.fsdp.fully_shard = flatshard.fully_shard``
before the Trainer is built: ``apply_fsdp_to_decoder`` reads that module's name at each call), and, on
torchtitan 0.3.0 with more than one data-parallel rank, ``--parallelism.spmd_backend partial_dtensor``:
by torchtitan's code, its default backend (``spmd_types``) passes ``dp_mesh_dims=``, which flatshard's
fully_shard builds for DTensor parameters (tests/test_dp_mesh_dims.py) but which has not run in this
recipe. The Trainer so changed has not run here (it needs a GPU, below).
torchtitan finds its FSDP modules with ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` (to set the
gradient divide factor to 1 and to drive its chunked loss's head), which flatshard's modules satisfy.

Why this script and not ``torchtitan.train``: torchtitan's Trainer does not run on CPU. With no
accelerator its device type falls back to "cuda" (torchtitan/tools/utils.py), so ``Trainer.__init__``
fails at ``torch.cuda.set_device`` on a CPU build of torch; its ParallelDims builds a "cuda" mesh and its
metrics read CUDA memory statistics. So this script builds the Trainer's pieces from the debug model's
own config (``llama3_debugmodel()``) on a CPU mesh over gloo and runs the steps of ``Trainer.train_step``
(global token count, torchtitan's chunked loss, backward, torchtitan's ``clip_grad_norm_``, optimizer and
LR scheduler steps, ``CheckpointManager.save``), with the debug config's selective activation
checkpointing. One departure forced by CPU: the debug model's attention is FlexAttention, which has no
backward on CPU ("FlexAttention does not support backward on CPU"), so its layers use torchtitan's
ScaledDotProductAttention (causal, not masked at document boundaries); and one chosen: fp32 compute
instead of the config's bf16, so the runs compare to the bit. torchtitan's data (tests/assets/c4_test)
and tokenizer are not in its wheel: a small tokenizer and text set are made here (``make_assets``).

Run (starts 2 local CPU ranks itself, or run it under ``torchrun --nproc-per-node 2``):

    python examples/frameworks/torchtitan_fully_shard.py --compare --json out.json

``--compare`` runs, in one launch: PyTorch's FSDP2 for STEPS steps; flatshard for STEPS steps; flatshard
for half of them with torchtitan's checkpointing on (``CheckpointManager``: DCP files per step folder),
then a fresh model, optimizer, scheduler and data loader that ``CheckpointManager.load()`` restores and
that train to the end. It prints the losses and gradient norms torchtitan logs, exits 1 when flatshard's
differ from FSDP2's or the resumed run's from the uninterrupted one's.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

WORLD = 2
SEQ_LEN, LOCAL_BATCH = 64, 2

WORDS = (
    "the a of shard rank gather reduce scatter gradient parameter unit flat model train step loss optimizer "
    "memory device mesh tensor layer block head embedding norm attention forward backward"
).split()


def make_assets(folder: Path) -> tuple[Path, Path]:
    """A byte-level BPE tokenizer (tokenizer.json, tokenizer_config.json) and a text set in c4_test's
    format (JSON lines with "text"), made from a fixed seed: the same files on every run."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok_dir, data_dir = folder / "tokenizer", folder / "c4_test"
    if (tok_dir / "tokenizer.json").exists() and (data_dir / "data.json").exists():
        return tok_dir, data_dir
    tok_dir.mkdir(parents=True, exist_ok=True)
    data_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    texts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(200, 400))) + "." for _ in range(200)]
    (data_dir / "data.json").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=512, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(texts, trainer)
    tok.save(str(tok_dir / "tokenizer.json"))
    config = {"bos_token": specials[0], "eos_token": specials[1], "add_bos_token": True, "add_eos_token": True}
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    return tok_dir, data_dir


class TrainState:
    """What torchtitan's Trainer saves of itself ("train_state"): the step and the tokens seen."""

    def __init__(self):
        self.step, self.ntokens_seen = 0, 0

    def state_dict(self):
        return {"step": self.step, "ntokens_seen": self.ntokens_seen}

    def load_state_dict(self, state):
        self.step, self.ntokens_seen = state["step"], state["ntokens_seen"]


def build(fsdp: str, steps: int, assets: tuple[Path, Path], dump: Path, every: int):
    """The pieces ``Trainer.__init__`` builds, from ``llama3_debugmodel()``, on a CPU mesh."""
    import torchtitan.distributed.fsdp as titan_fsdp
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.config_registry import llama3_debugmodel

    if fsdp == "flatshard":
        import flatshard

        titan_fsdp.fully_shard = flatshard.fully_shard  # the one change (see the docstring)
    else:
        from torch.distributed.fsdp import fully_shard

        titan_fsdp.fully_shard = fully_shard

    config = llama3_debugmodel()
    for layer in config.model_spec.model.layers:  # FlexAttention has no backward on CPU (see the docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ_LEN, LOCAL_BATCH, steps
    config.training.mixed_precision_param = "float32"  # fp32 on CPU, so the runs can be compared bitwise
    config.checkpoint.enable = every > 0  # a DCP checkpoint every `every` steps and at the last
    config.checkpoint.interval = max(1, every)
    config.checkpoint.last_save_model_only = False
    model_config = config.model_spec.model
    model_config.update_from_config(config=config)
    with torch.device("meta"):
        model = model_config.build()
    config.activation_checkpoint.build(dump_folder=str(dump)).apply(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    titan_fsdp.apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    if fsdp == "torch":
        # PyTorch's FSDP2 reduces with ReduceOp.PREMUL_SUM(1 / factor) once torchtitan has set the divide factor
        # to 1, and gloo has no PREMUL_SUM ("Cannot use ReduceOp.PREMUL_SUM with Gloo"): its reference run
        # sums instead, the same numbers (a product by 1.0 is exact). flatshard needs no such call.
        for m in model.modules():
            if isinstance(m, titan_fsdp.FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    model.to_empty(device="cpu")
    torch.manual_seed(0)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()

    loss_fn = config.loss.build(compile_config=config.compile)
    loss_fn.set_lm_head(model.lm_head)
    model._skip_lm_head = True
    optimizers = config.optimizer.build(model_parts=[model])
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    tokenizer = config.tokenizer.build(tokenizer_path=str(assets[0]))
    config.dataloader.dataset_path = str(assets[1])
    dataloader = config.dataloader.build(
        dp_world_size=dist.get_world_size(),
        dp_rank=dist.get_rank(),
        tokenizer=tokenizer,
        seq_len=SEQ_LEN,
        local_batch_size=LOCAL_BATCH,
        snapshot_every_n_steps=config.checkpoint.interval if every else None,
    )
    state = TrainState()
    checkpointer = config.checkpoint.build(
        dataloader=dataloader,
        model_parts=[model],
        optimizers=optimizers,
        lr_schedulers=lr_schedulers,
        states={"train_state": state},
        sd_adapter=None,
        base_folder=str(dump),
    )
    return config, mesh, model, loss_fn, optimizers, lr_schedulers, dataloader, state, checkpointer


def train(fsdp: str, steps: int, assets, dump: Path, *, every: int = 0, stop: int = 0, resume: bool = False):
    """Steps ``state.step + 1 .. stop`` (default ``steps``) of ``Trainer.train_step``, saving every
    ``every`` steps (0: checkpointing off); the losses and gradient norms torchtitan logs, one pair per
    step."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    config, mesh, model, loss_fn, optimizers, lr_schedulers, dataloader, state, checkpointer = build(
        fsdp, steps, assets, dump, every
    )
    if resume:
        checkpointer.load(step=-1)  # the newest step folder under dump/checkpoint
    data = iter(dataloader)
    logged = []
    while state.step < (stop or steps):
        state.step += 1
        optimizers.zero_grad()
        input_dict, labels = next(data)
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, mesh)
        state.ntokens_seen += labels.numel()
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        pred = model(input_dict["input"], **extra)
        loss, _ = loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(model.parameters()), config.training.max_norm, foreach=True, pp_mesh=None, ep_enabled=False
        )
        optimizers.step()
        lr_schedulers.step()
        global_avg_loss = dist_utils.dist_sum(loss.detach(), mesh)
        logged.append((float(global_avg_loss), float(grad_norm)))
        checkpointer.save(curr_step=state.step, last_step=state.step == steps)
    checkpointer.close()
    return logged


def table(runs: dict[str, list]) -> str:
    names = list(runs)
    lines = ["step  " + "  ".join(f"{n + ' loss':>24} {'grad norm':>12}" for n in names)]
    for i in range(max(len(r) for r in runs.values())):
        cells = [f"{runs[n][i][0]:24.9f} {runs[n][i][1]:12.6f}" if i < len(runs[n]) else " " * 37 for n in names]
        lines.append(f"{i + 1:>4}  " + "  ".join(cells))
    return "\n".join(lines)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nproc", type=int, default=WORLD, help="ranks to start when not under torchrun")
    p.add_argument("--fsdp", choices=["flatshard", "torch"], default="flatshard")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compare", action="store_true", help="FSDP2, flatshard, and flatshard saved and resumed")
    p.add_argument("--dir", type=Path, default=None, help="assets and checkpoints (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()

    if "RANK" not in os.environ:  # not under torchrun: start the ranks, every socket on 127.0.0.1
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from local_launch import run_local
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

        with contextlib.suppress(ChildFailedError):
            run_local(args.nproc, os.path.abspath(__file__), sys.argv[1:])
            return 0
        return 1

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # the text set is local files
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    work = args.dir or Path(tempfile.gettempdir()) / f"flatshard-torchtitan-{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if rank == 0:
        make_assets(work / "assets")
    dist.barrier()
    assets = make_assets(work / "assets")
    if not args.compare:
        runs = {args.fsdp: train(args.fsdp, args.steps, assets, work / args.fsdp)}
        ok = True
    else:
        if rank == 0:
            shutil.rmtree(work / "resumed", ignore_errors=True)
        dist.barrier()
        runs = {
            "FSDP2": train("torch", args.steps, assets, work / "fsdp2"),
            "flatshard": train("flatshard", args.steps, assets, work / "flatshard"),
        }
        half = args.steps // 2
        first = train("flatshard", args.steps, assets, work / "resumed", every=half, stop=half)
        rest = train("flatshard", args.steps, assets, work / "resumed", every=half, resume=True)
        runs["flatshard saved+resumed"] = first + rest
        ok = runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    if rank == 0:
        print(table(runs))
        if args.compare:
            print("flatshard == FSDP2 and resumed == uninterrupted, every step (loss and grad norm):", ok)
        if args.json:
            args.json.write_text(json.dumps({"world": dist.get_world_size(), "equal": ok, "runs": runs}))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    gc.collect()  # [Note: process groups at exit] in examples/local_launch.py
    sys.exit(code)
