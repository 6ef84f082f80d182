"""Replica groups that drop out and rejoin (flatshard.ft, on torchft): W = 4 as 2 groups x 2 ranks on
localhost, each group its own torchrun job (FULL_SHARD inside it), one rank of group 0 SIGKILLed after
step 5. Group 1 goes on alone; torchrun restarts group 0, which fetches the parameters and optimizer state
from group 1 over the network and rejoins at a step boundary; afterwards rank k of both groups holds
bitwise the same parameters and optimizer state. bench/faults/replica_faults.py runs the same on the emulated
cluster for 200 steps with a kill every 20.

Needs torchft (the ``ft`` extra, in the ``test`` extra too); skips and says so without it."""

from __future__ import annotations

from argparse import Namespace

import pytest

from bench.faults import replica_faults

pytest.importorskip("torchft", reason="flatshard.ft needs torchft: pip install 'flatshard[ft]'")

ARGS = dict(
    groups=2, nproc=2, steps=40, kill_every=5, settle=0, last_kill_margin=0, preset="tiny", batch=4, lr=1e-2,
    front="fsdp", step_sleep=0.3, max_restarts=2, collective_timeout=15.0, timeout=240.0,
)  # fmt: skip


def test_a_group_dropped_and_rejoined_holds_bitwise_the_same_state(tmp_path):
    args = Namespace(**ARGS, port=replica_faults.free_ports(ARGS["groups"] + 1))
    nodes = [replica_faults.Node("127.0.0.1") for _ in range(args.groups)]
    run = replica_faults.run_once(nodes, args, seed=0, kills=1, log_dir=tmp_path)
    tails = "\n".join(p.read_text()[-3000:] for p in sorted(tmp_path.glob("torchrun-g*.log")))
    assert run["finished"], f"not every rank finished; torchrun's logs end:\n{tails}"
    (fail,) = replica_faults.failures(run, args.groups)
    assert fail["group"] == 0 and fail["back_at_step"] is not None, fail

    # group 1 never stopped: from its first step (or the one it joined at, when group 0 started first) it
    # committed every step, once, alone while group 0 was away
    steps = [s for s, _, _ in replica_faults.commits(run, 1)]
    assert steps == list(range(steps[0], steps[-1] + 1)) and steps[0] <= fail["step"], steps
    alone = [s for s, _, n in replica_faults.commits(run, 1) if n == 1 and fail["step"] < s < fail["back_at_step"]]
    assert alone, "group 1 trained no step alone while group 0 was away"

    # group 0 missed the steps between its death and its rejoin, then trained every step with group 1
    mine = [s for s, _, _ in replica_faults.commits(run, 0)]
    assert not [s for s in mine if fail["step"] < s < fail["back_at_step"]], mine
    assert mine[-1] == steps[-1] >= args.steps - 1

    for rank, state in replica_faults.final_equal(run, args.groups, args.nproc).items():
        assert state != "missing", rank
        assert state["parameters_equal"] and state["optimizer_equal"], (rank, state)
        assert len(set(state["steps"])) == 1, (rank, state)
