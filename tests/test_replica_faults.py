"""Replica groups that drop out and rejoin (flatshard.ft, on torchft): W = 4 as 2 groups x 2 ranks on
localhost, each group its own torchrun job (FULL_SHARD inside it), one rank of group 0 SIGKILLed after
step 5. Group 1 goes on alone; torchrun restarts group 0, which fetches the parameters and optimizer state
from group 1 over the network and rejoins at a step boundary; afterwards rank k of both groups holds
bitwise the same parameters and optimizer state. bench/faults/replica_faults.py runs the same on the emulated
cluster for 200 steps with a kill every 20.

Replicas equal to each other would hold as well if the groups summed their gradients, so one step of 2 groups
x 2 ranks (pooled processes, no torchrun, a few seconds) is also checked against a single-process reference
that averages over every rank of the quorum.

Needs torchft (the ``ft`` extra, in the ``test`` extra too); skips and says so without it."""

from __future__ import annotations

from argparse import Namespace
from contextlib import contextmanager

import pytest
import torch

from bench.faults import replica_faults
from tests.helpers.dist import run_distributed

pytest.importorskip("torchft", reason="flatshard.ft needs torchft: pip install 'flatshard[ft]'")

ARGS = dict(
    groups=2, nproc=2, steps=40, kill_every=5, settle=0, last_kill_margin=0, preset="tiny", batch=4, lr=1e-2,
    front="fsdp", step_sleep=0.3, max_restarts=2, collective_timeout=15.0, timeout=240.0,
)  # fmt: skip


@pytest.mark.slow
def test_a_group_dropped_and_rejoined_holds_bitwise_the_same_state(tmp_path):
    dropped_and_rejoined(tmp_path, ARGS)


def dropped_and_rejoined(tmp_path, settings: dict) -> dict:
    """Runs ``settings`` (ARGS, or ARGS with another ``front``) with one kill and asserts the rejoin, the
    steps each group trained and the bitwise equal state; returns the run."""
    args = Namespace(**settings, port=replica_faults.free_ports(settings["groups"] + 1))
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
    return run


@contextmanager
def quorum(rank: int, world: int, per_group: int, model, optim):
    """Ranks ``[g * per_group, (g + 1) * per_group)`` as replica group ``g``, with a store per group (under
    torchrun, its rendezvous store) and one Lighthouse (on rank 0) that waits for every group: yields this
    rank's ``ft.Manager`` and ``ft.Optimizer``, and stops them (and the Lighthouse) once every rank is
    done with the quorum."""
    from datetime import timedelta

    import torch.distributed as dist

    from flatshard import ft

    group, group_rank = divmod(rank, per_group)
    replicas = world // per_group
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False) if group_rank == 0 else None
    lighthouse = ft.Lighthouse(bind="[::]:0", min_replicas=replicas) if rank == 0 else None
    found = [None] * world
    dist.all_gather_object(found, (store and store.port, lighthouse and lighthouse.address()))
    pg = ft.ProcessGroupGloo(timeout=timedelta(seconds=30))
    manager = ft.Manager(
        model, optim, min_replica_size=replicas, pg=pg, lighthouse_addr=found[0][1], replica_id=f"g{group}",
        hostname="127.0.0.1", store_addr="127.0.0.1", store_port=found[group * per_group][0], rank=group_rank,
        world_size=per_group, init_sync=False, timeout=timedelta(seconds=30),
    )  # fmt: skip
    yield manager, ft.Optimizer(manager, optim)
    dist.barrier()  # every rank done with the quorum before any stops its server
    manager.shutdown()
    pg.shutdown()
    dist.barrier()
    if lighthouse is not None:
        lighthouse.shutdown()


def quorum_average_worker(rank: int, world: int) -> dict:
    """Two replica groups of two ranks (FULL_SHARD over each group's ranks), a Lighthouse that waits for
    both, one SGD step through flatshard.ft: every rank's gradient and parameters then equal, at fp32
    tolerances, one process's step on the mean of the four ranks' losses (the group's reduce-scatter
    averages over its 2 ranks, the quorum's all-reduce over its 2 groups; a sum over the groups would
    double the gradient)."""
    import copy

    import torch.distributed as dist
    from torch import nn

    from flatshard import FullyShardedDataParallel as FSDP

    per_group, lr = 2, 0.5
    group = rank // per_group
    inside = [dist.new_group(list(range(g * per_group, (g + 1) * per_group))) for g in range(world // per_group)]

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))
    model = FSDP(copy.deepcopy(ref), process_group=inside[group])
    optim = torch.optim.SGD(model.parameters(), lr=lr)
    with quorum(rank, world, per_group, model, optim) as (manager, optimizer):
        xs = torch.randn(world, 4, 6, generator=torch.Generator().manual_seed(1))  # one batch per rank

        optimizer.zero_grad()
        model(xs[rank]).square().mean().backward()
        committed = optimizer.step()
        participants = manager.num_participants()
        with FSDP.summon_full_params(model, with_grads=True):
            ours = {name: (p.detach().clone(), p.grad.clone()) for name, p in model.named_parameters()}

    ref_optim = torch.optim.SGD(ref.parameters(), lr=lr)
    torch.stack([ref(x).square().mean() for x in xs]).mean().backward()
    ref_optim.step()
    for name, p in ref.named_parameters():
        param, grad = ours[name]
        torch.testing.assert_close(grad, p.grad, msg=lambda m, n=name: f"rank {rank}: grad {n}: {m}")
        torch.testing.assert_close(param, p.detach(), msg=lambda m, n=name: f"rank {rank}: param {n}: {m}")
    return {"committed": committed, "participants": participants, "names": sorted(ours)}


def test_a_step_averages_the_gradients_over_the_quorum():
    outs = run_distributed(quorum_average_worker, 4, timeout=120, fresh=True)
    for out in outs:
        assert out == {"committed": True, "participants": 2, "names": ["0.bias", "0.weight", "2.bias", "2.weight"]}
