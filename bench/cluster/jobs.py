"""What the emulated cluster's measurements share: one job of bench/cluster/worker.py on 2 nodes x 2
ranks at a rate, where the results go, and the commit measured. ``python -m bench.cluster measure``,
bench/cluster/hsdp.py and bench/cluster/slow_link.py use them; the fuzzer records its commit with
``source_commit``."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

from bench.cluster import net

RESULTS = net.ROOT / "bench" / "results"
WORKER = "bench.cluster.worker"  # started by torchrun as a module (-m), from net.ROOT


def source_commit() -> str | None:
    """The checkout's commit (with "+ changes" when tracked files differ from it), or None outside git.
    Result files under bench/results are not the source measured: a run that follows another in one
    checkout (``make figures``) finds the earlier one's file changed, and is no less of the commit."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=net.ROOT, capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results"],
            cwd=net.ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + (" + changes" if dirty.stdout.strip() else "")


def run_worker(worker_args: list[str], rate: str, timeout: float, tmp: Path, label: str) -> dict:
    """One job of bench/cluster/worker.py (with ``worker_args`` and an ``--out`` of its own) on 2 nodes x 2
    ranks at ``rate``: its result, the load average before and after, and the job's seconds."""
    out = tmp / f"{label}.json"
    topology = net.Topology(2, 2, net.parse_rate(rate), 0.0, net.Topology.queue_ms)
    load_before = os.getloadavg()
    with net.Cluster(topology) as c:
        job = c.run(["-m", WORKER, "--out", str(out), *worker_args], timeout, tmp / f"logs-{label}")
    if not job.ok:
        state = f"timed out after {timeout:.0f} s" if job.timed_out else f"exit codes {job.codes}"
        raise net.ClusterError(f"the job {label} failed ({state}):\n{job.tails()}")
    return {
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": job.seconds,
        "result": json.loads(out.read_text()),
    }
