"""What examples/train_gpt.py prints and writes: the progress of a run and its figures at the end.

* Progress, every ``--log-interval`` steps: a rich bar on a terminal; a plain line on anything else
  (a log file, a pipe, a job scheduler's output), since a bar that never refreshes shows nothing; and,
  with ``--metrics FILE``, one JSON object per line with the same figures. ``TrainLog`` does all three.
* MFU (model FLOPs utilisation): the example GPT's FLOPs per token (``gpt.flops_per_token``) times
  the tokens per second, over the devices' peak. The peak is known for the GPUs in ``PEAK_TFLOPS`` or
  when given (``--peak-tflops``); otherwise MFU is reported as unknown, never guessed.
* The figures at the end come from flatshard's recorders (``record_comms``, ``record_memory``,
  ``memory_bytes``) and its planner (``flatshard.planner.plan_strategy`` on the run's own units), so
  the tables set what was measured beside what the cost model predicts, with no formula re-derived here.

Only flatshard's public API is used.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from flatshard.planner import PlanInputs, plan_strategy

# Dense peak TFLOP/s per device from the vendors' data sheets (no sparsity), for the dtype matmuls run
# in: bf16 under --precision bf16, fp32 otherwise (PyTorch's default fp32 matmuls do not use TF32).
# More specific names first: the first key found in torch.cuda.get_device_name() is taken.
PEAK_TFLOPS = {
    "H100 PCIe": {"bf16": 756.0, "fp32": 51.0},
    "H100": {"bf16": 989.0, "fp32": 67.0},
    "H200": {"bf16": 989.0, "fp32": 67.0},
    "A100": {"bf16": 312.0, "fp32": 19.5},
}


def peak_flops(device: torch.device, precision: str, given: Optional[float]) -> tuple[Optional[float], str]:
    """(peak FLOP/s of one device, where that figure comes from); (None, why) when it is not known."""
    if given is not None:
        return given * 1e12, f"{given:g} TFLOP/s per device (--peak-tflops)"
    if device.type != "cuda":
        return None, "unknown: the peak rate of a CPU is not known here; pass --peak-tflops"
    name = torch.cuda.get_device_name(device)
    for key, rates in PEAK_TFLOPS.items():
        if key in name:
            return rates[precision] * 1e12, f"{rates[precision]:g} TFLOP/s per device ({name}, {precision})"
    return None, f"unknown for {name}: pass --peak-tflops"


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def gather_memory(recorder, device: torch.device) -> dict[str, list[int]]:
    """Every rank's bytes (one all_gather): what flatshard manages now (params, grads, optimizer,
    gathered: ``record_memory``'s recorder), its peak since the recorder opened, and on a GPU the
    allocator's peak (``torch.cuda.max_memory_allocated``)."""
    now = recorder.sample()  # what memory_bytes(optimizer) reports, and the peak brought up to date
    cuda = device.type == "cuda"
    mine = [sum(now.values()), recorder.peak_total, torch.cuda.max_memory_allocated(device) if cuda else -1]
    mine = torch.tensor(mine, dtype=torch.int64, device=device)
    every = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine)
    rows = [t.tolist() for t in every]
    out = {"now": [r[0] for r in rows], "peak": [r[1] for r in rows]}
    out["device_peak"] = [r[2] for r in rows] if cuda else None
    return out


class TrainLog:
    """Progress every log interval, on rank 0: a rich bar ("bar"), plain lines ("lines") or nothing
    ("quiet"), and JSON lines in ``metrics`` when given. Other ranks pass ``mode="quiet"``, no metrics."""

    def __init__(self, mode: str, total: int, start: int, metrics: Optional[Path]):
        self.mode, self.total = mode, total
        self._file = open(metrics, "a" if start else "w") if metrics else None  # a resumed run appends
        self._bar = None
        if mode == "bar":
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._bar = Progress(BarColumn(bar_width=12), MofNCompleteColumn(), TextColumn("{task.fields[text]}"))
            self._task = self._bar.add_task("train", total=total, completed=start, text="")

    def __enter__(self) -> TrainLog:
        if self._bar is not None:
            self._bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._bar is not None:
            self._bar.stop()
        if self._file is not None:
            self._file.close()

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.advance(self._task)

    def record(self, entry: dict) -> None:
        """``entry``: step (steps done), loss, lr, step_ms, tokens_per_s, memory (gather_memory's),
        mfu (a fraction or None), comm_bytes_per_step."""
        mem = entry["memory"]
        mfu = "MFU unknown" if entry["mfu"] is None else f"MFU {100 * entry['mfu']:.1f}%"
        device = "" if mem["device_peak"] is None else f", device peak {fmt_bytes(max(mem['device_peak']))}"
        text = (
            f"loss {entry['loss']:.4f}  lr {entry['lr']:.2e}  {entry['step_ms']:.1f} ms/step  "
            f"{entry['tokens_per_s']:,.0f} tok/s  mem/rank {fmt_bytes(max(mem['now']))} "
            f"(peak {fmt_bytes(max(mem['peak']))}{device})  {mfu}"
        )
        if self.mode == "lines":
            print(f"step {entry['step']:>{len(str(self.total))}}/{self.total}  {text}", flush=True)
        elif self._bar is not None:
            self._bar.update(self._task, text=text)
        if self._file is not None:
            self._file.write(json.dumps(entry) + "\n")
            self._file.flush()


# ---- the figures at the end -----------------------------------------------------------------------
def unit_shapes(model, units) -> dict[str, tuple[tuple[int, ...], ...]]:
    """Each unit's parameters' full shapes in module order (``named_parameters``), by unit name: what the
    planner cuts, as the engine did, under shard_boundaries "rows" and "params"."""
    order = {name: i for i, (name, _) in enumerate(model.named_parameters())}
    shape = {name: tuple(getattr(p, "orig_shape", p.shape)) for name, p in model.named_parameters()}
    out = {}
    for u in units:
        names = [n if u.is_root else f"{u.name}.{n}" for n in u.param_names]
        out[u.name] = tuple(shape[n] for n in sorted(names, key=order.__getitem__))
    return out


def planned(units, world: int, strategy: str, n_state: int, precision: str, gpus_per_node: int, shapes: dict):
    """The planner's plan for this run's own units (flatshard.units), strategy, F, precision and shard
    boundaries (``shapes``: ``unit_shapes``)."""
    root = [u for u in units if u.is_root]
    inputs = PlanInputs(
        world_size=world,
        unit_elements=tuple(u.numel for u in units if not u.is_root),
        root_elements=root[0].numel if root else 0,
        gpus_per_node=gpus_per_node,
        precision="bf16-mixed" if precision == "bf16" else "fp32",
        param_tensors=n_state,
        shard_boundaries=units[0].shard_boundaries,
        unit_param_shapes=tuple(shapes[u.name] for u in units if not u.is_root),
        root_param_shapes=shapes[root[0].name] if root else None,
    )
    return plan_strategy(inputs, strategy, units[0].shard_size)


STEP_PHASES = ("forward", "backward", "optimizer")  # a training step's traffic; checkpoints are not counted
PLANNED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")  # what moves parameters and gradients


def figures(run: dict) -> dict:
    """The run's figures as plain data. Collective: every rank takes part (one all_gather)."""
    args, units, world, rec = run["args"], run["units"], run["world"], run["comms"]
    steady, steps = run["steady"], run["steps_run"]
    mine = torch.tensor([steady[k] for k in ("params", "grads", "optimizer", "gathered")], device=run["device"])
    mine = torch.cat([mine, torch.tensor([run["peak"], sum(u.local_numel for u in units)], device=run["device"])])
    every = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(every, mine)
    every = [t.tolist() for t in every]
    f, r = units[0].shard_size, units[0].replicate_size
    p = planned(units, world, args.strategy, run["n_state"], args.precision, run["gpus_per_node"], run["shapes"])
    summary = {k: v for k, v in rec.summary().items() if k.split("/")[0] in STEP_PHASES}
    fsdp = {k: v for k, v in summary.items() if k.split("/")[1] in PLANNED_KINDS and not k.startswith("optimizer")}
    n_params = sum(u.numel for u in units)
    tokens_per_step = world * args.batch_size * run["cfg"].block_size
    tokens_per_s = tokens_per_step * steps / run["elapsed"] if steps else 0.0
    peak, where = run["peak_flops"]
    mfu = None if peak is None or not steps else run["flops_per_token"] * tokens_per_s / (world * peak)
    counts = p.comm.counts
    losses = run["losses"]
    return {
        "strategy": args.strategy,
        "front_end": args.front_end,
        "precision": args.precision,
        "optimizer": args.optimizer,
        "shard_boundaries": units[0].shard_boundaries,
        "device": run["device"].type,
        "world": world,
        "sharding_factor": f,
        "replicas": r,
        "model": run["cfg"].__dict__,
        "units": len(units),
        "steps": args.steps,
        "start_step": run["start_step"],
        "batch_size": args.batch_size,
        "tokens_per_step": tokens_per_step,
        "P": n_params,
        "P_padded": sum(u.padded_numel for u in units),
        "root_padded": units[0].padded_numel,
        "unit_shard_numel": [u.shard_numel for u in units],
        "n_state_params": run["n_state"],
        "losses": losses,
        "first_loss": losses[0][1] if losses else math.nan,
        "last_loss": losses[-1][1] if losses else math.nan,
        "val_loss": run["val_loss"],
        "tokens_per_s": tokens_per_s,
        "seconds": run["elapsed"],
        "flops_per_token": run["flops_per_token"],
        "mfu": mfu,
        "peak_flops_source": where,
        "memory": {
            "per_rank": [dict(zip(("params", "grads", "optimizer", "gathered"), t[:4])) for t in every],
            "steady_bytes": [sum(t[:3]) for t in every],
            "planned_steady_bytes": p.memory.steady,  # the planner: the largest rank (rank 0 for "flat")
            # each rank's, by its place in its shard group (contiguous groups of F ranks)
            "planned_steady_per_rank": [p.memory.steady_per_rank[r % f] for r in range(world)],
            "planned_peak_bytes": p.memory.peak,
            "peak_bytes": [t[4] for t in every],
            "local_numel": [t[5] for t in every],  # parameter elements each rank owns (padding excluded)
            "ideal_bytes": 16 * n_params / f,
        },
        "comm_per_step": {k: v["wire_bytes"] / max(steps, 1) for k, v in summary.items()},
        "comm_count_per_step": {k: v["count"] / max(steps, 1) for k, v in summary.items()},
        "comm_planned": {k: float(getattr(p.comm, k)) for k in PLANNED_KINDS},
        "comm_planned_calls": {
            "forward/all_gather": counts.all_gather_forward,
            "backward/all_gather": counts.all_gather_backward,
            "backward/reduce_scatter": counts.reduce_scatter_backward,
            "backward/all_reduce": counts.all_reduce_backward,
        },
        "comm_fsdp_per_step": sum(v["wire_bytes"] for v in fsdp.values()) / max(steps, 1),
        "comm_fsdp_planned": float(p.comm.total),
        "sample": run["sample"],
    }


def print_summary(fig: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    front = ", fully_shard" if fig.get("front_end") == "fully_shard" else ""
    console = Console()
    if not console.is_terminal:  # piped or logged: rich would assume 80 columns and squeeze the tables
        console = Console(width=110)
    head = Table(
        title=f"flatshard: byte-level GPT on the standard library's source ({fig['strategy']}{front}, "
        f"{fig['precision']}, {fig['optimizer']})",
        show_header=False,
    )
    val = "-" if fig["val_loss"] is None else f"{fig['val_loss']:.3f}"
    mem = fig["memory"]
    head.add_row("parameters P (padded)", f"{fig['P']:,} ({fig['P_padded']:,})")
    head.add_row("ranks W · units · steps", f"{fig['world']} ({fig['device']}) · {fig['units']} · {fig['steps']}")
    if fig["start_step"]:
        head.add_row("resumed at step", str(fig["start_step"]))
    if fig["losses"]:
        head.add_row(
            "train loss, first → last",
            f"{fig['first_loss']:.3f} → {fig['last_loss']:.3f}  (ln 256 = {math.log(256):.3f})",
        )
    head.add_row("validation loss", val)
    head.add_row("tokens/s, all ranks", f"{fig['tokens_per_s']:,.0f}  ({fig['seconds']:.1f} s)")
    mfu = "unknown" if fig["mfu"] is None else f"{100 * fig['mfu']:.2f}%"
    head.add_row("MFU", f"{mfu}  ({fig['flops_per_token']:,} FLOPs/token; peak {fig['peak_flops_source']})")
    head.add_row("peak bytes per rank (recorder)", fmt_bytes(max(mem["peak_bytes"])))
    head.add_row("planned peak per rank (planner)", fmt_bytes(mem["planned_peak_bytes"]))
    console.print(head)

    mt = Table(title="bytes per rank after a step: measured (memory_bytes) and planned (flatshard.planner)")
    for col in ("rank", "params + grads", "optimizer", "total", "planned (AdamW state)", "16·P/F"):
        mt.add_column(col, justify="right")
    for r, held in enumerate(mem["per_rank"]):
        mt.add_row(
            str(r),
            f"{held['params'] + held['grads']:,}",
            f"{held['optimizer']:,}",
            f"{mem['steady_bytes'][r]:,}",
            f"{mem['planned_steady_per_rank'][r]:,}",
            f"{mem['ideal_bytes']:,.0f}",
        )
    console.print(mt)

    ct = Table(title="collectives per rank per step: measured (record_comms) and planned (flatshard.planner)")
    for col, just in (("collective", "left"), ("phase", "left"), ("group", "left"), ("calls", "right")):
        ct.add_column(col, justify=just)
    ct.add_column("planned calls", justify="right")
    ct.add_column("bytes sent", justify="right")
    order = {"forward": 0, "backward": 1, "optimizer": 2}
    measured, calls, plan_calls = fig["comm_per_step"], fig["comm_count_per_step"], fig["comm_planned_calls"]
    for key in sorted(measured, key=lambda k: (order.get(k.split("/")[0], 3), k)):
        phase, kind, group = key.split("/")
        planned_calls = plan_calls.get(f"{phase}/{kind}")
        ct.add_row(
            kind + (" (grad norm)" if phase == "optimizer" else ""),
            phase,
            group,
            f"{calls[key]:.3g}",
            "not planned" if planned_calls is None else str(planned_calls),
            f"{measured[key]:,.0f}",
        )
    console.print(ct)
    kt = Table(title="bytes sent per rank per step, by collective")
    for col in ("collective", "measured", "planned"):
        kt.add_column(col, justify="right" if col != "collective" else "left")
    for kind, want in fig["comm_planned"].items():
        got = sum(v for k, v in measured.items() if k.split("/")[1] == kind and not k.startswith("optimizer"))
        kt.add_row(kind, f"{got:,.0f}", f"{want:,.0f}")
    kt.add_row(
        "[bold]params + grads", f"[bold]{fig['comm_fsdp_per_step']:,.0f}", f"[bold]{fig['comm_fsdp_planned']:,.0f}"
    )
    console.print(kt)
    if fig["sample"]:
        console.print("[bold]sample[/bold] (prompt 'def '):")
        console.print(fig["sample"], markup=False, highlight=False)
    sys.stdout.flush()
