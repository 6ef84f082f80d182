"""``fully_shard`` over tensor-parallel parameters ([Note: FSDP over tensor-parallel parameters],
fsdp2/tensor_parallel.py): ``parallelize_module`` on the TP mesh first, then ``fully_shard`` on the data-parallel mesh,
as FSDP2 users write FSDP + TP. At W = 4 (2 data-parallel × 2 tensor-parallel; and HSDP + TP, 2 × 1 × 2
and 1 × 2 × 2) and W = 2 (1 × 2), on MLPs
of even and odd widths, against PyTorch's FSDP2 given the same model and calls: the sharded parameters'
meshes and placements, and every step's loss, local gradients and local parameters, to the bit; and the
full parameters against the single-process model. Also: a state dict's full tensors equal the
unsharded model's; an uneven TP split with every block checkpointed, reshard_after_forward True and
False, equals FSDP2; what is not built is refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import sharded_training
from tests.helpers.dist import raised as _raised
from tests.helpers.dist import run_distributed

STEPS = 3


_model = sharded_training.two_mlps
MLP = sharded_training.MLP


def _build(dim: int, hidden: int, fully_shard, dp_mesh, tp_mesh, placement_fn=None) -> nn.Sequential:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = _model(dim, hidden)
    plan = {
        f"{i}.{name}": style
        for i in range(2)
        for name, style in (("in_proj", ColwiseParallel()), ("out_proj", RowwiseParallel()))
    }
    parallelize_module(model, tp_mesh, plan)
    kw = {"shard_placement_fn": placement_fn} if placement_fn else {}
    for mlp in model:
        fully_shard(mlp, mesh=dp_mesh, **kw)
    return fully_shard(model, mesh=dp_mesh, **kw)


def _train(model: nn.Module, dp_rank: int, dp_size: int, dim: int) -> dict:
    out = sharded_training.train(model, dp_rank, dp_size, dim, STEPS)
    out["placements"] = [(str(p.device_mesh.mesh.tolist()), str(p.placements)) for p in model.parameters()]
    out["state dict"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def _reference(dim: int, hidden: int, dp_size: int) -> dict:
    model = _model(dim, hidden)
    out = sharded_training.reference(model, dp_size, dim, STEPS)
    out["state dict"] = {k: v.clone() for k, v in model.state_dict().items()}
    return out


def worker(rank: int, world: int, dp_size: int, sizes: list) -> dict:  # noqa: ARG001 - the harness's signature
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard

    import flatshard

    mesh = init_device_mesh("cpu", (dp_size, world // dp_size), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = mesh["dp"], mesh["tp"]
    dp_rank = dp_mesh.get_local_rank()
    out = {}
    for dim, hidden in sizes:
        fresh = {}
        for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard)):
            model = _build(dim, hidden, fn, dp_mesh, tp_mesh)
            fresh[name] = _train(model, dp_rank, dp_size, dim)
        out[(dim, hidden)] = fresh
    # shard_placement_fn beside TP: dim 1 of a matrix that TP cuts along dim 0
    last = lambda p: Shard(p.ndim - 1)
    if dp_size > 1:
        out["dim 1"] = {
            name: _train(_build(8, 16, fn, dp_mesh, tp_mesh, last), dp_rank, dp_size, 8)
            for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard))
        }
    out["same mesh"] = _raised(lambda: _build(8, 16, flatshard.fully_shard, tp_mesh, tp_mesh))
    return out


def _check(outs: list, dp_size: int, sizes: list) -> None:
    for rank, out in enumerate(outs):
        cases = [(s, out[s], _reference(*s, dp_size)) for s in sizes]
        if "dim 1" in out:
            cases.append(((8, 16), out["dim 1"], _reference(8, 16, dp_size)))
        for size, runs, ref in cases:
            ours, theirs = runs["flatshard"], runs["fsdp2"]
            assert ours["placements"] == theirs["placements"], (size, ours["placements"], theirs["placements"])
            assert ours["losses"] == theirs["losses"], (size, ours["losses"], theirs["losses"])
            for what in ("grads", "params"):
                for step, (a, b) in enumerate(zip(ours[what], theirs[what])):
                    assert all(torch.equal(x, y) for x, y in zip(a, b)), (rank, size, what, step)
            dp_rank = rank // (len(outs) // dp_size)
            want = [pytest.approx(r[dp_rank], rel=1.3e-6, abs=1e-5) for r in ref["losses"]]
            assert ours["losses"] == want, (size, ours["losses"], ref["losses"])
            for got, full in zip(ours["full"], ref["full"]):
                torch.testing.assert_close(got, full)  # fp32 defaults
            state, want = ours["state dict"], ref["state dict"]  # the state dict, read whole: the same names
            assert list(state) == list(want), (list(state), list(want))
            for name in want:
                torch.testing.assert_close(state[name], want[name])
        # TP cuts in_proj.weight along dim 0 into 2, and FSDP its local piece along dim 0 again: strided
        first = outs[0][sizes[0]]["flatshard"]["placements"][0][1]
        assert first == "(_StridedShard(dim=0, sf=2), Shard(dim=0))", first  # as FSDP2's, also when dp is 1
        assert out["same mesh"].startswith("ValueError/"), out["same mesh"]


def test_fsdp_over_tensor_parallel_2x2_matches_fsdp2():
    sizes = [(8, 16), (5, 6)]  # even; odd widths: uneven FSDP chunks (TP styles need even splits)
    _check(run_distributed(worker, 4, 2, sizes), 2, sizes)


def test_fsdp_over_tensor_parallel_1x2_matches_fsdp2():
    sizes = [(5, 6)]
    _check(run_distributed(worker, 2, 1, sizes), 1, sizes)


def uneven_worker(rank: int, world: int, shape: tuple) -> dict:  # noqa: ARG001 - the harness's signature
    """An uneven TP split (hidden 9 over 2 TP ranks: the blocks keep DTensor activations with
    use_local_output=False), activation checkpointing of every block, reshard_after_forward False and
    True, Adam with zero_grad alternating set_to_none: flatshard beside PyTorch's FSDP2, four steps."""
    from torch.distributed._composable import checkpoint
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import flatshard

    names = ("dp", "tp") if len(shape) == 2 else ("replicate", "shard", "tp")
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dp_mesh = mesh["dp"] if len(shape) == 2 else mesh["replicate", "shard"]
    dp_rank = dp_mesh.get_local_rank() if len(shape) == 2 else dp_mesh._flatten().get_local_rank()
    out = {}
    for after in (False, True):
        for name, fully_shard in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard)):
            torch.manual_seed(0)
            model = nn.Sequential(MLP(5, 9), MLP(5, 9))
            plan = {}
            for i in range(2):
                plan[f"{i}.in_proj"] = ColwiseParallel(use_local_output=False)
                plan[f"{i}.out_proj"] = RowwiseParallel(use_local_output=i == 1)
            parallelize_module(model, mesh["tp"], plan)
            for mlp in model:
                checkpoint(mlp)
                fully_shard(mlp, mesh=dp_mesh, reshard_after_forward=after)
            fully_shard(model, mesh=dp_mesh, reshard_after_forward=after)
            opt = torch.optim.Adam(model.parameters(), lr=1e-2)
            gen = torch.Generator().manual_seed(42 + dp_rank)
            losses = []
            for step in range(4):
                opt.zero_grad(set_to_none=step % 2 == 0)
                loss = model(torch.randn(8, 5, generator=gen)).sum()
                loss.backward()
                opt.step()
                losses.append(loss.item())
            out[(after, name)] = (losses, [p.to_local().clone() for p in model.parameters()])
    return out


@pytest.mark.parametrize("shape", [(2, 2), (1, 2, 2)])  # FSDP + TP, and HSDP + TP
def test_uneven_tensor_parallel_with_activation_checkpointing_matches_fsdp2(shape):
    for out in run_distributed(uneven_worker, 4, shape):
        for after in (False, True):
            (ours, ours_params), (theirs, theirs_params) = out[(after, "flatshard")], out[(after, "fsdp2")]
            assert ours == theirs, (after, ours, theirs)
            assert all(torch.equal(a, b) for a, b in zip(ours_params, theirs_params)), after


def hsdp_worker(rank: int, world: int, shape: tuple) -> dict:  # noqa: ARG001 - the harness's signature
    """HSDP with TP: fully_shard on the (replicate, shard) mesh, parallelize_module on the TP one."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import flatshard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard", "tp"))
    dp_mesh, tp_mesh = mesh["replicate", "shard"], mesh["tp"]
    dp_rank, dp_size = mesh["replicate", "shard"]._flatten().get_local_rank(), shape[0] * shape[1]
    out = {}
    for dim, hidden in ((8, 16), (5, 6)):
        for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard)):
            out[(dim, hidden, name)] = _train(_build(dim, hidden, fn, dp_mesh, tp_mesh), dp_rank, dp_size, dim)
    return out


@pytest.mark.parametrize("shape", [(2, 1, 2), (1, 2, 2)])
def test_hsdp_over_tensor_parallel_matches_fsdp2(shape):
    for out in run_distributed(hsdp_worker, 4, shape):
        for dim, hidden in ((8, 16), (5, 6)):
            ours, theirs = out[(dim, hidden, "flatshard")], out[(dim, hidden, "fsdp2")]
            assert ours["placements"] == theirs["placements"], (ours["placements"], theirs["placements"])
            assert "Replicate(), _StridedShard(dim=0, sf=2), Shard(dim=0)" in ours["placements"][0][1]
            assert ours["losses"] == theirs["losses"], (ours["losses"], theirs["losses"])
            for what in ("grads", "params"):
                for step, (a, b) in enumerate(zip(ours[what], theirs[what])):
                    assert all(torch.equal(x, y) for x, y in zip(a, b)), (shape, dim, what, step)


def uneven_dim1_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """shard_placement_fn's Shard(1) for out_proj.weight beside an uneven TP split: its TP piece is 5
    columns on TP rank 0 and 4 on TP rank 1, so over 2 data-parallel ranks it splits unevenly on one TP
    rank only."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    import flatshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))

    def build(fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(MLP(5, 9))
        parallelize_module(model, mesh["tp"], {"0.in_proj": ColwiseParallel(use_local_output=False),
                                               "0.out_proj": RowwiseParallel()})  # fmt: skip
        return fully_shard(model, mesh=mesh["dp"], shard_placement_fn=along_tp)

    def along_tp(param):  # the dim TP cuts out_proj.weight along (1), else 0
        return Shard(1) if param.placements == (Shard(1),) else Shard(0)

    fsdp2 = _raised(lambda: build(torch_fully_shard))
    return {"fsdp2": fsdp2, "flatshard": _train(build(flatshard.fully_shard), mesh["dp"].get_local_rank(), 2, 5)}


def test_an_uneven_split_on_one_tp_rank_only_trains():
    outs = run_distributed(uneven_dim1_worker, 4)
    torch.manual_seed(0)
    ref = sharded_training.reference(nn.Sequential(MLP(5, 9)), 2, 5, STEPS)
    # PyTorch's FSDP2 decides from each rank's TP piece: it raises on TP rank 0's ranks only (the others
    # would wait in their first collective); flatshard accepts the uneven split on every rank and trains
    assert [o["fsdp2"].split(":")[0] for o in outs] == [
        "NotImplementedError/RuntimeError/Exception", "no error", "NotImplementedError/RuntimeError/Exception",
        "no error"]  # fmt: skip
    for rank, out in enumerate(outs):
        want = [pytest.approx(r[rank // 2], rel=1.3e-6, abs=1e-5) for r in ref["losses"]]
        assert out["flatshard"]["losses"] == want, (out["flatshard"]["losses"], ref["losses"])
        for got, full in zip(out["flatshard"]["full"], ref["full"]):
            torch.testing.assert_close(got, full)
