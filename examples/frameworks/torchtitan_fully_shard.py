"""torchtitan's llama3 debug model, and its deepseek_v3 MoE debug model, sharded by flatshard's ``fully_shard``
through torchtitan's own FSDP function, loss, optimizer, LR schedule, data loader and checkpointer, on CPU.

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

``--model deepseek_v3``: torchtitan's smallest MoE debug flavour (``deepseek_v3_debugmodel()``: 6 layers,
the first dense, then 5 MoE blocks of 8 routed experts, top-3 softmax router, 2 shared experts, MLA
attention), sharded by torchtitan's own ``parallelize_fn`` (``parallelize_deepseekv3``: expert parallelism
when EP > 1, activation checkpointing, then ``apply_fsdp_to_decoder``) on torchtitan's ``ParallelDims``,
whose meshes are built on CPU (its ``device_type`` set to "cpu"), under ``partial_dtensor``; the Trainer's
MoE load-balancing hook (``post_optimizer_build_fn``: the experts' token counts summed over ranks move the
expert bias before each optimizer step) included, and ``clip_grad_norm_``'s EP branch when EP > 1. At EP = 1
and W = 2, ``apply_fsdp_to_decoder`` gives each MoE block one plain ``fully_shard`` over the ``fsdp`` mesh,
experts along dim 0: the 8 experts outnumber the 2 FSDP ranks, so it passes no ``shard_placement_fn`` (it
does, with ``Shard(1)``, when the FSDP degree exceeds the experts, and with a ``ShardPlacementResult`` per
parameter, experts on the ``efsdp`` mesh, when EP > 1, then also setting explicit forward and backward
prefetching). Its routed experts compute in bf16 whatever the config says (``GroupedExperts`` casts for
``torch._grouped_mm``, which runs on CPU): the same on both sides, so the runs still compare to the bit.
``--ep 2``: torchtitan's expert parallelism over the 2 ranks (its all-to-all over gloo). ``model.parallelize``
makes the routed experts DTensors on the 1-D ``ep`` mesh (``Shard(0)``) and each MoE block's ``fully_shard``
places them on the ``efsdp`` mesh (a ``ShardPlacementResult`` per parameter); flatshard holds them as FSDP2
does, on the 2-D (efsdp, ep) mesh, ``(_StridedShard(0), Shard(0))``, and trains equal to FSDP2 to the bit
at W = 2 (EP 2 × expert-FSDP 1). Under ``torchrun --nproc-per-node 4`` (EP 2 × expert-FSDP 2, the dense
weights over 4 ranks) the runs differ in the last bits from step 3 (gloo sums 4 ranks in another order than
flatshard's exchange), which this recipe's exact comparison reports as unequal.

Run (starts 2 local CPU ranks itself, or run it under ``torchrun --nproc-per-node 2``):

    python examples/frameworks/torchtitan_fully_shard.py --compare --json out.json
    python examples/frameworks/torchtitan_fully_shard.py --model deepseek_v3 --compare --json out.json

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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

WORLD = 2
SEQ_LEN, LOCAL_BATCH = 64, 2
MODELS = ("llama3", "deepseek_v3")  # torchtitan's debug flavours: dense, and its smallest MoE

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


@dataclass
class Parts:
    """What ``Trainer.__init__`` builds and ``Trainer.train_step`` uses, and where its sums go."""

    config: Any
    model: Any
    loss_fn: Any
    optimizers: Any
    lr_schedulers: Any
    dataloader: Any
    state: TrainState
    checkpointer: Any
    batch_mesh: Any  # the global token count's sum
    loss_mesh: Any  # the logged loss's sum
    ep_enabled: bool  # torchtitan's clip_grad_norm_ takes the experts' norm apart


def use(fsdp: str) -> None:
    """The one change (see the docstring): the name torchtitan's FSDP function calls."""
    import torchtitan.distributed.fsdp as titan_fsdp

    if fsdp == "flatshard":
        import flatshard

        titan_fsdp.fully_shard = flatshard.fully_shard
    else:
        from torch.distributed.fsdp import fully_shard

        titan_fsdp.fully_shard = fully_shard


def trainer_config(model: str, steps: int, every: int, ep: int):
    """The debug model's own ``Trainer.Config``, with the CPU departures of the docstring."""
    from torchtitan.models.common.attention import ScaledDotProductAttention

    if model == "llama3":
        from torchtitan.models.llama3.config_registry import llama3_debugmodel

        config = llama3_debugmodel()
    else:
        from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

        config = deepseek_v3_debugmodel()
        config.parallelism.spmd_backend = "partial_dtensor"  # see the docstring
        config.parallelism.expert_parallel_degree = ep
    for layer in config.model_spec.model.layers:  # FlexAttention has no backward on CPU (see the docstring)
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size, config.training.steps = SEQ_LEN, LOCAL_BATCH, steps
    config.training.mixed_precision_param = "float32"  # fp32 on CPU, so the runs can be compared bitwise
    config.checkpoint.enable = every > 0  # a DCP checkpoint every `every` steps and at the last
    config.checkpoint.interval = max(1, every)
    config.checkpoint.last_save_model_only = False
    config.model_spec.model.update_from_config(config=config)
    return config


def shard_llama3(model, config, dump: Path):
    """The dense recipe: the debug config's activation checkpointing, then torchtitan's FSDP function over a
    1-D CPU mesh of every rank. Returns (batch mesh, loss mesh, EP enabled)."""
    import torchtitan.distributed.fsdp as titan_fsdp

    config.activation_checkpoint.build(dump_folder=str(dump)).apply(model)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    titan_fsdp.apply_fsdp_to_decoder(
        model, mesh, param_dtype=torch.float32, reduce_dtype=torch.float32, pp_enabled=False
    )
    return mesh, mesh, False


def shard_moe(model, config, dump: Path):
    """The MoE recipe: torchtitan's own ``parallelize_fn`` (``parallelize_deepseekv3``: expert parallelism
    when EP > 1, activation checkpointing, then ``apply_fsdp_to_decoder``) on torchtitan's ``ParallelDims``,
    its meshes built on CPU. Returns (batch mesh, loss mesh, EP enabled) and the ParallelDims."""
    import torchtitan.distributed.parallel_dims as titan_dims
    from torchtitan.distributed import utils as dist_utils

    titan_dims.device_type = "cpu"  # its meshes are "cuda" meshes otherwise (see the docstring)
    dist_utils.set_spmd_backend(config.parallelism.spmd_backend)  # as Trainer.__init__ does
    dims = titan_dims.ParallelDims.from_config(config.parallelism, dist.get_world_size())
    config.model_spec.parallelize_fn(
        model,
        parallel_dims=dims,
        training=config.training,
        parallelism=config.parallelism,
        compile_config=config.compile,
        ac_config=config.activation_checkpoint,
        dump_folder=str(dump),
    )
    return (dims.get_mesh("batch"), dims.get_optional_mesh("loss"), dims.ep_enabled), dims


def build(fsdp: str, steps: int, assets: tuple[Path, Path], dump: Path, every: int, model_name: str, ep: int) -> Parts:
    """The pieces ``Trainer.__init__`` builds, from the debug model's config, on CPU meshes."""
    import torchtitan.distributed.fsdp as titan_fsdp

    use(fsdp)
    config = trainer_config(model_name, steps, every, ep)
    with torch.device("meta"):
        model = config.model_spec.model.build()
    if model_name == "llama3":
        meshes, dims = shard_llama3(model, config, dump), None
    else:
        meshes, dims = shard_moe(model, config, dump)
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
    if dims is not None and config.model_spec.post_optimizer_build_fn is not None:
        # the MoE load-balancing hook: before each optimizer step, the experts' token counts summed over the
        # loss mesh move each MoE layer's expert bias
        config.model_spec.post_optimizer_build_fn(optimizers, [model], dims)
    lr_schedulers = config.lr_scheduler.build(optimizers=optimizers, training_steps=steps)
    tokenizer = config.tokenizer.build(tokenizer_path=str(assets[0]))
    config.dataloader.dataset_path = str(assets[1])
    batch_mesh = meshes[0]
    dataloader = config.dataloader.build(
        dp_world_size=batch_mesh.size(),
        dp_rank=batch_mesh.get_local_rank(),
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
    return Parts(config, model, loss_fn, optimizers, lr_schedulers, dataloader, state, checkpointer, *meshes)


def placements(model) -> dict[str, str]:
    """How the first MoE block's routed experts and its attention's query weight are held: the DTensor
    placements, mesh dims and this rank's local shape of each (what ``parallelize_fn`` and FSDP made)."""
    block = next(b for b in model.layers.values() if getattr(b, "moe_enabled", False))
    shown = {
        "routed expert w1": block.moe.routed_experts.inner_experts.w1_EFD,
        "attention wq": block.attention.wq.weight,
    }
    out = {}
    for name, p in shown.items():
        mesh = p.device_mesh
        out[name] = (
            f"{tuple(p.placements)} on {mesh.mesh_dim_names} {tuple(mesh.shape)}, local {tuple(p.to_local().shape)}"
        )
    return out


def train(
    fsdp: str,
    steps: int,
    assets,
    dump: Path,
    *,
    model: str = "llama3",
    ep: int = 1,
    every: int = 0,
    stop: int = 0,
    resume: bool = False,
    seen: dict | None = None,
):
    """Steps ``state.step + 1 .. stop`` (default ``steps``) of ``Trainer.train_step``, saving every
    ``every`` steps (0: checkpointing off); the losses and gradient norms torchtitan logs, one pair per
    step. ``seen``: filled with the MoE model's placements (``placements``)."""
    from torchtitan.components.loss import IGNORE_INDEX
    from torchtitan.distributed import utils as dist_utils

    parts = build(fsdp, steps, assets, dump, every, model, ep)
    if seen is not None and model != "llama3":
        seen.update(placements(parts.model))
    state, checkpointer = parts.state, parts.checkpointer
    if resume:
        checkpointer.load(step=-1)  # the newest step folder under dump/checkpoint
    data = iter(parts.dataloader)
    logged = []
    while state.step < (stop or steps):
        state.step += 1
        parts.optimizers.zero_grad()
        input_dict, labels = next(data)
        local_valid_tokens = (labels != IGNORE_INDEX).sum()
        global_valid_tokens = dist_utils.dist_sum_tensor(local_valid_tokens, parts.batch_mesh)
        state.ntokens_seen += labels.numel()
        extra = {k: v for k, v in input_dict.items() if k != "input"}
        pred = parts.model(input_dict["input"], **extra)
        loss, _ = parts.loss_fn(pred, labels, global_valid_tokens)
        loss.backward()
        grad_norm = dist_utils.clip_grad_norm_(
            list(parts.model.parameters()),
            parts.config.training.max_norm,
            foreach=True,
            pp_mesh=None,
            ep_enabled=parts.ep_enabled,
        )
        parts.optimizers.step()  # (MoE: the load-balancing hook runs first)
        parts.lr_schedulers.step()
        global_avg_loss = dist_utils.dist_sum(loss.detach(), parts.loss_mesh)
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
    p.add_argument("--model", choices=MODELS, default="llama3", help="the debug model (deepseek_v3: MoE)")
    p.add_argument("--ep", type=int, default=1, help="expert-parallel degree (deepseek_v3)")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compare", action="store_true", help="FSDP2, flatshard, and flatshard saved and resumed")
    p.add_argument("--dir", type=Path, default=None, help="assets and checkpoints (default: a temporary folder)")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    if args.ep != 1 and args.model == "llama3":
        p.error("--ep is for an MoE model: pass --model deepseek_v3")

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
    kw = {"model": args.model, "ep": args.ep}
    seen: dict[str, dict] = {"FSDP2": {}, "flatshard": {}}
    if not args.compare:
        runs = {args.fsdp: train(args.fsdp, args.steps, assets, work / args.fsdp, **kw)}
        ok = True
    else:
        if rank == 0:
            shutil.rmtree(work / "resumed", ignore_errors=True)
        dist.barrier()
        runs = {
            "FSDP2": train("torch", args.steps, assets, work / "fsdp2", seen=seen["FSDP2"], **kw),
            "flatshard": train("flatshard", args.steps, assets, work / "flatshard", seen=seen["flatshard"], **kw),
        }
        half = args.steps // 2
        first = train("flatshard", args.steps, assets, work / "resumed", every=half, stop=half, **kw)
        rest = train("flatshard", args.steps, assets, work / "resumed", every=half, resume=True, **kw)
        runs["flatshard saved+resumed"] = first + rest
        ok = runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    if rank == 0:
        print(table(runs))
        if args.compare:
            print("flatshard == FSDP2 and resumed == uninterrupted, every step (loss and grad norm):", ok)
        if args.json:
            fig = {"world": dist.get_world_size(), "model": args.model, "ep": args.ep, "equal": ok, "runs": runs}
            if args.model != "llama3":
                fig["placements"] = seen  # rank 0's, as each run's parallelize_fn and fully_shard left them
            args.json.write_text(json.dumps(fig))
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    code = main()
    gc.collect()  # [Note: process groups at exit] in examples/local_launch.py
    sys.exit(code)
