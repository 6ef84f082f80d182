"""PyTorch FSDP2's HSDP as a user runs it, beside flatshard's hybrid, on the emulated 2 x 2 cluster.

    python -m bench.cluster.hsdp                  # make cluster's second part: 1 Gbit/s, the 3M GPT, 4 and 16 sequences
    python -m bench.cluster.hsdp --table          # the table of the committed bench/results/cluster_hsdp.json

One job per per-rank batch size (``bench/cluster/worker.py --set hsdp``, every system interleaved step by
step, a step's time the slowest rank's, the median of the measured steps): flatshard HYBRID_SHARD F = 2
and _HYBRID_SHARD_ZERO2 F = 2; FSDP2 HSDP with its defaults (``fully_shard`` on every block and the root
over a (replicate, shard) mesh whose shard groups are the nodes); the same wrapped as torchtitan wraps a
model with tied weights; with ``reshard_after_forward=False``; with explicit prefetching one block ahead;
with its all-gathers and reduce-scatters replaced by point-to-point exchanges (what gloo's own collectives
cost it); FSDP2 FULL_SHARD; and no communication (the compute floor). docs/multi_node.md ("FSDP2's HSDP
as a user runs it") gives the figures and which configuration ``make cluster`` compares against;
tests/test_cluster_hsdp.py holds that section to the committed file. Root, ``ip`` and ``tc`` are needed
to measure; ``--table`` needs neither.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import compare, provenance
from bench.cluster import jobs, net

RESULT = jobs.RESULTS / "cluster_hsdp.json"
FLOOR = "no communication"
FLATSHARD = "flatshard HYBRID_SHARD F=2"
USER_HSDP = "FSDP2 HSDP (2x2)"  # FSDP2's defaults: what make cluster's strategies set runs


def measure(batch_size: int, args, tmp: Path) -> dict:
    worker = ["--set", "hsdp", "--size", args.size, "--steps", str(args.steps)]
    worker += ["--warmup", str(args.warmup), "--batch-size", str(batch_size)]
    job = jobs.run_worker(worker, args.rate, args.timeout, tmp, f"hsdp-{batch_size}-sequences")
    comparable = json.loads(json.dumps(job["result"]))
    comparable["systems"].pop(FLOOR)  # its own per-rank batch: other losses
    return {"batch_size": batch_size, **job, "losses_agree": compare.losses_agree(comparable, False)}


def ratios(run: dict) -> dict[str, dict[str, float]]:
    """Per system: its median step (ms), that over the compute floor's, and over FSDP2 HSDP's defaults'."""
    systems = run["result"]["systems"]
    floor, hsdp = systems[FLOOR]["step_s_median"], systems[USER_HSDP]["step_s_median"]
    return {
        name: {
            "ms": s["step_s_median"] * 1e3,
            "compute": s["step_s_median"] / floor,
            "hsdp": s["step_s_median"] / hsdp,
            "link_mb": max(run["result"]["link_tx_bytes_per_step_per_node"][name]) / 1e6,
        }
        for name, s in systems.items()
    }


def table(report: dict) -> list[str]:
    """docs/multi_node.md's table: one row per system, one column group per batch size."""
    runs = report["runs"]
    head = " | ".join(f"{r['batch_size']} seq: step ms | / compute | / FSDP2 HSDP" for r in runs)
    lines = [f"| system | {head} | link MB/step/node |", "|---" * (2 + 3 * len(runs)) + "|"]
    figures = [ratios(r) for r in runs]
    for name in figures[0]:
        cells = " | ".join(f"{f[name]['ms']:,.0f} | {f[name]['compute']:.2f} | {f[name]['hsdp']:.2f}" for f in figures)
        lines.append(f"| {name} | {cells} | {figures[0][name]['link_mb']:.1f} |")
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.hsdp", description=__doc__.split("\n\n")[0])
    p.add_argument("--table", action="store_true", help="print the committed result's table, measure nothing")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[4, 16], help="sequences per rank per step")
    p.add_argument("--rate", default="1gbit")
    p.add_argument("--size", default="3M", choices=["tiny", "3M", "30M"])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=1500.0)
    p.add_argument("--out", type=Path, default=RESULT)
    args = p.parse_args(argv)
    if args.table:
        print("\n".join(table(json.loads(args.out.read_text()))))
        return 0
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="cluster-hsdp-") as tmp:
        runs = [measure(b, args, Path(tmp)) for b in args.batch_sizes]
    report = {
        "command": "python -m bench.cluster.hsdp " + " ".join(argv if argv is not None else sys.argv[1:]),
        "commit": jobs.source_commit(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "rate": args.rate,
        "size": args.size,
        "runs": runs,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(provenance.stamp(report), indent=1))
    print("\n".join(table(report)))
    agree = all(a["agree"] for r in runs for a in r["losses_agree"].values())
    print(f"{time.monotonic() - started:.0f} s; losses agree: {agree}; written to {args.out}")
    return 0 if agree else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except net.ClusterError as err:
        print(f"cluster_hsdp: {err}", file=sys.stderr)
        sys.exit(2)
