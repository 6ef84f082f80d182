"""``flatshard plan``: what fits, what it costs, which sharding factor to choose.

    flatshard plan --params 7B --units 32 --world 8 --gpu-mem 40GB
    flatshard plan --model llama2-70b --world 32 --gpus-per-node 8 --precision bf16-mixed --json
    flatshard plan --hf-config path/to/config.json --world 8 --gpu-mem 80GB --micro-batch 4 --seq-len 4096
    flatshard plan --params 70B --units 80 --world 8 --offload --host-mem 2TB
    flatshard plan --model llama-7b --world 8 --shard-boundaries params
    flatshard plan --model llama2-7b --world 16 --gpu-mem 40GB --optimizer-across-replicas
    flatshard plan --params 3241472 --units 4 --root-params 82432 --world 4 --gpus-per-node 2 \\
        --exchange direct --calibration bench/results/cluster_200mbit.json --compute-time 0.33 --optimizer-time 0.03

A summary within 100 columns by default, the full tables with ``--full`` (render.py); ``--json``
prints exactly one JSON object (see ``to_json_dict``). Exit status: 0 when a plan fits, 1 when
nothing fits (the table or JSON is still printed), 2 for bad input: then ``usage: ...`` and
``flatshard plan: error: ...`` with a ``fix:`` line on stderr, no traceback. A flag the others leave
without effect (``--tflops`` without a micro-batch and a sequence length, ``--full`` with ``--json``)
is bad input, never ignored.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, NoReturn

from flatshard.planner.boundaries import PLANNED
from flatshard.planner.calibration import read_calibration
from flatshard.planner.errors import PlanError
from flatshard.planner.inputs import EXCHANGES, OPTIMIZERS, PRECISIONS, Links, PlanInputs
from flatshard.planner.json_form import to_json_dict
from flatshard.planner.models import PRESETS, ModelShape, preset, read_hf_config, with_overrides
from flatshard.planner.plan import PlanReport, plan, recommend_offload
from flatshard.planner.quantities import parse_bandwidth, parse_bytes, parse_count
from flatshard.planner.render import print_report

USAGE = "flatshard plan (--model NAME | --hf-config PATH | --params N) --world W [options]"
EXIT_FITS, EXIT_NOTHING_FITS, EXIT_BAD_INPUT = 0, 1, 2
EPILOG = """\
examples:
  flatshard plan --model llama-7b --world 8 --gpu-mem 40GB --micro-batch 4 --seq-len 4096 --checkpointing
  flatshard plan --model llama2-7b --world 16 --micro-batch 1 --seq-len 4096 --tflops 300  # + compute
  flatshard plan --params 7B --units 32 --world 8 --gpu-mem 40GB --json   # one JSON object
  flatshard plan --model llama2-70b --world 32 --precision bf16-mixed --full   # every column
  flatshard plan --params 70B --units 80 --world 8 --offload --host-mem 2TB   # and with CPU offload

Exit status: 0 a plan fits, 1 nothing fits (the plans are still printed), 2 bad input.
docs/planner.md has the formulas and what each figure leaves out."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # argparse would exit; main prints it with the fix
        raise PlanError(message, "see `flatshard plan --help`")


PCIE_BW, HOST_BW = "25GB/s", "100GB/s"  # --pcie-bw and --host-bw when --offload is given without them


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="flatshard plan",
        usage=USAGE,
        description="Per-rank memory, communication and step time of every sharding strategy and sharding\n"
        "factor, and the recommended one (the smallest F that fits). A summary within 100 columns;\n"
        "--full for every column, --json for one JSON object.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    model = p.add_argument_group("model (one of --model, --hf-config, --params is required)")
    model.add_argument("--model", help=f"a preset: {', '.join(PRESETS)} (or --hf-config, or --params: required)")
    model.add_argument(
        "--hf-config",
        metavar="PATH",
        help="a Hugging Face config.json (or its model directory) of a Llama, Mistral or GPT-2 model "
        "(or --model, or --params: required)",
    )
    model.add_argument("--params", help="parameter count: 7e9, 7B, 175B, 350M (or --model, or --hf-config: required)")
    model.add_argument("--units", type=int, help="FSDP units M (default: one per layer for a preset, 1 with --params)")
    model.add_argument("--root-params", default="0", help="elements kept in the root unit (with --params; default 0)")
    model.add_argument(
        "--param-tensors",
        type=int,
        default=0,
        help="original parameter count, for AdamW's 4-byte step per parameter (default 0: not counted)",
    )
    for name in ("layers", "hidden", "vocab", "heads", "kv-heads", "intermediate", "max-positions"):
        model.add_argument(
            f"--{name}", type=int, help="Hugging Face-style config number (default: the preset's or config's)"
        )
    model.add_argument("--arch", choices=("llama", "gpt"), help="architecture for config numbers (default llama)")
    cluster = p.add_argument_group("cluster")
    cluster.add_argument("--world", type=int, required=False, help="world size W, the number of ranks (required)")
    cluster.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node G (default 8)")
    cluster.add_argument(
        "--gpu-mem",
        default="80GB",
        help="device memory per rank, with its unit: 40GB (10^9 B) or 40GiB (2^30 B); default 80GB",
    )
    cluster.add_argument("--headroom", type=float, default=0.1, help="fraction of memory kept free (default 0.1)")
    cluster.add_argument(
        "--sharding-factor",
        action="append",
        type=int,
        help="plan only this F (repeatable; default: every F dividing --world)",
    )
    links = p.add_argument_group("links (or --calibration)")
    links.add_argument("--intra-bw", help="intra-node bandwidth per rank per direction (default 300GB/s)")
    links.add_argument(
        "--inter-bw", help="inter-node bandwidth one rank gets, per direction (default 25GB/s = 200Gb/s)"
    )
    links.add_argument(
        "--inter-node-bw",
        help="what one node's link carries to other nodes, all its ranks together "
        "(default --gpus-per-node x --inter-bw: a NIC per rank)",
    )
    links.add_argument("--intra-latency-us", type=float, help="per collective step (default 5)")
    links.add_argument("--inter-latency-us", type=float, help="per collective step (default 10)")
    links.add_argument(
        "--calibration",
        metavar="PATH",
        help="take the link figures from a calibration: bench/results/cluster_<rate>.json of make cluster "
        "(default: the link flags above)",
    )
    links.add_argument(
        "--exchange",
        choices=EXCHANGES,
        default="ring",
        help='how all-gathers and reduce-scatters move: "ring" (NCCL) or "direct" (flatshard on gloo: '
        "point-to-point, only the chunks to other nodes cross); default ring",
    )
    links.add_argument(
        "--no-inter-node-in-flight",
        action="store_true",
        help="model the engine with inter_node_in_flight=False (every reduction finished before the next unit)",
    )
    offload = p.add_argument_group("CPU offload (CPUOffload(offload_params=True))")
    offload.add_argument(
        "--offload",
        action="store_true",
        help="also print every plan with CPU offload (device, host, copies, CPU optimizer)",
    )
    offload.add_argument(
        "--host-mem",
        help="with --offload: host memory per node, shared by its ranks, e.g. 1TB "
        "(default unknown: the host need is reported, not judged)",
    )
    offload.add_argument(
        "--pcie-bw",
        help=f"with --offload: host<->device copy bandwidth per rank per direction (default {PCIE_BW}, PCIe Gen4 x16)",
    )
    offload.add_argument(
        "--host-bw",
        help=f"with --offload: host memory bandwidth per node the CPU optimizer step achieves (default {HOST_BW}, "
        "an assumption)",
    )
    training = p.add_argument_group("training")
    training.add_argument(
        "--precision",
        default="fp32",
        choices=tuple(PRECISIONS),
        help="fp32 everywhere, or bf16-mixed: bf16 gathers, compute and reductions over fp32 shards and "
        "optimizer state (default fp32)",
    )
    training.add_argument(
        "--optimizer",
        default="adam",
        choices=tuple(OPTIMIZERS),
        help="its state per shard element: "
        + ", ".join(f"{name} {state} bytes" for name, (state, _) in OPTIMIZERS.items())
        + " (default adam)",
    )
    training.add_argument(
        "--prefetch", type=int, default=0, help="prefetch depth d, units gathered ahead (default 0, the engine's)"
    )
    training.add_argument(
        "--shard-boundaries",
        default="flat",
        choices=PLANNED,
        help='where units are cut between ranks, as FullyShardedDataParallel(shard_boundaries=...), or "chunks", '
        "fully_shard's dim-0 chunks: all but flat need a model shape (with --params: flat's figures, and a note); "
        "default flat",
    )
    training.add_argument(
        "--optimizer-across-replicas",
        action="store_true",
        help="also plan the hybrids with shard_optimizer_across_replicas=True (rows +OptR): gradients and "
        "optimizer state split over all W ranks",
    )
    training.add_argument(
        "--micro-batch",
        type=int,
        default=0,
        help="sequences per rank per step (default 0: activations and --tflops compute not counted)",
    )
    training.add_argument(
        "--seq-len",
        type=int,
        default=0,
        help="tokens per sequence (default 0: activations and --tflops compute not counted)",
    )
    training.add_argument("--checkpointing", action="store_true", help="per-layer activation checkpointing")
    training.add_argument(
        "--no-flash-attention", action="store_true", help="attention keeps its s x s score matrices (eager attention)"
    )
    training.add_argument(
        "--activation-bytes",
        help="per-rank activation memory with its unit (e.g. 12GB), overriding the estimate "
        "(default: estimated from the shape, --micro-batch and --seq-len)",
    )
    training.add_argument(
        "--compute-time",
        type=float,
        help="forward+backward compute seconds per step (default: from --tflops, else not counted)",
    )
    training.add_argument(
        "--optimizer-time",
        type=float,
        help="seconds of the whole model's optimizer step on one rank, a rank steps 1/F (default: not counted)",
    )
    training.add_argument(
        "--tflops",
        type=float,
        help="achieved TFLOP/s per device: compute is 6*P*tokens FLOPs, so it needs --micro-batch and "
        "--seq-len (default: compute not counted)",
    )
    training.add_argument(
        "--exposed-all-reduce",
        action="store_true",
        help="count the replicate all-reduces as not overlapped with backward",
    )
    output = p.add_argument_group("output")
    output.add_argument("--json", action="store_true", help="print exactly one JSON object instead of tables")
    output.add_argument(
        "--full",
        action="store_true",
        help="print the full tables (every byte and collective count, serial and overlapped times; "
        "up to 140 columns) instead of the summary",
    )
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
    if args.hf_config:
        return with_overrides(read_hf_config(args.hf_config), arch=args.arch, **numbers)
    if all(numbers[k] is not None for k in ("layers", "hidden", "vocab", "heads")):
        return ModelShape(args.arch or "llama", **{k: v for k, v in numbers.items() if v is not None})
    given = [k for k, v in numbers.items() if v is not None]
    if given and args.params is None:
        raise PlanError(
            f"config numbers ({', '.join(given)}) need all of --layers, --hidden, --vocab, --heads",
            "pass the missing ones, or --model PRESET, or --params N",
        )
    return None


def _check_takes_effect(args: argparse.Namespace) -> None:
    """A flag the other flags leave without effect is a PlanError, never ignored."""
    if args.full and args.json:
        raise PlanError("--full chooses the tables, and --json prints none", "pass one of --full and --json")
    for flag, value in (("--pcie-bw", args.pcie_bw), ("--host-bw", args.host_bw), ("--host-mem", args.host_mem)):
        if value is not None and not args.offload:
            raise PlanError(
                f"{flag} is used by the CPU offload figures, which only --offload prints",
                f"add --offload to plan with CPU offload, or drop {flag}",
            )
    if args.tflops is None:
        return
    if args.compute_time is not None:
        raise PlanError(
            "--tflops and --compute-time both given",
            "pass one: --compute-time SECONDS (measured), or --tflops X with --micro-batch and --seq-len",
        )
    if not (args.micro_batch and args.seq_len):
        raise PlanError(
            "--tflops needs --micro-batch and --seq-len (compute is 6 x parameters x tokens FLOPs)",
            "pass --micro-batch N --seq-len S with it, or --compute-time SECONDS instead",
        )


def _check_checkpointing_takes_effect(args: argparse.Namespace, shape: ModelShape | None) -> None:
    """--checkpointing changes the activations (estimated from a model shape, --micro-batch and --seq-len,
    unless --activation-bytes replaces the estimate) and the compute (the recomputed forward, counted with
    --tflops or --compute-time); with neither counted it would change no figure."""
    if not args.checkpointing:
        return
    estimated = shape is not None and args.micro_batch and args.seq_len and args.activation_bytes is None
    compute = args.compute_time is not None or args.tflops is not None  # --tflops is checked to count above
    if not (estimated or compute):
        raise PlanError(
            "--checkpointing has no effect here: it changes the estimated activations (a model shape with "
            "--micro-batch and --seq-len, not --activation-bytes) and the recomputed forward's time (--tflops "
            "or --compute-time), and neither is counted",
            "pass --micro-batch N --seq-len S with --model/--hf-config, or --compute-time SECONDS, or drop "
            "--checkpointing",
        )


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    """Turn parsed arguments into PlanInputs; every mistake is a PlanError with its fix."""
    if args.world is None:
        raise PlanError("--world is required", "pass the number of ranks, e.g. --world 8")
    _check_takes_effect(args)
    given = [
        flag for flag, v in (("--model", args.model), ("--hf-config", args.hf_config), ("--params", args.params)) if v
    ]
    if len(given) > 1:
        raise PlanError(
            f"{' and '.join(given)} both given", "pass one: a preset, a Hugging Face config, or a parameter count"
        )
    shape = _shape(args)
    _check_checkpointing_takes_effect(args, shape)
    links = _links(args)
    common: dict[str, Any] = dict(
        gpus_per_node=args.gpus_per_node,
        device_memory_bytes=parse_bytes(args.gpu_mem, "--gpu-mem"),
        headroom=args.headroom,
        precision=args.precision,
        optimizer=args.optimizer,
        param_tensors=args.param_tensors,
        prefetch_depth=args.prefetch,
        shard_boundaries=args.shard_boundaries,
        optimizer_across_replicas=args.optimizer_across_replicas,
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        activation_checkpointing=args.checkpointing,
        flash_attention=not args.no_flash_attention,
        compute_time_s=args.compute_time,
        device_flops=None if args.tflops is None else args.tflops * 1e12,
        links=links,
        exchange=args.exchange,
        optimizer_time_s=args.optimizer_time,
        inter_node_in_flight=not args.no_inter_node_in_flight,
        overlap_all_reduce=not args.exposed_all_reduce,
        sharding_factors=args.sharding_factor,
        activation_bytes=None
        if args.activation_bytes is None
        else parse_bytes(args.activation_bytes, "--activation-bytes"),
        offload=args.offload,
        host_memory_bytes=None if args.host_mem is None else parse_bytes(args.host_mem, "--host-mem"),
        pcie_bandwidth=parse_bandwidth(args.pcie_bw or PCIE_BW, "--pcie-bw"),
        host_bandwidth=parse_bandwidth(args.host_bw or HOST_BW, "--host-bw"),
    )
    if args.params is not None:
        units = 1 if args.units is None else args.units
        return PlanInputs.from_params(
            parse_count(args.params, "--params"),
            units,
            args.world,
            root_elements=parse_count(args.root_params, "--root-params"),
            shape=shape,
            units_defaulted=args.units is None,
            **common,
        )
    if shape is None:
        raise PlanError(
            "no model given",
            "pass --model PRESET (e.g. llama2-7b), --hf-config PATH (a config.json) or --params N (e.g. 7B)",
        )
    if args.root_params != "0":
        raise PlanError(
            "--root-params goes with --params", "a model shape's root is its embeddings, head and final norm"
        )
    return PlanInputs.from_shape(shape, args.world, units=args.units, **common)


_LINK_FLAGS = {
    "intra_bw": "--intra-bw",
    "inter_bw": "--inter-bw",
    "inter_node_bw": "--inter-node-bw",
    "intra_latency_us": "--intra-latency-us",
    "inter_latency_us": "--inter-latency-us",
}


def _links(args: argparse.Namespace) -> Links:
    """The link figures: from --calibration, or from the link flags over the defaults (not both)."""
    given = [flag for name, flag in _LINK_FLAGS.items() if getattr(args, name) is not None]
    if args.calibration is not None:
        if given:
            raise PlanError(
                f"--calibration and {', '.join(given)} both given",
                "pass the measured calibration or the link figures, not both",
            )
        return read_calibration(args.calibration, args.gpus_per_node)[0]
    d = Links()
    return Links(
        parse_bandwidth(args.intra_bw, "--intra-bw") if args.intra_bw else d.intra_bandwidth,
        parse_bandwidth(args.inter_bw, "--inter-bw") if args.inter_bw else d.inter_bandwidth,
        d.intra_latency_s if args.intra_latency_us is None else args.intra_latency_us / 1e6,
        d.inter_latency_s if args.inter_latency_us is None else args.inter_latency_us / 1e6,
        parse_bandwidth(args.inter_node_bw, "--inter-node-bw") if args.inter_node_bw else None,
    )


def exit_status(report: PlanReport) -> int:
    """0 when a plan fits (with ``--offload``, a plan with CPU offload counts), 1 when nothing fits."""
    if report.recommendation.strategy is not None:
        return EXIT_FITS
    if report.inputs.offload and recommend_offload(report.inputs, report.plans).strategy is not None:
        return EXIT_FITS
    return EXIT_NOTHING_FITS


def main(argv: list[str]) -> int:
    """Entry point of ``flatshard plan``; returns the exit status (0 fits, 1 nothing fits, 2 bad input)."""
    try:
        args = _parser().parse_args(argv)
        report = plan(inputs_from_args(args))
    except PlanError as e:
        print(f"usage: {USAGE}\nflatshard plan: error: {e.problem}\n  fix: {e.fix}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except SystemExit as e:  # --help
        return int(e.code or 0)
    if args.json:
        print(json.dumps(to_json_dict(report), indent=2))
    else:
        print_report(report, full=args.full)
    return exit_status(report)
