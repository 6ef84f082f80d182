"""Two "nodes" × two processes on this machine over loopback, started by two torchrun invocations
with c10d rendezvous, as on a real cluster: HYBRID_SHARD's default shard groups are the nodes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest

from bench.cluster.net import free_ports

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.slow
def test_two_node_torchrun_hybrid(tmp_path):
    port, run_id = free_ports(1), uuid.uuid4().hex[:8]
    nodes = []
    for node in range(2):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            "--nproc-per-node=2",
            f"--node-rank={node}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=127.0.0.1:{port}",
            f"--rdzv-id={run_id}",
            os.path.join(HERE, "torchrun_hybrid.py"),
            str(tmp_path),
        ]
        log = open(tmp_path / f"node{node}.log", "w")
        # a session of its own: on a timeout the agent and every rank it started are killed together
        nodes.append((subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True), log))
    try:
        codes = [p.wait(timeout=240) for p, _ in nodes]
    finally:
        for p, log in nodes:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    logs = "\n".join((tmp_path / f"node{n}.log").read_text()[-3000:] for n in range(2))
    assert codes == [0, 0], logs
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for r in results:
        assert r["local_world_size"] == 2 and r["shard_size"] == 2 and r["replicate_size"] == 2
        # the shard group is exactly this rank's node
        same_node = sorted(x["rank"] for x in results if x["node"] == r["node"])
        assert r["shard_members"] == same_node, (r, same_node)
        M = r["units"]
        assert r["counts"] == {
            "all_gather/shard": M + (M - 1),  # forward, then backward for all but the root
            "reduce_scatter/shard": M,
            "all_reduce/replicate": M,  # one per unit across the nodes
            # the first step's order checks: one before each gather and each reduction, one at the end of
            # forward and one at the end of backward ([Note: order checks])
            "order_check/world": (M + (M - 1)) + M + 2,
        }, r["counts"]
