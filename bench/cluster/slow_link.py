"""The slow link kept busy and short: flatshard's settings for traffic between nodes, measured on the
emulated cluster (2 nodes x 2 ranks, as root; bench/cluster/net.py).

    python -m bench.cluster.slow_link                       # 1gbit and 200mbit, 3M GPT, 8 steps (about 6 min)
    python -m bench.cluster.slow_link --rates 1gbit --steps 4 --size tiny
    python -m bench.cluster.slow_link --table               # docs/multi_node.md's table of the committed runs

At each rate, one job (bench/cluster/worker.py --set link) runs interleaved, step after step: flatshard
HYBRID_SHARD (F = ranks per node), FULL_SHARD and NO_SHARD, each with ``inter_node_in_flight=False``
(every reduction finished before the next unit computes: the engine before this setting), with the
default (what crosses nodes left in flight) and with ``compress_inter_node="int8"`` too (not NO_SHARD);
HYBRID_SHARD also with ``shard_optimizer_across_replicas=True`` (gradients and optimizer state over all
ranks: the same bits as HYBRID_SHARD);
_HYBRID_SHARD_ZERO2 (no gathers in backward) with the default and int8; DDP; PyTorch FSDP2's HSDP; no
communication. It prints the median step of the slowest rank, its ratio to the step
without communication and to FSDP2 HSDP's, the bytes each node's link sent per step (the kernel's
counter), and how each system's losses compare: in flight must be the same bits as off; int8 is
compared with the exact run of its strategy. Results go to bench/results/slow_link_<rate>.json;
``--table`` prints them as one Markdown table (a column group per rate), measuring nothing and needing
no root.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch

from bench import provenance
from bench.cluster import jobs, net

FLOOR = "no communication"


def measure(rate: str, args, tmp: Path) -> dict:
    worker = ["--set", "link", "--size", args.size]
    worker += ["--steps", str(args.steps), "--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    job = jobs.run_worker(worker, rate, args.timeout, tmp, rate)
    return {
        "rate": rate,
        "command": "python -m bench.cluster.slow_link " + " ".join(args.argv),
        "commit": jobs.source_commit(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_before": job["load_average_before"],
        "load_average_after": job["load_average_after"],
        "seconds": job["seconds"],
        "rows": rows(job["result"]),
        "result": job["result"],
    }


def _twin(name: str, names) -> str | None:
    """The exact run a system's losses are compared with: its strategy with in flight off (or on, for an
    int8 run whose strategy has no run with it off)."""
    if not name.startswith("flatshard") or name.endswith(", in flight off"):
        return None
    exact = name.removesuffix(", int8").removesuffix(", optimizer across replicas")
    off = exact + ", in flight off"
    return off if off in names else (exact if exact != name else None)


def rows(result: dict) -> dict:
    systems = result["systems"]
    floor = systems[FLOOR]["step_s_median"]
    hsdp = next((v["step_s_median"] for k, v in systems.items() if k.startswith("FSDP2 HSDP")), None)
    link = result["link_tx_bytes_per_step_per_node"]
    out = {}
    for name, fig in systems.items():
        twin = _twin(name, systems)
        diff = None
        if twin is not None:
            a = torch.tensor(fig["losses_per_rank"])
            b = torch.tensor(systems[twin]["losses_per_rank"])
            diff = ((a - b).abs() / b.abs()).max().item()
        out[name] = {
            "step_s": fig["step_s_median"],
            "per_compute": fig["step_s_median"] / floor,
            "per_fsdp2_hsdp": fig["step_s_median"] / hsdp if hsdp else None,
            "link_mb_per_step_per_node": max(link.get(name, [0.0])) / 1e6,
            "losses_vs": twin,
            "losses_max_rel_diff": diff,
        }
    return out


def print_report(report: dict) -> None:
    print(
        f"\n{report['rate']} between 2 nodes x 2 ranks (median step of the slowest rank; load "
        f"{report['load_average_before'][0]:.1f} -> {report['load_average_after'][0]:.1f})"
    )
    print(f"{'system':44s} {'step ms':>8s} {'/ compute':>9s} {'/ HSDP':>7s} {'link MB/node':>12s}  losses")
    for name, r in report["rows"].items():
        if r["losses_vs"] is None:
            losses = ""
        elif r["losses_max_rel_diff"] == 0:
            losses = f"the same bits as {r['losses_vs'].removeprefix('flatshard ')}"
        else:
            losses = f"max rel diff {r['losses_max_rel_diff']:.2e} to {r['losses_vs'].removeprefix('flatshard ')}"
        hsdp = f"{r['per_fsdp2_hsdp']:.2f}" if r["per_fsdp2_hsdp"] is not None else "-"
        print(
            f"{name:44s} {1e3 * r['step_s']:8.0f} {r['per_compute']:9.2f} {hsdp:>7s} "
            f"{r['link_mb_per_step_per_node']:12.1f}  {losses}"
        )


def _rate_label(rate: str) -> str:
    bits = net.parse_rate(rate)
    return f"{bits / 1e9:g} Gbit/s" if bits >= 10**9 else f"{bits / 1e6:g} Mbit/s"


def table(reports: list[dict]) -> list[str]:
    """docs/multi_node.md's table: one row per system, one column group per rate's report."""
    head = " | ".join(f"{_rate_label(r['rate'])} step ms | / compute | / FSDP2 HSDP" for r in reports)
    lines = [f"| system | {head} | link MB/step/node |", "|---" * (2 + 3 * len(reports)) + "|"]
    for name in reports[0]["rows"]:
        figs = [r["rows"][name] for r in reports]
        cells = " | ".join(
            f"{1e3 * f['step_s']:,.0f} | {f['per_compute']:.2f} | "
            + ("–" if f["per_fsdp2_hsdp"] is None else f"{f['per_fsdp2_hsdp']:.2f}")
            for f in figs
        )
        link = " / ".join(f"{f['link_mb_per_step_per_node']:.1f}" for f in figs)
        lines.append(f"| {name} | {cells} | {link} |")
    return lines


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.slow_link", description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"])
    p.add_argument("--size", default="3M", choices=["tiny", "3M", "30M"], help="bench/compare.py's GPT sizes")
    p.add_argument("--steps", type=int, default=8, help="measured steps per system (after the warmup)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--timeout", type=float, default=900.0, help="seconds before a job is stopped")
    p.add_argument("--json-dir", type=Path, default=jobs.RESULTS, help="where slow_link_<rate>.json goes")
    p.add_argument("--table", action="store_true", help="print the committed results' table, measure nothing")
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.table:
        reports = [json.loads((args.json_dir / f"slow_link_{rate}.json").read_text()) for rate in args.rates]
        print("\n".join(table(reports)))
        return 0
    status = 0
    try:
        with tempfile.TemporaryDirectory(prefix="slow-link-") as tmp:
            for rate in args.rates:
                report = measure(rate, args, Path(tmp))
                path = args.json_dir / f"slow_link_{rate}.json"
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(provenance.stamp(report), indent=1))
                print_report(report)
                print(f"results written to {path}", flush=True)
                same = [r for n, r in report["rows"].items() if r["losses_vs"] and ", int8" not in n]
                if any(r["losses_max_rel_diff"] != 0 for r in same):
                    print("in flight changed the losses: it must not", file=sys.stderr)
                    status = 1
    except net.ClusterError as err:
        print(f"slow_link: {err}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())
