"""Train a byte-level GPT with flatshard on the Python standard library's own source code.

    python examples/train_gpt.py                          # 2 local processes (gloo), FULL_SHARD, ~1 min
    python examples/train_gpt.py --nproc 4 --strategy SHARD_GRAD_OP --steps 100
    python examples/train_gpt.py --nproc 1                # one process, a 1-rank group
    torchrun --standalone --nproc-per-node=2 examples/train_gpt.py --steps 50
    python examples/train_gpt.py --nproc 4 --strategy HYBRID_SHARD --sharding-factor 2
    python examples/train_gpt.py --front-end fully_shard  # FSDP2's API: fully_shard on each block, then the root
    python examples/train_gpt.py --device cuda --nproc 8 --precision bf16 --model large   # GPUs (NCCL)
    python examples/train_gpt.py --save-every 50 --ckpt-dir runs/ckpt --resume            # resumable
    python examples/train_gpt.py --save-every 50 --ckpt-dir runs/ckpt --resume --max-restarts 3   # restarts
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 torchrun --standalone --nproc-per-node=2 --max-restarts=3 \\
        examples/train_gpt.py --save-every 50 --ckpt-dir runs/ckpt --resume --collective-timeout 60   # by torchrun

Two machines (or two "nodes" on one machine), HYBRID_SHARD's shard groups being the nodes; run once per
node, with the same endpoint (host:port of the first node):
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/train_gpt.py --strategy HYBRID_SHARD
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \\
        examples/train_gpt.py --strategy HYBRID_SHARD

Not under torchrun and asked for more than one process, the script checks its arguments and then starts
itself through torchrun's own machinery (``torch.distributed.run``: its argument parser and ``run``), so
both ways of launching are the same code path in the ranks; its rendezvous and the ranks' sockets listen
on 127.0.0.1 only (local_launch.py). With ``--device cuda``
each rank uses the GPU its ``LOCAL_RANK`` names and NCCL; on CPU, gloo.
Reads top to bottom: config → dist init → data → model → optimizer → resume → loop → evaluation →
summary. Rank 0 reports every ``--log-interval`` steps (a bar on a terminal, a plain line otherwise,
JSON lines with ``--metrics``; train_report.py) and prints a table of figures at the end (``--json``
writes them). With ``--save-every N`` it saves a checkpoint every N steps into ``--ckpt-dir``
(``flatshard.checkpoint.Checkpointer``, the last ``--keep-last`` kept; ``--async-save`` writes each in a
background thread while training goes on); ``--resume`` continues from the
newest one, so under torchrun's ``--max-restarts`` (or this script's) a restarted job goes on by itself
from the newest complete checkpoint, bitwise as the run without a failure goes (README, "When machines
fail"). ``--inject-fault`` is test-only machinery (fault_injection.py) for tests/test_restart.py and
bench/faults/soak.py.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import importlib.util
import json
import math
import os
import random
import sys
import sysconfig
import time
from datetime import timedelta
from pathlib import Path

import fault_injection
import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, PRESETS, Block, flops_per_token, generate
from local_launch import run_local
from owned_optim import OwnedOptimizers
from train_report import STEP_PHASES, TrainLog, figures, gather_memory, peak_flops, print_summary, unit_shapes

import flatshard
from flatshard import FullyShardedDataParallel as FSDP
from flatshard import MixedPrecision, ShardingStrategy, checkpoint, param_groups
from flatshard.wrap import ModuleWrapPolicy


# ---- config ---------------------------------------------------------------------------------------
class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """--help shows each default, except the empty ones (None, False)."""

    def _get_help_string(self, action):
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def parse_args(argv=None) -> argparse.Namespace:
    """The arguments, every one checked here: in the launcher, before any rank is started."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=_Help)
    p.add_argument("--nproc", type=int, default=2, help="world size W when not under torchrun")
    p.add_argument(
        "--front-end",
        default="wrapper",
        choices=["wrapper", "fully_shard"],
        help="wrapper: FullyShardedDataParallel with a wrap policy (FSDP1's API); fully_shard: FSDP2's API, "
        "fully_shard on each block and then the root (--strategy picks reshard_after_forward and the mesh)",
    )
    p.add_argument(
        "--strategy",
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"],
        help="flatshard.ShardingStrategy",
    )
    p.add_argument(
        "--sharding-factor",
        type=int,
        default=None,
        help="ranks F that share one copy of the model (a divisor of W); hybrid strategies default to "
        "the node size under torchrun",
    )
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="cuda: NCCL, one GPU per rank")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"], help="bf16: MixedPrecision, fp32 masters")
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="size preset (examples/gpt.py)")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--dim", type=int, help="override the preset's width")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--block-size", type=int, help="override the preset's context length")
    p.add_argument("--steps", type=int, default=240, help="training steps in all (a resumed run included)")
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine to lr/10)")
    p.add_argument(
        "--optimizer",
        default="adamw",
        choices=["adamw", "muon"],
        help='muon: shard_boundaries="params", torch.optim.Muon on the matrices each rank owns and AdamW on the '
        "rest (owned_optim.py)",
    )
    p.add_argument(
        "--weight-decay", type=float, default=0.1, help="on matrices only (embeddings too; not norms, biases)"
    )
    p.add_argument("--seed", type=int, default=1337, help="the initial weights and every step's batch")
    p.add_argument("--log-interval", type=int, default=20, help="steps between reports (each is a sync point)")
    p.add_argument(
        "--metrics", type=Path, help="write the reports to this file as JSON lines (rank 0; a resumed run appends)"
    )
    p.add_argument("--peak-tflops", type=float, help="peak TFLOP/s of one device, for MFU (known GPUs need none)")
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches per rank for the validation loss")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--json", type=Path, help="write the final figures to this file (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no progress reports (the summary table still prints)")
    ckpt = p.add_argument_group("checkpoints (flatshard.checkpoint)")
    ckpt.add_argument("--ckpt-dir", type=Path, help="directory of step checkpoints (step-00000100, ...)")
    ckpt.add_argument("--save-every", type=int, default=0, help="save every N steps and at the end (0: never)")
    ckpt.add_argument("--keep-last", type=int, default=3, help="checkpoints kept in --ckpt-dir")
    ckpt.add_argument(
        "--async-save", action="store_true", help="write each checkpoint in a background thread (host copies first)"
    )
    ckpt.add_argument(
        "--resume",
        nargs="?",
        const="latest",
        help="continue from the newest checkpoint in --ckpt-dir (none there: start at step 0), or from PATH",
        metavar="PATH",
    )
    fail = p.add_argument_group("failures")
    fail.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="when the script starts its ranks itself: restart them all up to K times after any rank fails "
        "(torchrun's --max-restarts; under torchrun, pass torchrun's own); needs --save-every, --ckpt-dir and --resume",
        metavar="K",
    )
    fail.add_argument(
        "--collective-timeout",
        type=float,
        help="seconds a collective of training waits for a peer before every rank waiting fails (a process "
        "group's timeout; torch's default, 30 minutes, when not given): how long a hung rank stalls the job",
        metavar="S",
    )
    fail.add_argument(
        "--inject-fault",
        action="append",
        default=[],
        type=_fault,
        help="TEST-ONLY: kill or stop a rank at a point of a step, ACTION:PHASE:step=N[:rank=R][:attempt=A], "
        "e.g. kill:backward:step=7:rank=1 (examples/fault_injection.py lists the phases); repeatable",
        metavar="SPEC",
    )
    args = p.parse_args(argv)
    problem = invalid(args)
    if problem:
        p.error(problem)
    return args


def _fault(spec: str) -> fault_injection.Fault:
    try:
        return fault_injection.parse(spec)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def invalid(args: argparse.Namespace) -> str | None:
    """What is wrong with the arguments and how to fix it, or None."""
    for name in ("nproc", "steps", "batch_size", "log_interval", "keep_last"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}"
    if args.save_every < 0 or args.eval_batches < 0 or args.sample_tokens < 0 or args.max_restarts < 0:
        return "--save-every, --eval-batches, --sample-tokens and --max-restarts must be 0 or more"
    if args.max_restarts and not (args.save_every and args.ckpt_dir and args.resume == "latest"):
        return (
            "--max-restarts needs --save-every N --ckpt-dir DIR --resume, so that a restarted job goes on from "
            "the newest checkpoint instead of starting over"
        )
    if args.collective_timeout is not None and not args.collective_timeout > 0:
        return f"--collective-timeout must be positive (seconds), got {args.collective_timeout}"
    fault = fault_injection.problem(args.inject_fault, world_size(args), args.steps, args.save_every)
    if fault:
        return fault
    cfg = model_config(args)
    if cfg.dim % cfg.heads:
        return f"the width ({cfg.dim}) must be a multiple of the number of heads ({cfg.heads}); change --dim or --heads"
    if args.sharding_factor is not None and (args.sharding_factor < 1 or world_size(args) % args.sharding_factor):
        return f"--sharding-factor {args.sharding_factor} must divide the world size {world_size(args)}"
    if args.front_end == "fully_shard":
        if args.strategy == "NO_SHARD":
            return "--front-end fully_shard has no NO_SHARD (use DDP, or --front-end wrapper --strategy NO_SHARD)"
        hybrid = args.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")
        if hybrid and args.sharding_factor is None:
            return f"--front-end fully_shard --strategy {args.strategy} needs --sharding-factor F (the shard dim)"
    if (args.save_every or args.resume == "latest") and args.ckpt_dir is None:
        return "--save-every and --resume need --ckpt-dir DIR (where the step checkpoints go)"
    if args.async_save and not args.save_every:
        return "--async-save needs --save-every N (it says how the checkpoints are written, not when)"
    if args.resume not in (None, "latest"):
        try:
            checkpoint.read_manifest(args.resume)
        except checkpoint.CheckpointError as exc:
            return f"--resume {args.resume}: {exc}"
    if args.peak_tflops is not None and not args.peak_tflops > 0:
        return f"--peak-tflops must be positive, got {args.peak_tflops}"
    if args.optimizer == "muon" and not hasattr(torch.optim, "Muon"):
        return f"--optimizer muon needs torch.optim.Muon, which torch {torch.__version__} lacks; use --optimizer adamw"
    if importlib.util.find_spec("rich") is None:
        return "this example prints with rich: pip install 'flatshard[examples]' (or pip install rich)"
    if args.device == "cuda":
        if not torch.cuda.is_available():
            return (
                "--device cuda: torch sees no CUDA device here (torch.cuda.is_available() is False); use --device cpu"
            )
        local = int(os.environ.get("LOCAL_WORLD_SIZE", args.nproc if not under_torchrun() else 1))
        if local > torch.cuda.device_count():
            return f"--device cuda: {local} ranks on this machine but {torch.cuda.device_count()} GPUs; pass fewer"
    return None


def shard_with_fully_shard(model: torch.nn.Module, args, device: torch.device, group) -> torch.nn.Module:
    """FSDP2's way: ``fully_shard`` on each block, then on the root. The strategy names what it means
    there: FULL_SHARD frees the gathered blocks after forward (``reshard_after_forward=True``),
    SHARD_GRAD_OP keeps them for backward (False); the hybrid ones shard over a 2-D (replicate, shard)
    mesh of W / F replicas of F ranks. The same precision and Muon's whole matrices as the wrapper."""
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from flatshard import MixedPrecisionPolicy, fully_shard

    world = dist.get_world_size()
    if args.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2") and args.collective_timeout is not None:
        mesh = hybrid_mesh_with_timeout(world, args.sharding_factor, device.type, args.collective_timeout)
    elif args.strategy in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        f = args.sharding_factor
        mesh = init_device_mesh(device.type, (world // f, f), mesh_dim_names=("replicate", "shard"))
    else:  # over the training group, so that --collective-timeout reaches its collectives
        mesh = DeviceMesh.from_group(group or dist.group.WORLD, device.type)
    bf16 = torch.bfloat16
    policy = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16) if args.precision == "bf16" else None
    kw = {
        "mesh": mesh,
        "reshard_after_forward": args.strategy in ("FULL_SHARD", "HYBRID_SHARD"),
        "mp_policy": policy or MixedPrecisionPolicy(),
        "shard_boundaries": "params" if args.optimizer == "muon" else None,  # Muon needs whole matrices
    }
    for block in model.blocks:
        fully_shard(block, **kw)
    return fully_shard(model, **kw)


def hybrid_mesh_with_timeout(world: int, f: int, device_type: str, timeout_s: float):
    """The (replicate, shard) mesh of W / F replicas of F ranks that ``init_device_mesh`` would build, made
    of groups whose collectives wait ``timeout_s`` seconds (``init_device_mesh`` takes no timeout). Every
    rank creates every group, in the same order, as ``new_group`` requires."""
    from torch.distributed.device_mesh import DeviceMesh

    layout = torch.arange(world).view(world // f, f)
    timeout, mine = timedelta(seconds=timeout_s), {}
    for dim, rows in (("replicate", layout.t()), ("shard", layout)):
        for ranks in rows.tolist():
            group = dist.new_group(ranks, timeout=timeout)
            if dist.get_rank() in ranks:
                mine[dim] = group
    return DeviceMesh.from_group(
        [mine["replicate"], mine["shard"]], device_type, mesh=layout, mesh_dim_names=("replicate", "shard")
    )


def clip_grad_norm(model: torch.nn.Module, args) -> None:
    """The gradients' norm clipped to 1: the wrapper's method; for fully_shard's DTensor gradients torch's
    function, or for whole matrices on their owners (Muon's) flatshard's, with one all-reduce."""
    if args.front_end == "wrapper":
        model.clip_grad_norm_(1.0)
    elif args.optimizer == "muon":
        flatshard.fsdp2.clip_grad_norm_(model.parameters(), 1.0)
    else:
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def model_config(args):
    """The preset named by --model, with any of --layers/--dim/--heads/--block-size given over it."""
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "heads", "block_size") if getattr(args, k) is not None}
    return dataclasses.replace(PRESETS[args.model], **overrides)


def under_torchrun() -> bool:
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def world_size(args) -> int:
    return int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else args.nproc


def relaunch_with_torchrun(nproc: int, max_restarts: int) -> int:
    """Start ``nproc`` copies of this script through torchrun's own machinery and wait for them. Every
    socket of the job listens on 127.0.0.1 only ([Note: loopback-only local launch], local_launch.py)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Split the cores between the ranks (torchrun would otherwise set 1 and warn about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    try:
        run_local(nproc, os.path.abspath(__file__), sys.argv[1:], max_restarts=max_restarts)
    except ChildFailedError:
        return 1  # torchrun has already printed which rank failed and why
    return 0


def init_distributed(args) -> tuple[torch.device, dist.ProcessGroup | None]:
    """env:// under torchrun; a private 1-rank group otherwise (flatshard needs a group). Returns this
    rank's device (cuda:LOCAL_RANK with NCCL, or the CPU with gloo) and the group that trains: with
    --collective-timeout a group of every rank whose collectives wait that long (the world's keeps torch's
    default, so that ranks that start slowly on a loaded machine still meet), else None (the world)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local_rank) if args.device == "cuda" else torch.device("cpu")
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    group = None
    if under_torchrun():
        dist.init_process_group(backend, device_id=device if device.type == "cuda" else None)
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
        if args.collective_timeout is not None:
            # every collective of training (flatshard's groups are made from this one and inherit its timeout)
            # waits this long for a peer that died or hangs, then fails on every rank that waits
            group = dist.new_group(timeout=timedelta(seconds=args.collective_timeout))
    else:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    return device, group


# ---- data -----------------------------------------------------------------------------------------
def load_corpus() -> torch.Tensor:
    """Every top-level ``*.py`` of the standard library, in sorted order, as one tensor of bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise SystemExit(f"no *.py files under {root}; this example trains on the standard library's source")
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def get_batch(data: torch.Tensor, seed: int, batch: int, block: int, rank: int, world: int):
    """This rank's rows of a global batch of ``world * batch`` random windows, drawn from ``seed``.

    Every rank draws the whole global batch's offsets from the same seed and keeps its own rows, so the
    ranks see different data, and W ranks together see what one process with batch W·B would. The
    training loop seeds each step's batch with the step number, so a resumed run sees the same data."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(len(data) - block - 1, (world * batch,), generator=gen)[rank * batch : (rank + 1) * batch]
    windows = data[starts[:, None] + torch.arange(block + 1)].long()
    return windows[:, :-1], windows[:, 1:]


# ---- schedule -------------------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to peak/10."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@torch.no_grad()
def estimate_val_loss(model, data, args, cfg, rank, world, device) -> float:
    """Mean loss over ``eval_batches`` held-out batches per rank (the same batches every run)."""
    total = torch.zeros((), device=device)
    for i in range(args.eval_batches):
        x, y = get_batch(data, args.seed + 10**9 + i, args.batch_size, cfg.block_size, rank, world)
        total += F.cross_entropy(model(x.to(device)).flatten(0, 1).float(), y.to(device).flatten())
    dist.all_reduce(total)  # a sync point, once
    return total.item() / (world * args.eval_batches)


def resume(args, ckpt: checkpoint.Checkpointer, cfg) -> int:
    """Load the checkpoint --resume names (the newest in --ckpt-dir by default: model, optimizer, every
    rank's RNG states) and return its step; 0 when there is none to resume from."""
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    again = f" (restart {attempt})" if attempt else ""
    try:
        step = ckpt.resume(None if args.resume == "latest" else args.resume)
    except checkpoint.CheckpointError as exc:  # raised alike on every rank
        raise SystemExit(f"--resume {args.resume}: {exc} (was it saved with another --optimizer?)") from exc
    if ckpt.resumed_from is None:
        if dist.get_rank() == 0:
            print(f"no checkpoint in {args.ckpt_dir} yet: starting at step 0{again}", flush=True)
        return 0
    extra = ckpt.extra or {}
    if extra.get("model") != dataclasses.asdict(cfg) or extra.get("steps") != args.steps:
        raise SystemExit(  # every rank read the same manifest, so every rank stops here with this message
            f"{ckpt.resumed_from} was saved by a run of another model or length ({extra}); pass the same "
            "--model, --layers/--dim/--heads/--block-size and --steps, or another --ckpt-dir"
        )
    if dist.get_rank() == 0:
        print(f"resuming from {ckpt.resumed_from} at step {step}{again}", flush=True)
    return step


@contextlib.contextmanager
def report_collectives(step: int):
    """The report's own collectives (the loss all-reduce, the memory gather): one that fails (a peer died
    or hangs past --collective-timeout) names this rank, the phase and the step."""
    try:
        yield
    except RuntimeError as exc:
        raise RuntimeError(
            f"train_gpt.py: rank {dist.get_rank()}: the report after step {step} (phase report, no unit) did "
            f"not complete: {exc}. A peer rank died or stalled"
        ) from exc


# ---- the run --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_torchrun() and (args.nproc > 1 or args.max_restarts):
        return relaunch_with_torchrun(args.nproc, args.max_restarts)
    device, train_group = init_distributed(args)
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    if master and world != args.nproc and any(a.startswith("--nproc") for a in sys.argv[1:]):
        print(f"note: running with torchrun's world size {world}; --nproc {args.nproc} is ignored")

    # data: 90% train, the last 10% held out
    corpus = load_corpus()
    n_train = int(0.9 * len(corpus))
    train_data, val_data = corpus[:n_train], corpus[n_train:]
    cfg = model_config(args)

    # model: the same seed on every rank gives identical initial weights before sharding. numpy's and
    # Python's generators are seeded too (nothing here draws from them): a checkpoint holds every rank's
    # state of all three, and a resumed run then writes checkpoints equal to the uninterrupted run's, byte
    # for byte
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    random.seed(args.seed)
    bf16 = torch.bfloat16
    if args.front_end == "fully_shard":
        model = shard_with_fully_shard(GPT(cfg).to(device), args, device, train_group)
    else:
        model = FSDP(
            GPT(cfg),
            sharding_strategy=ShardingStrategy[args.strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            sharding_factor=args.sharding_factor,
            device_id=device if device.type == "cuda" else None,
            process_group=train_group,
            mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16) if args.precision == "bf16" else None,
            shard_boundaries="params" if args.optimizer == "muon" else "flat",  # Muon needs whole matrices
        )
    units = flatshard.units(model)  # one read-only UnitInfo per unit, root first
    n_params = sum(u.numel for u in units)

    # optimizer: weight decay on matrices only (param_groups reads each shard view's full shape); or Muon on
    # the matrices this rank owns whole and AdamW on its other parameters (owned_optim.py)
    if args.optimizer == "muon":
        opt = OwnedOptimizers(model, args.lr, args.weight_decay, betas=(0.9, 0.95))
    else:
        opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    n_state = sum(len(g["params"]) for g in opt.param_groups)
    # checkpoints: every --save-every steps and at the end; each step's batch is a function of (seed, step),
    # so the step is all the data loader needs to go on where it was ("The loop's own state" in
    # flatshard/checkpoint/resume.py)
    ckpt = None
    if args.ckpt_dir or args.resume:
        directory = args.ckpt_dir or Path(args.resume).parent
        ckpt = checkpoint.Checkpointer(
            directory, model, opt, every=max(1, args.save_every), keep_last=args.keep_last, async_save=args.async_save
        )
    start = resume(args, ckpt, cfg) if args.resume else 0
    faults = fault_injection.Injector(args.inject_fault, rank, int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))
    faults.install(next(m for m in model.modules() if isinstance(m, Block)), opt)

    # loop
    tokens_per_step = world * args.batch_size * cfg.block_size
    flops = flops_per_token(cfg, cfg.block_size)
    peak = peak_flops(device, args.precision, args.peak_tflops)
    losses: list[tuple[int, float]] = []
    steady: dict[str, int] = model.memory_bytes(opt)
    loss_sum, since_log = torch.zeros((), device=device), 0
    if master:
        print(
            f"GPT of {n_params:,} parameters ({cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, context "
            f"{cfg.block_size}) in {len(units)} units, {args.strategy} ({args.front_end}) over W={world} ranks "
            f"({device.type}, {args.precision}, {args.optimizer}); {len(corpus):,} bytes of stdlib source, "
            f"{len(val_data):,} held out",
            flush=True,
        )
    mode = "quiet" if args.quiet or not master else ("bar" if sys.stdout.isatty() else "lines")
    log = TrainLog(mode, args.steps, start, args.metrics if master else None)
    with log, model.record_comms() as rec, model.record_memory(opt) as mem:
        t0 = t_log = time.perf_counter()
        for step in range(start, args.steps):
            faults.step = step
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            x, y = get_batch(train_data, args.seed + step, args.batch_size, cfg.block_size, rank, world)
            x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
            loss = F.cross_entropy(model(x).flatten(0, 1).float(), y.flatten())
            loss.backward()
            clip_grad_norm(model, args)
            faults.before_optimizer_step()
            opt.step()
            loss_sum += loss.detach()
            since_log += 1
            last = step == args.steps - 1
            if step % args.log_interval == 0 or last:
                steady = model.memory_bytes(opt)  # after the step, before zero_grad: params + grads + state
                # The global mean loss over the steps since the last report. all_reduce is a sync point
                # (every rank waits for the slowest), so it runs once per log interval, not every step.
                with report_collectives(step + 1):
                    dist.all_reduce(loss_sum, group=train_group)
                    memory = gather_memory(mem, device)
                losses.append((step, loss_sum.item() / (world * since_log)))
                now = time.perf_counter()
                tps = tokens_per_step * since_log / (now - t_log)
                log.record(
                    {
                        "step": step + 1,
                        "elapsed_s": now - t0,
                        "loss": losses[-1][1],
                        "lr": opt.param_groups[0]["lr"],
                        "step_ms": 1e3 * (now - t_log) / since_log,
                        "tokens_per_s": tps,
                        "memory": memory,
                        "mfu": None if peak[0] is None else flops * tps / (world * peak[0]),
                        "comm_bytes_per_step": sum(rec.wire_bytes(phase=ph) for ph in STEP_PHASES) / (step + 1 - start),
                    }
                )
                loss_sum.zero_()
                since_log, t_log = 0, time.perf_counter()
            opt.zero_grad(set_to_none=True)
            log.advance()
            if args.save_every:
                extra = {"model": dataclasses.asdict(cfg), "steps": args.steps, "optimizer": args.optimizer}
                saved = ckpt.step_done(step + 1, extra, final=last)
                if saved is not None and mode == "lines":
                    print(f"checkpoint {saved} {'saving' if args.async_save else 'committed'}", flush=True)
            faults.point("between")
        faults.step = None
        if ckpt is not None:
            ckpt.wait()  # an asynchronous save in flight commits (or raises) before the figures
        elapsed = time.perf_counter() - t0

    # evaluation and a sample (every rank runs these forwards: each one all-gathers every unit)
    val_loss = estimate_val_loss(model, val_data, args, cfg, rank, world, device) if args.eval_batches else None
    sample = ""
    if args.sample_tokens > 0:
        prompt = torch.tensor([list(b"def ")], device=device)
        gen = torch.Generator(device=device).manual_seed(args.seed)
        out = generate(model, prompt, args.sample_tokens, cfg.block_size, generator=gen)
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")

    run = {
        "args": args,
        "cfg": cfg,
        "world": world,
        "device": device,
        "units": units,
        "shapes": unit_shapes(model, units),  # for the planner under shard_boundaries "rows" and "params"
        "n_state": n_state,
        "losses": losses,
        "elapsed": elapsed,
        "start_step": start,
        "steps_run": args.steps - start,
        "val_loss": val_loss,
        "sample": sample,
        "steady": steady,
        "peak": mem.peak_total,
        "comms": rec,
        "flops_per_token": flops,
        "peak_flops": peak,
        "gpus_per_node": int(os.environ.get("LOCAL_WORLD_SIZE", world)),
    }
    fig = figures(run)  # collective: every rank takes part
    if master:
        if args.json:
            args.json.write_text(json.dumps(fig, indent=1))
        print_summary(fig)
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # the wrapped model is garbage in reference cycles and holds the process groups: collected here, they
    # are destroyed and gloo's threads joined before the interpreter finalizes, or a rank can abort at exit
    # ([Note: process groups at exit] in examples/local_launch.py)
    gc.collect()
    sys.exit(code)
