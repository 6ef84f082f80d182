"""Train a byte-level GPT with flatshard on the Python standard library's own source code.

    python examples/train_gpt.py                          # 2 local processes (gloo), FULL_SHARD, ~1 min
    python examples/train_gpt.py --nproc 4 --strategy SHARD_GRAD_OP --steps 100
    python examples/train_gpt.py --nproc 1                # one process, a 1-rank group
    torchrun --standalone --nproc-per-node=2 examples/train_gpt.py --steps 50
    python examples/train_gpt.py --nproc 4 --strategy HYBRID_SHARD --sharding-factor 2

Two machines (or two "nodes" on one machine), HYBRID_SHARD's shard groups being the nodes; run once per
node, with the same endpoint (host:port of the first node):
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=0 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        examples/train_gpt.py --strategy HYBRID_SHARD
    torchrun --nnodes=2 --nproc-per-node=2 --node-rank=1 --rdzv-backend=c10d --rdzv-endpoint=HOST:29500 \
        examples/train_gpt.py --strategy HYBRID_SHARD

Not under torchrun and asked for more than one process, the script starts itself through torchrun's
own machinery (``torch.distributed.run``: its argument parser and ``run``, with ``--standalone``), so
both ways of launching are the same code path in the ranks.
Reads top to bottom: config → dist init → data → model → optimizer → loop → evaluation → summary.
Rank 0 shows a progress bar while training and a table of figures at the end (``--json`` writes them).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from gpt import GPT, PRESETS, Block, generate

import flatshard
from flatshard import FullyShardedDataParallel as FSDP
from flatshard import ShardingStrategy, param_groups
from flatshard.wrap import ModuleWrapPolicy

B_FP32 = 4  # bytes per element: parameters, gradients and AdamW's two moments are all fp32 here


# ---- config ---------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="world size W when not under torchrun (default 2)")
    p.add_argument(
        "--strategy",
        default="FULL_SHARD",
        choices=["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"],
    )
    p.add_argument(
        "--sharding-factor",
        type=int,
        default=None,
        help="ranks F that share one copy of the model (a divisor of W); hybrid strategies default to "
        "the node size under torchrun",
    )
    p.add_argument("--model", default="small", choices=sorted(PRESETS), help="size preset (see examples/gpt.py)")
    p.add_argument("--layers", type=int, help="override the preset's number of blocks")
    p.add_argument("--dim", type=int, help="override the preset's width")
    p.add_argument("--heads", type=int, help="override the preset's attention heads")
    p.add_argument("--block-size", type=int, help="override the preset's context length")
    p.add_argument("--steps", type=int, default=240)
    p.add_argument("--batch-size", type=int, default=16, help="sequences per rank per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (warmup, then cosine to lr/10)")
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--log-interval", type=int, default=20, help="steps between loss reports (each is a sync point)")
    p.add_argument("--eval-batches", type=int, default=20, help="held-out batches per rank for the validation loss")
    p.add_argument("--sample-tokens", type=int, default=200, help="bytes of text to generate at the end (0: none)")
    p.add_argument("--json", type=Path, help="write the final figures to this file (rank 0)")
    p.add_argument("--quiet", action="store_true", help="no progress bar (the summary table still prints)")
    args = p.parse_args(argv)
    if args.nproc < 1 or args.steps < 1 or args.batch_size < 1 or args.log_interval < 1:
        p.error("--nproc, --steps, --batch-size and --log-interval must be at least 1")
    cfg = model_config(args)
    if cfg.dim % cfg.heads:
        p.error(
            f"the width ({cfg.dim}) must be a multiple of the number of heads ({cfg.heads}); change --dim or --heads"
        )
    return args


def model_config(args):
    """The preset named by --model, with any of --layers/--dim/--heads/--block-size given over it."""
    overrides = {k: getattr(args, k) for k in ("layers", "dim", "heads", "block_size") if getattr(args, k) is not None}
    return dataclasses.replace(PRESETS[args.model], **overrides)


def under_torchrun() -> bool:
    return "RANK" in os.environ or "LOCAL_RANK" in os.environ


def relaunch_with_torchrun(nproc: int) -> int:
    """Start ``nproc`` copies of this script through torchrun's own machinery and wait for them."""
    from torch.distributed import run as torchrun
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # Split the cores between the ranks (torchrun would otherwise set 1 and warn about it).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # else torchrun reads our --nproc as an ambiguous abbreviation of its --nproc-per-node
    launch = parser.parse_args(["--standalone", f"--nproc-per-node={nproc}", os.path.abspath(__file__), *sys.argv[1:]])
    try:
        torchrun.run(launch)
    except ChildFailedError:
        return 1  # torchrun has already printed which rank failed and why
    return 0


# ---- data -----------------------------------------------------------------------------------------
def load_corpus() -> torch.Tensor:
    """Every top-level ``*.py`` of the standard library, in sorted order, as one tensor of bytes."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(root.glob("*.py"))
    if not files:
        raise SystemExit(f"no *.py files under {root}; this example trains on the standard library's source")
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def get_batch(data: torch.Tensor, gen: torch.Generator, batch: int, block: int, rank: int, world: int):
    """This rank's rows of a global batch of ``world * batch`` random windows.

    Every rank draws the whole global batch's offsets from the same generator and keeps its own rows,
    so the ranks see different data, and W ranks together see what one process with batch W·B would."""
    starts = torch.randint(len(data) - block - 1, (world * batch,), generator=gen)[rank * batch : (rank + 1) * batch]
    windows = data[starts[:, None] + torch.arange(block + 1)].long()
    return windows[:, :-1], windows[:, 1:]


# ---- schedule and figures -------------------------------------------------------------------------
def lr_at(step: int, steps: int, peak: float) -> float:
    """Linear warmup over the first 5% of steps, then cosine decay to peak/10."""
    warmup = max(1, steps // 20)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def comm_formula(strategy: str, f: int, r: int, padded: int, root_padded: int) -> dict[str, float]:
    """Wire bytes per rank per step, by "phase/kind/group", for P = ``padded`` elements (F·ΣS_u) in shard
    groups of f ranks and replicate groups of r ranks.

    Inside a shard group, FULL_SHARD and HYBRID_SHARD all-gather in forward and again in backward (not
    the root unit, which stays gathered from forward to backward) and reduce-scatter in backward:
    3·P·b·(F−1)/F − root. SHARD_GRAD_OP and _HYBRID_SHARD_ZERO2: one all-gather and one reduce-scatter,
    2·P·b·(F−1)/F. Across replicas, one all-reduce of each unit's shard: 2·(P/F)·b·(R−1)/R (NO_SHARD is
    F = 1: 2·P·b·(W−1)/W). Plus clip_grad_norm_'s one-scalar all-reduce when gradients are sharded."""
    out = {}
    if f > 1:
        ring = (f - 1) / f
        out["forward/all_gather/shard"] = padded * B_FP32 * ring
        if strategy in ("FULL_SHARD", "HYBRID_SHARD"):
            out["backward/all_gather/shard"] = (padded - root_padded) * B_FP32 * ring
        out["backward/reduce_scatter/shard"] = padded * B_FP32 * ring
        out["optimizer/all_reduce/shard"] = 2 * B_FP32 * ring  # the global gradient norm (one fp32 scalar)
    if r > 1:
        out["backward/all_reduce/replicate"] = 2 * (padded / f) * B_FP32 * (r - 1) / r
    return out


def local_numel(units) -> int:
    """Parameter elements this rank owns (its shard views; padding is in no view)."""
    return sum(u.local_numel for u in units)


def steady_formula(units, n_state: int) -> int:
    """Bytes of params + grads + AdamW state this rank holds after a step, unit by unit: a flat shard
    and a grad shard of S_u fp32 elements each, two moments per element this rank owns (padding has
    none), and AdamW's fp32 step counter per parameter."""
    return sum(2 * B_FP32 * u.shard_numel for u in units) + 2 * B_FP32 * local_numel(units) + B_FP32 * n_state


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


@torch.no_grad()
def estimate_val_loss(model, data, args, cfg, rank, world) -> float:
    """Mean loss over ``eval_batches`` held-out batches per rank (the same batches every run)."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    total = torch.zeros(())
    for _ in range(args.eval_batches):
        x, y = get_batch(data, gen, args.batch_size, cfg.block_size, rank, world)
        total += F.cross_entropy(model(x).flatten(0, 1), y.flatten())
    dist.all_reduce(total)  # a sync point, once
    return total.item() / (world * args.eval_batches)


# ---- the run --------------------------------------------------------------------------------------
def main(argv=None) -> int:
    args = parse_args(argv)
    if not under_torchrun() and args.nproc > 1:
        return relaunch_with_torchrun(args.nproc)

    # dist init: env:// under torchrun; a private 1-rank gloo group otherwise (flatshard needs a group).
    if under_torchrun():
        dist.init_process_group("gloo")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", "1"))))
    else:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    rank, world = dist.get_rank(), dist.get_world_size()
    master = rank == 0
    if master and world != args.nproc and any(a.startswith("--nproc") for a in sys.argv[1:]):
        print(f"note: running with torchrun's world size {world}; --nproc {args.nproc} is ignored")

    # data: 90% train, the last 10% held out
    corpus = load_corpus()
    n_train = int(0.9 * len(corpus))
    train_data, val_data = corpus[:n_train], corpus[n_train:]
    cfg = model_config(args)
    data_gen = torch.Generator().manual_seed(args.seed)  # one seed; ranks take different rows (get_batch)

    # model: the same seed on every rank gives identical initial weights before sharding
    torch.manual_seed(args.seed)
    model = FSDP(
        GPT(cfg),
        sharding_strategy=ShardingStrategy[args.strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_factor=args.sharding_factor,
    )
    units = flatshard.units(model)  # one read-only UnitInfo per unit, root first
    n_params = sum(u.numel for u in units)

    # optimizer: weight decay on matrices only (param_groups reads each shard view's full shape)
    opt = torch.optim.AdamW(param_groups(model, args.weight_decay), lr=args.lr, betas=(0.9, 0.95))
    n_state = sum(len(g["params"]) for g in opt.param_groups)

    # loop
    tokens_per_step = world * args.batch_size * cfg.block_size
    losses: list[tuple[int, float]] = []
    steady: dict[str, int] = {}
    loss_sum, since_log = torch.zeros(()), 0
    progress = make_progress(args.quiet or not master)
    if master:
        print(
            f"GPT of {n_params:,} parameters ({cfg.layers} layers, dim {cfg.dim}, {cfg.heads} heads, context "
            f"{cfg.block_size}) in {len(units)} units, {args.strategy} over W={world} ranks; "
            f"{len(corpus):,} bytes of stdlib source, {len(val_data):,} held out",
            flush=True,
        )
    task = progress.add_task("train", total=args.steps, loss=float("nan"), tps=0.0, mem="-", comm="-")
    with progress, model.record_comms() as rec, model.record_memory(opt) as mem:
        t0 = time.perf_counter()
        for step in range(args.steps):
            for group in opt.param_groups:
                group["lr"] = lr_at(step, args.steps, args.lr)
            x, y = get_batch(train_data, data_gen, args.batch_size, cfg.block_size, rank, world)
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            loss_sum += loss.detach()
            since_log += 1
            last = step == args.steps - 1
            if step % args.log_interval == 0 or last:
                steady = model.memory_bytes(opt)  # after the step, before zero_grad: params + grads + state
                # The global mean loss over the steps since the last report. all_reduce is a sync point
                # (every rank waits for the slowest), so it runs once per log interval, not every step.
                dist.all_reduce(loss_sum)
                losses.append((step, loss_sum.item() / (world * since_log)))
                loss_sum.zero_()
                since_log = 0
                tps = tokens_per_step * (step + 1) / (time.perf_counter() - t0)
                progress.update(
                    task,
                    loss=losses[-1][1],
                    tps=tps,
                    comm=fmt_bytes(rec.wire_bytes()),
                    mem=fmt_bytes(steady["params"] + steady["grads"] + steady["optimizer"]),
                )
            opt.zero_grad(set_to_none=True)
            progress.advance(task)
        elapsed = time.perf_counter() - t0

    # evaluation and a sample (every rank runs these forwards: each one all-gathers every unit)
    val_loss = estimate_val_loss(model, val_data, args, cfg, rank, world) if args.eval_batches > 0 else None
    sample = ""
    if args.sample_tokens > 0:
        prompt = torch.tensor([list(b"def ")])
        out = generate(
            model, prompt, args.sample_tokens, cfg.block_size, generator=torch.Generator().manual_seed(args.seed)
        )
        sample = bytes(out[0].tolist()).decode("utf-8", errors="replace")

    run = {
        "args": args,
        "cfg": cfg,
        "world": world,
        "units": units,
        "n_state": n_state,
        "losses": losses,
        "elapsed": elapsed,
        "val_loss": val_loss,
        "sample": sample,
        "steady": steady,
        "peak": mem.peak_total,
    }
    figures = gather_figures(rec, run)  # collective: every rank takes part
    if master:
        if args.json:
            args.json.write_text(json.dumps(figures, indent=1))
        print_summary(figures)
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    return 0


def gather_figures(rec, run: dict) -> dict:
    """The run's figures as plain data: every rank's bytes (one all_gather), bytes sent per step, and
    the formulas each is checked against."""
    args, units, world, steady, n_state = run["args"], run["units"], run["world"], run["steady"], run["n_state"]
    mine = torch.tensor(
        [
            steady["params"],
            steady["grads"],
            steady["optimizer"],
            steady["gathered"],
            steady_formula(units, n_state),
            run["peak"],
            local_numel(units),
        ],
        dtype=torch.int64,
    )
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    n_params = sum(u.numel for u in units)
    padded = sum(u.padded_numel for u in units)
    root = units[0]
    f, r = root.shard_size, root.replicate_size  # the sharding factor and the replicas
    formula = comm_formula(args.strategy, f, r, padded, root.padded_numel)
    summary = rec.summary()  # every step moves the same bytes, so totals / steps is the per-step figure
    tokens_per_step = world * args.batch_size * run["cfg"].block_size
    losses = run["losses"]
    return {
        "strategy": args.strategy,
        "world": world,
        "sharding_factor": f,
        "replicas": r,
        "model": run["cfg"].__dict__,
        "units": len(units),
        "steps": args.steps,
        "batch_size": args.batch_size,
        "tokens_per_step": tokens_per_step,
        "P": n_params,
        "P_padded": padded,
        "root_padded": root.padded_numel,
        "unit_shard_numel": [u.shard_numel for u in units],
        "n_state_params": n_state,
        "losses": losses,
        "first_loss": losses[0][1],
        "last_loss": losses[-1][1],
        "val_loss": run["val_loss"],
        "tokens_per_s": tokens_per_step * args.steps / run["elapsed"],
        "seconds": run["elapsed"],
        "memory": {
            "per_rank": [dict(zip(("params", "grads", "optimizer", "gathered"), t[:4].tolist())) for t in every],
            "steady_bytes": [int(t[:3].sum()) for t in every],
            "formula_bytes": [int(t[4]) for t in every],
            "peak_bytes": [int(t[5]) for t in every],
            "local_numel": [int(t[6]) for t in every],  # parameter elements each rank owns (padding excluded)
            "ideal_bytes": 16 * n_params / f,
        },
        "comm_per_step": {k: v["wire_bytes"] / args.steps for k, v in summary.items()},
        "comm_count_per_step": {k: v["count"] / args.steps for k, v in summary.items()},
        "comm_formula": formula,
        "comm_fsdp_per_step": sum(v["wire_bytes"] for k, v in summary.items() if not k.startswith("optimizer"))
        / args.steps,
        "comm_fsdp_formula": sum(v for k, v in formula.items() if not k.startswith("optimizer")),
        "sample": run["sample"],
    }


# ---- display (rank 0) ---------------------------------------------------------------------------
def make_progress(disable: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    return Progress(
        BarColumn(bar_width=12),
        MofNCompleteColumn(),
        TextColumn(
            "loss {task.fields[loss]:.3f} · {task.fields[tps]:,.0f} tok/s · {task.fields[mem]}/rank · "
            "sent {task.fields[comm]}/rank"
        ),
        disable=disable,
    )


def print_summary(fig: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    n, strategy, mem = fig["world"], fig["strategy"], fig["memory"]
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and squeeze the tables
        console = Console(width=110)
    head = Table(title=f"flatshard: byte-level GPT on the standard library's source ({strategy})", show_header=False)
    val = "-" if fig["val_loss"] is None else f"{fig['val_loss']:.3f}"
    head.add_row("parameters P (padded)", f"{fig['P']:,} ({fig['P_padded']:,})")
    head.add_row("ranks W · units · steps", f"{n} · {fig['units']} · {fig['steps']}")
    head.add_row(
        "train loss, first → last", f"{fig['first_loss']:.3f} → {fig['last_loss']:.3f}  (ln 256 = {math.log(256):.3f})"
    )
    head.add_row("validation loss", val)
    head.add_row("tokens/s, all ranks", f"{fig['tokens_per_s']:,.0f}  ({fig['seconds']:.1f} s)")
    head.add_row("peak bytes per rank, incl. gathered", fmt_bytes(max(mem["peak_bytes"])))
    console.print(head)

    ideal = f"16·P/F (F={fig['sharding_factor']})"
    mt = Table(title="bytes per rank after a step (fp32, AdamW)")
    for col in ("rank", "params + grads", "AdamW state", "total", "per-unit formula", ideal):
        mt.add_column(col, justify="right")
    for r, held in enumerate(mem["per_rank"]):
        mt.add_row(
            str(r),
            f"{held['params'] + held['grads']:,}",
            f"{held['optimizer']:,}",
            f"{mem['steady_bytes'][r]:,}",
            f"{mem['formula_bytes'][r]:,}",
            f"{mem['ideal_bytes']:,.0f}",
        )
    console.print(mt)

    headline = {
        "FULL_SHARD": "3·P·b·(F−1)/F − root",
        "HYBRID_SHARD": "3·P·b·(F−1)/F − root + 2·(P/F)·b·(R−1)/R",
        "SHARD_GRAD_OP": "2·P·b·(F−1)/F",
        "_HYBRID_SHARD_ZERO2": "2·P·b·(F−1)/F + 2·(P/F)·b·(R−1)/R",
        "NO_SHARD": "2·P·b·(W−1)/W",
    }[strategy]
    ct = Table(title="bytes sent per rank per step (ring algorithm)")
    for col, just in (
        ("collective", "left"),
        ("phase", "left"),
        ("group", "left"),
        ("calls", "right"),
        ("measured", "right"),
        ("formula", "right"),
    ):
        ct.add_column(col, justify=just)
    formula, measured = fig["comm_formula"], fig["comm_per_step"]
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    for key in sorted(set(measured) | set(formula), key=lambda k: (order.get(k.split("/")[0], 3), k)):
        phase, kind, group = key.split("/")
        ct.add_row(
            kind + (" (grad norm)" if phase == "optimizer" else ""),
            phase,
            group,
            f"{fig['comm_count_per_step'].get(key, 0):g}",
            f"{measured.get(key, 0.0):,.0f}",
            f"{formula.get(key, 0.0):,.0f}",
        )
    ct.add_row(
        f"[bold]params + grads: {headline}",
        "",
        "",
        "",
        f"[bold]{fig['comm_fsdp_per_step']:,.0f}",
        f"[bold]{fig['comm_fsdp_formula']:,.0f}",
    )
    console.print(ct)
    if fig["sample"]:
        console.print("[bold]sample[/bold] (prompt 'def '):")
        console.print(fig["sample"], markup=False, highlight=False)


if __name__ == "__main__":
    sys.exit(main())
