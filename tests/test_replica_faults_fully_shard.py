"""flatshard.ft with ``fully_shard`` inside each replica group (DTensor parameters, FSDP2's front end) in
place of the FSDP1-style wrapper that tests/test_replica_faults.py runs; its runs and checks, imported.

* W = 4 as 2 groups x 2 ranks on localhost, each group its own torchrun job (bench/faults/replica_faults.py
  with ``--front fully_shard``: the tiny GPT, ``fully_shard`` on every block and on the root, AdamW), one
  rank of group 0 SIGKILLed after step 5: group 1 trains alone, group 0 is restarted, takes rank k's
  local shards and AdamW state from group 1 and rejoins; from then on both groups commit every step
  together, to the end, and rank k of both groups ends with bitwise the same parameter shards and AdamW state
  (SHA-256 of every tensor).
* One quorum of 2 groups x 2 ranks (pooled processes, no torchrun): two SGD-momentum steps whose gradient
  and parameters (``full_tensor()``) equal, at fp32 tolerances, one process's steps on the mean of the four
  ranks' losses. Replicas equal to each other would hold as well if the groups summed their gradients;
  this would not (the gradient would be doubled).

Needs torchft (the ``ft`` extra, in the ``test`` extra too); skips and says so without it."""

from __future__ import annotations

import math

import pytest
import torch

from bench.faults import replica_faults
from tests.helpers.dist import run_distributed
from tests.test_replica_faults import ARGS, dropped_and_rejoined, quorum

pytest.importorskip("torchft", reason="flatshard.ft needs torchft: pip install 'flatshard[ft]'")

# tests/test_replica_faults.py's run with fully_shard in the groups, a 10 s collective timeout instead of 15 s
# and 36 steps instead of 40: the killed group's other rank, blocked in a collective with the dead one, leaves
# torchrun's SIGTERM pending until that collective times out, so the group restarts about a timeout after the
# kill; on an idle machine it is back near step 30 and both groups then train a few steps together
SETTINGS = dict(ARGS, front="fully_shard", steps=36, collective_timeout=10.0)


@pytest.mark.slow
def test_a_fully_shard_group_dropped_and_rejoined_holds_bitwise_the_same_state(tmp_path):
    """tests/test_replica_faults.py's checks (group 1 committed every step, some alone; group 0 none while
    away; rank k of both groups bitwise equal at the end), and that training went on after the rejoin: from
    the step group 0 came back at, both groups committed every step to the last one, all in a quorum of
    both, with finite losses."""
    run = dropped_and_rejoined(tmp_path, SETTINGS)
    (fail,) = replica_faults.failures(run, SETTINGS["groups"])
    last = replica_faults.commits(run, 1)[-1][0]
    for g in range(SETTINGS["groups"]):
        for r in range(SETTINGS["nproc"]):
            after = [rec for rec in run["logs"][f"g{g}-r{r}"] if rec["kind"] == "step" and rec["committed"]]
            after = [rec for rec in after if rec["step"] >= fail["back_at_step"]]
            steps = [rec["step"] for rec in after]
            assert steps and steps == list(range(fail["back_at_step"], last + 1)), (g, r, steps)
            assert all(rec["participants"] == SETTINGS["groups"] for rec in after), (g, r, after)
            assert all(math.isfinite(rec["loss"]) for rec in after), (g, r, after)


def fully_shard_average_worker(rank: int, world: int) -> dict:
    """Two replica groups of two ranks, each group's model ``fully_shard``ed (a Linear and the root) over
    its own 1-D mesh (the shard dim of a 2x2 mesh), weights of 15x7 and 3x15 so dim-0 chunks are padded; a
    Lighthouse that waits for both; two SGD-momentum steps through flatshard.ft. Each step's gradient and
    parameters, gathered with ``full_tensor()``, are compared after the quorum is shut down with one
    process's steps on the mean of the four ranks' losses (the group's reduce-scatter averages over its 2
    ranks, the quorum's all-reduce over its 2 groups; a sum over the groups would double the gradient)."""
    import copy

    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from flatshard import fully_shard

    per_group, lr, steps = 2, 0.5, 2
    mesh = init_device_mesh("cpu", (world // per_group, per_group), mesh_dim_names=("replica", "shard"))["shard"]
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(7, 15), nn.Tanh(), nn.Linear(15, 3))
    model = copy.deepcopy(ref)
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    meshes = {name: p.device_mesh.mesh.tolist() for name, p in model.named_parameters() if isinstance(p, DTensor)}
    optim = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    ours, committed, participants = [], [], []
    with quorum(rank, world, per_group, model, optim) as (manager, optimizer):
        for step in range(steps):
            xs = torch.randn(world, 4, 7, generator=torch.Generator().manual_seed(1 + step))  # one batch per rank
            optimizer.zero_grad()
            model(xs[rank]).square().mean().backward()
            committed.append(optimizer.step())
            participants.append(manager.num_participants())
            ours.append({n: (p.full_tensor(), p.grad.full_tensor()) for n, p in model.named_parameters()})

    ref_optim = torch.optim.SGD(ref.parameters(), lr=lr, momentum=0.9)
    for step in range(steps):
        xs = torch.randn(world, 4, 7, generator=torch.Generator().manual_seed(1 + step))
        ref_optim.zero_grad()
        torch.stack([ref(x).square().mean() for x in xs]).mean().backward()
        ref_optim.step()
        for name, p in ref.named_parameters():
            param, grad = ours[step][name]
            where = f"rank {rank}, step {step}"
            torch.testing.assert_close(grad, p.grad, msg=lambda m, n=name: f"{where}: grad {n}: {m}")
            torch.testing.assert_close(param, p.detach(), msg=lambda m, n=name: f"{where}: param {n}: {m}")
    return {"committed": committed, "participants": participants, "meshes": meshes}


def test_a_fully_shard_step_averages_the_gradients_over_the_quorum():
    """Every rank committed both steps in a quorum of both groups, its parameters were DTensors on its own
    group's two ranks, and its gradients and parameters matched the reference (asserted in the worker)."""
    outs = run_distributed(fully_shard_average_worker, 4, timeout=120, fresh=True)
    for rank, out in enumerate(outs):
        group = [0, 1] if rank < 2 else [2, 3]
        names = ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert out == {"committed": [True, True], "participants": [2, 2], "meshes": dict.fromkeys(names, group)}
