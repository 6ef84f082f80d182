"""Several machines on one: training jobs on an emulated cluster of network namespaces with slow links.

    python -m bench.cluster measure                  # make cluster: calibrate, measure, predict at 1gbit and 200mbit
    python -m bench.cluster measure --rates 1gbit --steps 6 --size tiny
    python -m bench.cluster run --nodes 2 --nproc 2 --rate 200mbit -- examples/train_gpt.py --strategy HYBRID_SHARD
    python -m bench.cluster run --nodes 2 --nproc 2 -- -m bench.cluster.smoke --out DIR   # a module: torchrun -m
    python -m bench.cluster clean                    # remove the namespaces of a run that was killed

``run`` starts any training script as one ``torchrun --nnodes=N --nproc-per-node=P`` job over N nodes
(network namespaces) joined by links of the given rate, and tears everything down afterwards, also on
failure, timeout or Ctrl-C (bench/cluster/net.py, [Note: the emulated cluster]). ``measure`` runs
bench/cluster/worker.py on 2 nodes x 2 ranks at each rate: a calibration of the links and of one rank's
compute, then flatshard's strategies, DDP, PyTorch FSDP2 and a run without communication, interleaved;
it prints the measured median step of each beside the planner's prediction from the calibration
(bench/cluster/predict.py) and writes bench/results/cluster_<rate>.json. Root, ``ip`` and ``tc`` are
needed. docs/multi_node.md has the method and the figures.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import compare, provenance
from bench.cluster import net, predict
from bench.cluster.jobs import RESULTS, WORKER, source_commit


def _topology(rate: str, args) -> net.Topology:
    bits = None if rate in ("none", "0") else net.parse_rate(rate)
    return net.Topology(args.nodes, args.nproc, bits, args.delay, args.queue_ms)


def cmd_run(args) -> int:
    script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not script:
        raise net.ClusterError("name the script after --, e.g. -- examples/train_gpt.py --strategy HYBRID_SHARD")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="cluster-"))
    with net.Cluster(_topology(args.rate, args)) as cluster:
        result = cluster.run(script, args.timeout, log_dir)
        links = cluster.qdiscs() if args.verbose else ""
    for i, log in enumerate(result.logs):
        print(f"---- node {i} ----\n{log.read_text()}", end="")
    print(links, end="")
    state = f"timed out after {args.timeout:.0f} s" if result.timed_out else f"exit codes {result.codes}"
    print(f"cluster job: {state}, {result.seconds:.1f} s; logs in {log_dir}")
    return 0 if result.ok else 1


def cmd_clean(_args) -> int:
    why = net.unavailable()
    if why:
        raise net.ClusterError(why)
    removed = net.remove_stale()
    print(f"removed {len(removed)} stale namespace(s){': ' + ', '.join(removed) if removed else ''}")
    return 0


def measure_one(rate: str, args, tmp: Path) -> dict:
    """One job at ``rate``: the worker's result, the losses' agreement and the planner's predictions."""
    out = tmp / f"{rate}.json"
    worker = ["-m", WORKER, "--out", str(out), "--size", args.size, "--steps", str(args.steps)]
    worker += ["--warmup", str(args.warmup), "--batch-size", str(args.batch_size)]
    if args.systems:
        worker += ["--systems", *args.systems]
    load_before = os.getloadavg()
    with net.Cluster(_topology(rate, args)) as cluster:
        job = cluster.run(worker, args.timeout, tmp / f"logs-{rate}")
    if not job.ok:
        state = f"timed out after {args.timeout:.0f} s" if job.timed_out else f"exit codes {job.codes}"
        raise net.ClusterError(f"the measurement at {rate} failed ({state}):\n{job.tails()}")
    result = json.loads(out.read_text())
    comparable = copy.deepcopy(result)
    comparable["systems"].pop("no communication", None)  # its own per-rank batch: different losses
    return {
        "rate": rate,
        "command": "python -m bench.cluster " + " ".join(args.argv),
        "commit": args.commit or source_commit(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": job.seconds,
        "topology": {"nodes": args.nodes, "nproc": args.nproc, "delay_ms": args.delay, "queue_ms": args.queue_ms},
        "losses_agree": compare.losses_agree(comparable, False),
        "prediction": predict.predict(result),
        "result": result,
    }


def cmd_measure(args) -> int:
    if args.nodes != 2:
        raise net.ClusterError("measure pairs nodes for its calibration: run it with --nodes 2")
    status = 0
    with tempfile.TemporaryDirectory(prefix="cluster-measure-") as tmp:
        for rate in args.rates:
            started = time.monotonic()
            report = measure_one(rate, args, Path(tmp))
            path = args.json_dir / f"cluster_{rate}.json"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(provenance.stamp(report), indent=1))
            predict.print_report(report)
            print(f"{rate}: {time.monotonic() - started:.0f} s; results written to {path}\n", flush=True)
            if not all(a["agree"] for a in report["losses_agree"].values()):
                status = 1
    return status


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    def topology_flags(q: argparse.ArgumentParser, timeout: float) -> None:
        q.add_argument("--nodes", type=int, default=2)
        q.add_argument("--nproc", type=int, default=2, help="ranks per node")
        q.add_argument("--delay", type=float, default=0.0, help="one-way delay in ms on each link end (tc netem)")
        q.add_argument("--queue-ms", type=float, default=net.Topology.queue_ms, help="link queue, ms at rate")
        q.add_argument("--timeout", type=float, default=timeout, help="seconds before a job is stopped")

    run = sub.add_parser("run", help="run a training script as one torchrun job on an emulated cluster")
    topology_flags(run, 600.0)
    run.add_argument("--rate", default="1gbit", help="inter-node rate per direction, in tc's units (none: no limit)")
    run.add_argument("--log-dir", help="where each node's output goes (default: a new temporary folder)")
    run.add_argument("--verbose", action="store_true", help="print the links' tc statistics after the job")
    run.add_argument("script", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    run.set_defaults(func=cmd_run)

    meas = sub.add_parser("measure", help="calibrate, measure every strategy, compare with the planner")
    topology_flags(meas, 420.0)
    meas.add_argument("--rates", nargs="+", default=["1gbit", "200mbit"])
    meas.add_argument("--size", default="3M", choices=["tiny", "3M", "30M"], help="bench/compare.py's GPT sizes")
    meas.add_argument("--steps", type=int, default=8, help="measured steps per system (after the warmup)")
    meas.add_argument("--warmup", type=int, default=2)
    meas.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    meas.add_argument("--systems", nargs="*", help="only the systems whose names contain one of these")
    meas.add_argument("--json-dir", type=Path, default=RESULTS, help="where cluster_<rate>.json goes")
    meas.add_argument("--commit", help="the source measured, for the JSON (default: this checkout's git HEAD)")
    meas.set_defaults(func=cmd_measure)

    clean = sub.add_parser("clean", help="remove namespaces left by killed runs")
    clean.set_defaults(func=cmd_clean)
    args = p.parse_args(argv)
    args.argv = argv
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        return args.func(args)
    except net.ClusterError as err:
        print(f"cluster: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
