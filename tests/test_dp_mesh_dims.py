"""``fully_shard(model, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(...))`` ([Note: parameters on the whole
SPMD mesh], fsdp2/spmd.py): the model's parameters already DTensors on one mesh that holds the data-parallel dims
and the tensor-parallel one, its forward on DTensors of that mesh, as FSDP2's dp_mesh_dims takes them. Against
PyTorch's FSDP2 given the same model and calls, every step, every rank: the sharded parameters' meshes and
placements, the losses, local gradients and local parameters to the bit (where the data-parallel dim has 2 ranks;
over 4, whose sum's order is each implementation's own, at fp32's default tolerance); the full parameters and the
state dict read whole against the single-process model at fp32's default tolerance. Meshes: the shard dim alone (W
= 2), shard × TP and HSDP (replicate × shard), each in both dim orders, and two shard dims flattened into one (W =
4), widths that split unevenly; the replicate dim alone (FSDP2's DDP: nothing sharded, one all-reduce per unit
per backward), beside TP in both orders, and two replicate dims flattened. And what FSDP2 refuses is refused
alike, on every rank."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.helpers import sharded_training
from tests.helpers.dist import raised, run_distributed

STEPS = 3


_model = sharded_training.two_mlps


def _lift(model: nn.Module, mesh, tp: bool) -> nn.Module:
    """Every parameter a DTensor on the whole mesh: Replicate() on the data-parallel dims; on "tp", the
    in_proj column-wise (weight and bias along dim 0) and the out_proj weight row-wise (dim 1)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    names = mesh.mesh_dim_names
    for mod_name, mod in model.named_modules():
        for attr, p in list(mod._parameters.items()):
            placements = [Replicate()] * mesh.ndim
            if tp and mod_name.endswith("in_proj"):
                placements[names.index("tp")] = Shard(0)
            elif tp and mod_name.endswith("out_proj") and attr == "weight":
                placements[names.index("tp")] = Shard(1)
            mod._parameters[attr] = nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements))
    return model


def _build(fully_shard, mesh, dims, tp: bool, dim: int, hidden: int) -> nn.Module:
    model = _lift(_model(dim, hidden), mesh, tp)
    for mlp in model:
        fully_shard(mlp, mesh=mesh, dp_mesh_dims=dims)
    return fully_shard(model, mesh=mesh, dp_mesh_dims=dims)


def _train(model: nn.Module, mesh, dp: tuple, dim: int) -> dict:
    """Each data-parallel rank trains on its 2 rows of a global batch; the input is a DTensor on the whole
    mesh, sharded along the batch over the data-parallel dims, replicated over the others."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    names = mesh.mesh_dim_names
    dp_rank = 0
    for name in dp:  # row-major over the data-parallel dims, as Shard(0) over several dims cuts the batch
        dp_rank = dp_rank * mesh[name].size() + mesh[name].get_local_rank()
    dp_size = 1
    for name in dp:
        dp_size *= mesh[name].size()
    placements = [Shard(0) if n in dp else Replicate() for n in names]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"losses": [], "grads": [], "params": []}
    for _ in range(STEPS):
        x = torch.randn(2 * dp_size, dim, generator=gen)
        inp = DTensor.from_local(x[2 * dp_rank : 2 * dp_rank + 2], mesh, placements, run_check=False)
        loss = model(inp).pow(2).mean()
        loss.backward()
        out["grads"].append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.full_tensor().item())
        out["params"].append([p.to_local().clone() for p in model.parameters()])
    out["full"] = [p.full_tensor() for p in model.parameters()]
    out["placements"] = [(str(p.device_mesh.mesh.tolist()), str(p.placements)) for p in model.parameters()]
    out["dp_size"] = dp_size
    out["state dict"] = {k: v.full_tensor() for k, v in model.state_dict().items()}
    return out


def _reference(dim: int, hidden: int, dp_size: int) -> dict:
    model = _model(dim, hidden)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(STEPS):
        x = torch.randn(2 * dp_size, dim, generator=gen)
        loss = model(x).pow(2).mean()
        # the DTensor gradient sums the data-parallel ranks' parts of the whole batch's loss, and the
        # reduction then divides by their number (FSDP2's default divide factor): the single-process
        # model steps on the loss divided alike
        (loss / dp_size).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "full": [p.detach().clone() for p in model.parameters()], "state dict": state}


def worker(rank: int, world: int, shape: tuple, names: tuple, shard: str, replicate, sizes: list) -> dict:  # noqa: ARG001
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import flatshard

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    dims = DataParallelMeshDims(shard=shard, replicate=replicate)
    named = {
        *((shard,) if isinstance(shard, str) else shard or ()),
        *((replicate,) if isinstance(replicate, str) else replicate or ()),
    }
    dp = tuple(n for n in names if n in named)
    tp = "tp" in names
    out = {}
    for dim, hidden in sizes:
        out[(dim, hidden)] = {
            name: _train(_build(fn, mesh, dims, tp, dim, hidden), mesh, dp, dim)
            for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard))
        }
    return out


def _check(outs: list, sizes: list) -> None:
    for rank, out in enumerate(outs):
        for size in sizes:
            ours, theirs = out[size]["flatshard"], out[size]["fsdp2"]
            assert ours["placements"] == theirs["placements"], (rank, size, ours["placements"], theirs["placements"])
            # two ranks' gradients sum to the same bits in either order; four ranks' need not (the reduction's
            # order is each implementation's own): there, PyTorch's fp32 default tolerance
            exact = ours["dp_size"] <= 2
            if exact:
                assert ours["losses"] == theirs["losses"], (rank, size, ours["losses"], theirs["losses"])
            else:
                assert ours["losses"] == pytest.approx(theirs["losses"], rel=1.3e-6, abs=1e-5), (rank, size)
            for what in ("grads", "params"):
                for step, (a, b) in enumerate(zip(ours[what], theirs[what])):
                    assert len(a) == len(b), (rank, size, what, step)
                    for x, y in zip(a, b):
                        if exact:
                            assert torch.equal(x, y), (rank, size, what, step)
                        else:
                            torch.testing.assert_close(x, y, msg=lambda m: f"{(rank, size, what, step)}: {m}")
            ref = _reference(*size, ours["dp_size"])
            assert ours["losses"] == [pytest.approx(v, rel=1.3e-6, abs=1e-5) for v in ref["losses"]], (
                ours["losses"],
                ref["losses"],
            )
            for got, want in zip(ours["full"], ref["full"]):
                torch.testing.assert_close(got, want)  # fp32 defaults
            state, want = ours["state dict"], ref["state dict"]  # the state dict read whole: the same names
            assert list(state) == list(want), (list(state), list(want))
            for name in want:
                torch.testing.assert_close(state[name], want[name])


SIZES = [(8, 16), (5, 6)]  # even; odd widths: uneven chunks (TP needs even splits: 6 over 2)


def test_shard_dim_alone_matches_fsdp2():
    _check(run_distributed(worker, 2, (2,), ("fsdp",), "fsdp", None, SIZES), SIZES)


def test_shard_dim_beside_tensor_parallel_matches_fsdp2():
    """("fsdp", "tp"): TP cuts in_proj's rows before FSDP does, so its shard is strided, as in FSDP2."""
    outs = run_distributed(worker, 4, (2, 2), ("fsdp", "tp"), "fsdp", None, SIZES)
    _check(outs, SIZES)
    assert outs[0][SIZES[0]]["flatshard"]["placements"][0][1] == "(_StridedShard(dim=0, sf=2), Shard(dim=0))"


def test_tensor_parallel_dim_first_matches_fsdp2():
    """("tp", "fsdp"): the shard dim right of TP's, a plain Shard(0) after it."""
    outs = run_distributed(worker, 4, (2, 2), ("tp", "fsdp"), "fsdp", None, SIZES[1:])
    _check(outs, SIZES[1:])
    assert outs[0][SIZES[1]]["flatshard"]["placements"][0][1] == "(Shard(dim=0), Shard(dim=0))"


def test_hsdp_replicate_and_shard_dims_match_fsdp2():
    outs = run_distributed(worker, 4, (2, 2), ("dp_replicate", "fsdp"), "fsdp", "dp_replicate", SIZES[1:])
    _check(outs, SIZES[1:])
    assert outs[0][SIZES[1]]["flatshard"]["placements"][0][1] == "(Replicate(), Shard(dim=0))"


def refusals_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """Each bad call to both fully_shards: what each raises."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard, distribute_tensor

    import flatshard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
    unnamed = init_device_mesh("cpu", (2,))
    twin = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))  # equal to mesh, made apart
    ddp = init_device_mesh("cpu", (2,), mesh_dim_names=("ddp_int",))

    def lifted():
        return _lift(_model(4, 6), mesh, tp=False)

    def sharded_on_dp():
        model = lifted()
        w = model[0].in_proj.weight
        model[0].in_proj.weight = nn.Parameter(distribute_tensor(w.full_tensor().detach(), mesh, [Shard(0)]))
        return model

    cases = {
        "plain parameters": (lambda: _model(4, 6), {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims("fsdp")}),
        "not Replicate on the shard dim": (sharded_on_dp, {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims("fsdp")}),
        "a name not in the mesh": (lifted, {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims("dp")}),
        "an unnamed mesh": (lifted, {"mesh": unnamed, "dp_mesh_dims": DataParallelMeshDims("fsdp")}),
        "an int reshard_after_forward": (
            lifted,
            {"mesh": mesh, "dp_mesh_dims": DataParallelMeshDims("fsdp"), "reshard_after_forward": 2},
        ),
        "another mesh object": (lifted, {"mesh": twin, "dp_mesh_dims": DataParallelMeshDims("fsdp")}),
        "an int reshard_after_forward, replicate alone": (  # a mesh of its own: see comms_worker
            lambda: _lift(_model(4, 6), ddp, tp=False),
            {"mesh": ddp, "dp_mesh_dims": DataParallelMeshDims(replicate="ddp_int"), "reshard_after_forward": 2},
        ),
    }
    return {
        what: {
            name: raised(lambda fn=fn, make=make, kw=kw: fn(make(), **kw))
            for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard))
        }
        for what, (make, kw) in cases.items()
    }


def test_refusals_as_fsdp2_and_what_is_not_built():
    outs = run_distributed(refusals_worker, 2)
    assert outs[0] == outs[1], outs  # every rank alike
    got = outs[0]
    # the words PyTorch's own FSDP2 tests (test_fully_shard_dtensor.py) match in each error, in flatshard's too
    words = {
        "plain parameters": "must be DTensors",
        "not Replicate on the shard dim": "Expected Replicate",
        "a name not in the mesh": "not found in mesh.mesh_dim_names",
        "an unnamed mesh": "",
        "another mesh object": "same mesh",
    }
    for what, said in words.items():
        ours, theirs = got[what]["flatshard"], got[what]["fsdp2"]
        assert ours.split("/")[0] == theirs.split("/")[0] == "ValueError", (what, ours, theirs)
        assert said in ours and said in theirs, (what, said, ours, theirs)
    ours, theirs = got["an int reshard_after_forward"]["flatshard"], got["an int reshard_after_forward"]["fsdp2"]
    assert ours.split("/")[0] == theirs.split("/")[0] == "NotImplementedError", (ours, theirs)
    assert "reshard_after_forward as int" in ours and "reshard_after_forward as int" in theirs, (ours, theirs)
    # with replicate alone FSDP2 takes the int and has nothing to reshard; flatshard says so rather than ignore it
    ours, theirs = (got["an int reshard_after_forward, replicate alone"][k] for k in ("flatshard", "fsdp2"))
    assert ours.startswith("ValueError/") and "nothing is sharded" in ours and theirs == "no error", (ours, theirs)


def test_hsdp_with_the_replicate_dim_after_the_shard_dim_matches_fsdp2():
    """("fsdp", "dp_replicate"): the data-parallel mesh is (replicate, shard) all the same."""
    outs = run_distributed(worker, 4, (2, 2), ("fsdp", "dp_replicate"), "fsdp", "dp_replicate", SIZES[1:])
    _check(outs, SIZES[1:])
    assert outs[0][SIZES[1]]["flatshard"]["placements"][0][1] == "(Shard(dim=0), Replicate())"


def test_replicate_dim_alone_matches_fsdp2():
    """replicate="dp" without a shard dim: FSDP2's DDP over the SPMD mesh. Nothing is sharded: every parameter
    stays on the whole mesh with the placements it was given, its gradient all-reduced over "dp"."""
    outs = run_distributed(worker, 2, (2,), ("dp",), None, "dp", SIZES[1:])
    _check(outs, SIZES[1:])
    assert outs[0][SIZES[1]]["flatshard"]["placements"][0] == ("[0, 1]", "(Replicate(),)")


def comms_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """One step of the replicate-only model: flatshard's collectives by (phase, kind, group size)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.tensor import DTensor, Replicate

    import flatshard

    # a dim name no other test's mesh has: a DTensor made on a mesh equal to one an earlier test of this pool
    # process made can come back on that earlier mesh object, which the same-mesh check then refuses
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("ddp",))
    model = _build(flatshard.fully_shard, mesh, DataParallelMeshDims(replicate="ddp"), False, 5, 6)
    x = DTensor.from_local(torch.randn(2, 5, generator=torch.Generator().manual_seed(rank)), mesh, [Replicate()])
    counts: dict = {}
    with model.record_comms(events=True) as rec:
        model(x).to_local().pow(2).mean().backward()
    for e in rec.events:
        if e.kind != "order_check":
            key = (str(e.phase), e.kind, e.group_size)
            counts[key] = counts.get(key, 0) + 1
    holding = sum(1 for u in flatshard.units(model) for g in u.flat_groups if g.param_names)  # with parameters
    return {"counts": counts, "units": holding}


def test_replicate_dim_alone_communicates_as_ddp():
    """No all-gather, no reduce-scatter: one all-reduce over "dp" per unit per backward (the engine's NO_SHARD)."""
    outs = run_distributed(comms_worker, 2)
    for out in outs:
        assert out["counts"] == {("backward", "all_reduce", 2): out["units"]}, out


def accumulation_worker(rank: int, world: int) -> bool:  # noqa: ARG001 - the harness's signature
    """Two steps of two micro-batches, the first under set_requires_all_reduce(False): every gradient
    flatshard's replicate-only model holds after each step, to the bit against FSDP2's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import DataParallelMeshDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import DTensor, Replicate

    import flatshard

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("acc",))  # a name of its own: see comms_worker
    got = {}
    for name, fn in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fully_shard)):
        model = _build(fn, mesh, DataParallelMeshDims(replicate="acc"), False, 5, 6)
        gen = torch.Generator().manual_seed(rank)
        got[name] = []
        for _ in range(2):
            for micro in range(2):
                model.set_requires_all_reduce(micro == 1)
                x = DTensor.from_local(torch.randn(2, 5, generator=gen), mesh, [Replicate()])
                model(x).to_local().pow(2).mean().backward()
            got[name].append([p.grad.to_local().clone() for p in model.parameters()])
            model.zero_grad()
    pairs = [(a, b) for ours, theirs in zip(got["flatshard"], got["fsdp2"]) for a, b in zip(ours, theirs)]
    return len(pairs) == 16 and all(torch.equal(a, b) for a, b in pairs)


def test_replicate_dim_alone_accumulates_as_fsdp2():
    assert run_distributed(accumulation_worker, 2) == [True, True]


def test_replicate_dim_alone_beside_tensor_parallel_matches_fsdp2():
    """("tp", "dp") and ("dp", "tp") with replicate="dp": the parameters keep their TP placements on the whole mesh."""
    for names in (("dp", "tp"), ("tp", "dp")):
        outs = run_distributed(worker, 4, (2, 2), names, None, "dp", SIZES[1:])
        _check(outs, SIZES[1:])
        want = "(Replicate(), Shard(dim=0))" if names[0] == "dp" else "(Shard(dim=0), Replicate())"
        assert outs[0][SIZES[1]]["flatshard"]["placements"][0] == ("[[0, 1], [2, 3]]", want), names


def test_two_replicate_dims_flattened_alone_match_fsdp2():
    """replicate=("dp0", "dp1") without a shard dim: both flattened into one all-reduce group of 4 ranks."""
    outs = run_distributed(worker, 4, (2, 2), ("dp0", "dp1"), None, ("dp0", "dp1"), SIZES[1:])
    _check(outs, SIZES[1:])
    assert outs[0][SIZES[1]]["flatshard"]["placements"][0] == ("[[0, 1], [2, 3]]", "(Replicate(), Replicate())")


def test_two_shard_dims_flattened_match_fsdp2():
    """shard=("dp_shard", "cp"): both dims flattened into one data-parallel dim of 4 ranks; the sharded
    parameter lives on the flattened mesh, as in FSDP2."""
    outs = run_distributed(worker, 4, (2, 2), ("dp_shard", "cp"), ("dp_shard", "cp"), None, SIZES[1:])
    _check(outs, SIZES[1:])
    mesh, placements = outs[0][SIZES[1]]["flatshard"]["placements"][0]
    assert (mesh, placements) == ("[0, 1, 2, 3]", "(Shard(dim=0),)"), (mesh, placements)
