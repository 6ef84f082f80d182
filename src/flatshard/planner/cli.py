"""``flatshard plan``: what fits, what it costs, which sharding factor to choose.

    flatshard plan --params 7B --units 32 --world 8 --gpu-mem 40GB
    flatshard plan --model llama2-70b --world 32 --gpus-per-node 8 --precision bf16-mixed --json
    flatshard plan --params 70B --units 80 --world 8 --offload --host-mem 2TB

A readable table by default; ``--json`` prints exactly one JSON object (see ``to_json_dict``). Bad
input is one message naming the problem and the fix on stderr, exit code 2, no traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from flatshard.planner.errors import PlanError
from flatshard.planner.inputs import OPTIMIZERS, PRECISIONS, Links, PlanInputs
from flatshard.planner.models import PRESETS, ModelShape, preset, with_overrides
from flatshard.planner.plan import PlanReport, plan, recommend_offload, to_json_dict
from flatshard.planner.quantities import (
    fmt_bytes,
    fmt_count,
    fmt_seconds,
    parse_bandwidth,
    parse_bytes,
    parse_count,
)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse would print usage and exit; we explain
        raise PlanError(message, "see `flatshard plan --help`")


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="flatshard plan",
        description="Per-rank memory, communication and step time of every "
        "sharding strategy and sharding factor, and the recommended one (the smallest F that fits).",
    )
    model = p.add_argument_group("model")
    model.add_argument("--model", help=f"a preset: {', '.join(PRESETS)}")
    model.add_argument("--params", help="parameter count: 7e9, 7B, 175B, 350M")
    model.add_argument("--units", type=int, help="FSDP units M (default: one per layer for a preset, 1 with --params)")
    model.add_argument("--root-params", default="0", help="elements kept in the root unit (with --params; default 0)")
    model.add_argument(
        "--param-tensors", type=int, default=0, help="original parameter count, for AdamW's step tensors"
    )
    for name in ("layers", "hidden", "vocab", "heads", "kv-heads", "intermediate", "max-positions"):
        model.add_argument(f"--{name}", type=int, help="Hugging Face-style config number")
    model.add_argument("--arch", choices=("llama", "gpt"), help="architecture for config numbers (default llama)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--world", type=int, required=False, help="world size W (number of ranks)")
    cluster.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node G (default 8)")
    cluster.add_argument(
        "--gpu-mem", default="80GB", help="device memory: 40GB (10^9 B) or 40GiB (2^30 B); default 80GB"
    )
    cluster.add_argument("--headroom", type=float, default=0.1, help="fraction of memory kept free (default 0.1)")
    cluster.add_argument("--sharding-factor", action="append", type=int, help="plan only this F (repeatable)")
    cluster.add_argument("--intra-bw", default="300GB/s", help="intra-node bandwidth per rank per direction")
    cluster.add_argument("--inter-bw", default="25GB/s", help="inter-node bandwidth per rank (200Gb/s = 25GB/s)")
    cluster.add_argument("--intra-latency-us", type=float, default=5.0, help="per ring step (default 5)")
    cluster.add_argument("--inter-latency-us", type=float, default=10.0, help="per ring step (default 10)")
    offload = p.add_argument_group("CPU offload (CPUOffload(offload_params=True))")
    offload.add_argument(
        "--offload",
        action="store_true",
        help="also print every plan with CPU offload (device, host, copies, CPU optimizer)",
    )
    offload.add_argument(
        "--host-mem",
        help="host memory per node, shared by its ranks, e.g. 1TB "
        "(default unknown: the host need is reported, not judged)",
    )
    offload.add_argument(
        "--pcie-bw",
        default="25GB/s",
        help="host<->device copy bandwidth per rank per direction (default 25GB/s, PCIe Gen4 x16)",
    )
    offload.add_argument(
        "--host-bw",
        default="100GB/s",
        help="host memory bandwidth per node the CPU optimizer step achieves (default 100GB/s, an assumption)",
    )
    training = p.add_argument_group("training")
    training.add_argument("--precision", default="fp32", choices=tuple(PRECISIONS))
    training.add_argument("--optimizer", default="adam", choices=tuple(OPTIMIZERS))
    training.add_argument("--prefetch", type=int, default=0, help="prefetch depth d (engine default 0)")
    training.add_argument("--micro-batch", type=int, default=0, help="sequences per rank per step")
    training.add_argument("--seq-len", type=int, default=0, help="tokens per sequence")
    training.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    training.add_argument(
        "--no-flash-attention", action="store_true", help="attention keeps its s x s score matrices (eager attention)"
    )
    training.add_argument("--activation-bytes", help="per-rank activation bytes, overriding the estimate")
    training.add_argument("--compute-time", type=float, help="forward+backward compute seconds per step")
    training.add_argument("--tflops", type=float, help="achieved TFLOP/s per device, for 6*P*tokens compute")
    training.add_argument(
        "--exposed-all-reduce",
        action="store_true",
        help="count the replicate all-reduces as not overlapped with backward",
    )
    p.add_argument("--json", action="store_true", help="print exactly one JSON object")
    return p


def _shape(args: argparse.Namespace) -> ModelShape | None:
    numbers = {
        "layers": args.layers,
        "hidden": args.hidden,
        "vocab": args.vocab,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "intermediate": args.intermediate,
        "max_positions": args.max_positions,
    }
    if args.model:
        return with_overrides(preset(args.model), arch=args.arch, **numbers)
    if all(numbers[k] is not None for k in ("layers", "hidden", "vocab", "heads")):
        return ModelShape(args.arch or "llama", **{k: v for k, v in numbers.items() if v is not None})
    given = [k for k, v in numbers.items() if v is not None]
    if given and args.params is None:
        raise PlanError(
            f"config numbers ({', '.join(given)}) need all of --layers, --hidden, --vocab, --heads",
            "pass the missing ones, or --model PRESET, or --params N",
        )
    return None


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Turn parsed arguments into PlanInputs; every mistake is a PlanError with its fix."""
    if args.world is None:
        raise PlanError("--world is required", "pass the number of ranks, e.g. --world 8")
    if args.model and args.params:
        raise PlanError("--model and --params both given", "pass one: a preset, or a parameter count")
    shape = _shape(args)
    links = Links(
        parse_bandwidth(args.intra_bw, "--intra-bw"),
        parse_bandwidth(args.inter_bw, "--inter-bw"),
        args.intra_latency_us / 1e6,
        args.inter_latency_us / 1e6,
    )
    common: dict[str, Any] = dict(
        gpus_per_node=args.gpus_per_node,
        device_memory_bytes=parse_bytes(args.gpu_mem, "--gpu-mem"),
        headroom=args.headroom,
        precision=args.precision,
        optimizer=args.optimizer,
        param_tensors=args.param_tensors,
        prefetch_depth=args.prefetch,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        activation_checkpointing=args.checkpointing,
        flash_attention=not args.no_flash_attention,
        compute_time_s=args.compute_time,
        device_flops=None if args.tflops is None else args.tflops * 1e12,
        links=links,
        overlap_all_reduce=not args.exposed_all_reduce,
        sharding_factors=args.sharding_factor,
        activation_bytes=None
        if args.activation_bytes is None
        else parse_bytes(args.activation_bytes, "--activation-bytes"),
        offload=args.offload,
        host_memory_bytes=None if args.host_mem is None else parse_bytes(args.host_mem, "--host-mem"),
        pcie_bandwidth=parse_bandwidth(args.pcie_bw, "--pcie-bw"),
        host_bandwidth=parse_bandwidth(args.host_bw, "--host-bw"),
    )
    if args.params is not None:
        units = 1 if args.units is None else args.units
        return PlanInputs.from_params(
            parse_count(args.params, "--params"),
            units,
            args.world,
            root_elements=parse_count(args.root_params, "--root-params"),
            shape=shape,
            **common,
        )
    if shape is None:
        raise PlanError("no model given", "pass --model PRESET (e.g. llama2-7b) or --params N (e.g. 7B)")
    if args.root_params != "0":
        raise PlanError("--root-params goes with --params", "a preset's root is its embeddings, head and final norm")
    return PlanInputs.from_shape(shape, args.world, units=args.units, **common)


def _gb(n: float) -> str:
    return f"{n / 1e9:.4g}"


def _table(title: str, columns: tuple[str, ...]):  # noqa: ANN202 (rich is imported lazily)
    from rich import box
    from rich.table import Table

    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1))
    for col in columns:
        if col == "strategy":
            table.add_column(col, no_wrap=True, min_width=19)
        else:
            table.add_column(col, justify="right")
    return table


def _print_table(report: PlanReport) -> None:
    from rich.console import Console

    i, rec = report.inputs, report.inputs.recipe
    console = Console() if sys.stdout.isatty() else Console(width=120)
    m = len(i.unit_elements) + (1 if i.root_elements else 0)
    opt = OPTIMIZERS[i.optimizer][0]
    console.print(
        f"[bold]{fmt_count(i.params)}[/] parameters in {m} units (root {fmt_count(i.root_elements)}), "
        f"W={i.world_size}, {i.gpus_per_node} GPUs/node, {rec.name}, {i.optimizer}. Steady = "
        f"{rec.master_bytes}+{rec.grad_shard_bytes}+{opt} bytes per shard element (params+grads+"
        f"optimizer). Fits: peak <= {fmt_bytes(i.budget_bytes)} ({fmt_bytes(i.device_memory_bytes)} "
        f"less {i.headroom:.0%})."
    )
    mem = _table(
        "memory per rank, GB (10^9 bytes)",
        ("strategy", "F", "R", "steady", "gather", "unsh.grad", "activ.", "fwd peak", "peak", "fits"),
    )
    com = _table(
        "communication per rank per step, GB; step time",
        ("strategy", "F", "AG f/b", "RS", "AR", "intra", "inter", "total", "serial", "overlap"),
    )
    for p in report.plans:
        b, c, t = p.memory, p.comm, p.time
        mem.add_row(
            p.strategy.value,
            str(p.sharding_factor),
            str(p.replicas),
            *(_gb(x) for x in (b.steady, b.gather_buffer, b.unsharded_grad, b.activations, b.forward_peak, b.peak)),
            "[green]yes[/]" if p.fits else "[red]no[/]",
        )
        n = c.counts
        com.add_row(
            p.strategy.value,
            str(p.sharding_factor),
            f"{n.all_gather_forward}/{n.all_gather_backward}",
            str(n.reduce_scatter_backward),
            str(n.all_reduce_backward),
            *(_gb(x) for x in (c.intra_node, c.inter_node, c.total)),
            fmt_seconds(t.serial_s),
            fmt_seconds(t.overlapped_s),
        )
    console.print(mem)
    console.print(com)
    if i.offload:
        console.print(_offload_table(report))
    r = report.recommendation
    head = f"{r.strategy.value}, F={r.sharding_factor}" if r.strategy else "none"
    console.print(f"[bold]recommendation:[/] {head}. {r.why}")
    if i.offload and r.strategy is not None:  # when nothing fits, ``why`` already has the offload verdict
        o = recommend_offload(i, report.plans)
        head = f"{o.strategy.value}, F={o.sharding_factor}" if o.strategy else "none"
        console.print(f"[bold]with CPU offload:[/] {head}. {o.why}")


def _verdict(fits: bool | None) -> str:
    return "[green]yes[/]" if fits else ("?" if fits is None else "[red]no[/]")


def _offload_table(report: PlanReport):  # noqa: ANN202
    i = report.inputs
    host = "unknown" if i.host_memory_bytes is None else f"<= {fmt_bytes(i.host_budget_bytes or 0)}"
    table = _table(
        f"with CPU offload, GB: device peak per rank; host per rank and per node of {i.ranks_per_node} "
        f"(fits: {host}); copies per rank per step at {fmt_bytes(i.pcie_bandwidth)}/s; CPU optimizer "
        f"at {fmt_bytes(i.host_bandwidth)}/s per node",
        ("strategy", "F", "device", "ok", "host", "node", "ok", "fits", "H2D", "D2H", "copy", "optim.", "step"),
    )
    for p in report.plans:
        o = p.offload
        table.add_row(
            p.strategy.value,
            str(p.sharding_factor),
            _gb(o.device_peak),
            _verdict(o.device_fits),
            _gb(o.host_per_rank),
            _gb(o.host_per_node),
            _verdict(o.host_fits),
            _verdict(o.fits),
            _gb(o.host_to_device),
            _gb(o.device_to_host),
            fmt_seconds(o.copy_s),
            fmt_seconds(o.optimizer_s),
            fmt_seconds(o.step_time_s),
        )
    return table


def main(argv: list[str]) -> int:
    """Entry point of ``flatshard plan``; returns the exit code (0 ok, 2 bad input)."""
    try:
        args = _parser().parse_args(argv)
        report = plan(inputs_from_args(args))
    except PlanError as e:
        print(f"flatshard plan: error: {e.problem}\n  fix: {e.fix}", file=sys.stderr)
        return 2
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if args.json:
        print(json.dumps(to_json_dict(report), indent=2))
    else:
        _print_table(report)
    return 0
