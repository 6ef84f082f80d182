"""``fully_shard(shard_placement_fn=...)`` sharding parameters along a dim other than 0 ([Note: sharded
along another dim], runtime/chunked.py): the DTensor parameters are ``Shard(d)`` and hold
``torch.chunk(p, W, dim=d)[rank]``, as PyTorch's FSDP2's do, and training equals FSDP2's run with the same
placements (even splits, which FSDP2 requires for d > 0) and the single-process reference (also for an
uneven split, which flatshard accepts), every step. Also from meta, and the refusals: a dim the parameter
does not have, and a placement on another mesh."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import sharded_training
from tests.helpers.dist import raised as _raised
from tests.helpers.dist import run_distributed

STEPS = 3


def _last_dim(p: nn.Parameter):
    from torch.distributed.tensor import Shard

    return Shard(-1) if p.ndim > 1 else Shard(0)


def _model(sizes: list[int]) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for a, b in zip(sizes, sizes[1:]):
        layers += [nn.Linear(a, b), nn.Tanh()]
    return nn.Sequential(*layers[:-1])


def _shard(model: nn.Sequential, fully_shard, fn) -> nn.Sequential:
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, shard_placement_fn=fn)
    return fully_shard(model, shard_placement_fn=fn)


def _train(model: nn.Module, rank: int, world: int) -> dict:
    out = sharded_training.train(model, rank, world, model[0].in_features, STEPS)
    out["placements"] = [str(p.placements) for p in model.parameters()]
    out["contiguous"] = all(p.to_local().is_contiguous() for p in model.parameters())
    return out


def _reference(sizes: list[int], world: int) -> dict:
    return sharded_training.reference(_model(sizes), world, sizes[0], STEPS)


def worker(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Replicate, Shard

    import flatshard

    even, uneven = [6, 8, 4], [5, 7, 3]  # at W = 2, Shard(-1) of a (7, 5) weight is 3 + 2 columns
    out = {
        "flatshard": _train(_shard(_model(even), flatshard.fully_shard, _last_dim), rank, world),
        "fsdp2": _train(_shard(_model(even), torch_fully_shard, _last_dim), rank, world),
        "uneven": _train(_shard(_model(uneven), flatshard.fully_shard, _last_dim), rank, world),
        "fsdp2 uneven": _raised(lambda: _shard(_model(uneven), torch_fully_shard, _last_dim)),
    }
    # from meta: the user writes each local chunk (what reset_parameters would), as in FSDP2
    with torch.device("meta"):
        meta = _model(uneven)
    _shard(meta, flatshard.fully_shard, _last_dim)
    meta.to_empty(device="cpu")
    with torch.no_grad():
        for p, r, dim in zip(meta.parameters(), _model(uneven).parameters(), (1, 0, 1, 0)):
            p.to_local().copy_(torch.chunk(r, world, dim=dim)[rank])
    out["meta"] = _train(meta, rank, world)
    out["Replicate"] = _raised(lambda: flatshard.fully_shard(_model(even), shard_placement_fn=lambda p: Replicate()))
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult  # FSDP2's own type

    other_mesh = ShardPlacementResult(placement=Shard(0), mesh_info=None)
    out["other mesh"] = _raised(lambda: flatshard.fully_shard(_model(even), shard_placement_fn=lambda p: other_mesh))
    out["bad dim"] = _raised(lambda: flatshard.fully_shard(_model(even), shard_placement_fn=lambda p: Shard(p.ndim)))
    return out


def test_parameters_sharded_along_their_last_dim_train_as_fsdp2_and_the_reference():
    world = 2
    ref_even, ref_uneven = _reference([6, 8, 4], world), _reference([5, 7, 3], world)
    outs = run_distributed(worker, world)
    for rank, out in enumerate(outs):
        ours, theirs = out["flatshard"], out["fsdp2"]
        assert ours["placements"] == theirs["placements"], (ours["placements"], theirs["placements"])
        assert "Shard(dim=1)" in ours["placements"][0], ours["placements"]
        assert ours["contiguous"] and out["uneven"]["contiguous"]
        # every step: the loss, every local gradient and every local parameter equal FSDP2's to the bit
        assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
        for name in ("grads", "params"):
            for step, (a, b) in enumerate(zip(ours[name], theirs[name])):
                assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, name, step)
        for run, ref in ((ours, ref_even), (out["uneven"], ref_uneven), (out["meta"], ref_uneven)):
            assert run["losses"] == [pytest.approx(r[rank], rel=1.3e-6, abs=1e-5) for r in ref["losses"]], (
                run["losses"],
                ref["losses"],
            )
            for got, want in zip(run["full"], ref["full"]):
                torch.testing.assert_close(got, want)  # fp32 defaults
        assert out["uneven"]["placements"] == ours["placements"]
        # an uneven split along dim 1: FSDP2 refuses it, flatshard trains it (the local shapes differ per rank)
        assert out["fsdp2 uneven"].startswith("NotImplementedError/"), out["fsdp2 uneven"]
        assert tuple(out["uneven"]["params"][0][0].shape) == ((7, 3) if rank == 0 else (7, 2))
        assert out["bad dim"].startswith("FullyShardUsageError/ValueError/AssertionError"), out["bad dim"]
        assert "Shard dim 2 is invalid for 2D tensor" in out["bad dim"], out["bad dim"]
        assert out["other mesh"].startswith("ValueError/"), out["other mesh"]  # no mesh_info: nothing to shard on
        assert "needs mesh_info=FSDPMeshInfo" in out["other mesh"], out["other mesh"]
        assert out["Replicate"].startswith("ValueError/"), out["Replicate"]  # FSDP2's class and words
        assert "Invalid shard_placement_fn result: Replicate()" in out["Replicate"], out["Replicate"]
