"""Parameters placed on a mesh of their own by ``shard_placement_fn`` (FSDP2's ``ShardPlacementResult``):
one flat group per (mesh, dtype) ([Note: a flat group per mesh], runtime/build/grouping.py), against PyTorch's
FSDP2 on the same script.

At W = 4 the dense parameters are sharded over the call's mesh (4,) and each block's expert-like MLP over
a 2-rank sub-mesh, the ``efsdp`` dim of a (rep, efsdp) = (2, 2) mesh, as MoE models shard their experts
(its bias placed with ``placement=None``, FSDP2's Shard(0)); odd shapes pad both meshes' shards. Then
the same with the dense parameters under HSDP on a (replicate, shard) = (2, 2) mesh, and with the experts
under HSDP on their own (rep, efsdp) = (2, 2) mesh (``HSDPMeshInfo``; AdamW). At W = 2
the dense parameters pad over (2,) and the experts sit on a 1-rank ``efsdp`` dim of a (2, 1) mesh.
Checked every step, with SGD-momentum and AdamW: the loss, every gradient and parameter (``full_tensor``)
equal FSDP2's, bitwise where the reduction order matches FSDP2's (tolerance-free ``torch.equal``: every
group of 2 ranks, so W = 2 and HSDP throughout and the experts' first step at W = 4), else to fp32's
default tolerance (gloo sums 4 ranks in another order); every parameter a
DTensor on FSDP2's mesh and placement; collectives counted per group size: one all-gather per flat
group per pass (none for a 1-rank group), one reduce-scatter per trainable group per backward. Also:
ranks that place a parameter on meshes that disagree fail alike on every rank, naming it, and what is
not built (an HSDPMeshInfo sharding its dim 0, a 2-D FSDPMeshInfo mesh, an int reshard_after_forward
beside another mesh) raises NotBuiltError on every rank. And at W = 4 the experts on their own mesh beside
each block's fc made tensor-parallel (a (dp, tp) = (2, 2) mesh): equal to FSDP2 to the bit."""

from __future__ import annotations

import contextlib
import copy
from collections import Counter

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import raised, run_distributed

STEPS, PER_RANK = 3, 3


class Expert(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Linear(dim, hidden)
        self.w_out = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        return self.w_out(F.gelu(self.w_in(x)))


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)
        self.expert = Expert(dim, hidden)

    def forward(self, x):
        h = self.norm(x)
        return x + torch.tanh(self.fc(h)) + self.expert(h)


class Net(nn.Module):
    def __init__(self, vocab: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim, hidden) for _ in range(2))
        self.head = nn.Linear(dim, vocab)

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _placement_fn(model: Net, info):
    """Every expert parameter on ``info``'s mesh (the bias with placement=None: Shard(0)); the rest, and every
    parameter when ``info`` is None, on the call's."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import ShardPlacementResult
    from torch.distributed.tensor import Shard

    expert = {id(p): n for n, p in model.named_parameters() if ".expert." in n}

    def fn(p):
        if id(p) not in expert or info is None:
            return None
        return ShardPlacementResult(placement=None if expert[id(p)].endswith("bias") else Shard(0), mesh_info=info)

    return fn


def _shard(model: Net, shard, mesh, fn, **kw) -> Net:
    for block in model.blocks:
        shard(block, mesh=mesh, shard_placement_fn=fn, **kw)
    shard(model, mesh=mesh, shard_placement_fn=fn, **kw)
    return model


def _meshes(world: int, expert_shape: tuple[int, int], hsdp: bool = False, expert_hsdp: bool = False):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    if hsdp:
        dense = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        dense = init_device_mesh("cpu", (world,))
    two_d = init_device_mesh("cpu", expert_shape, mesh_dim_names=("rep", "efsdp"))
    if expert_hsdp:  # the experts sharded over efsdp and replicated over rep, as torchtitan's under HSDP
        return dense, two_d["efsdp"], HSDPMeshInfo(mesh=two_d, shard_mesh_dim=1, replicate_mesh_dim=0)
    return dense, two_d["efsdp"], FSDPMeshInfo(mesh=two_d["efsdp"], shard_mesh_dim=0)


def _comms(rec) -> Counter:
    """The model's collectives, by (phase, kind, group size); the order checks' exchanges left out."""
    return Counter((str(e.phase), e.kind, e.group_size) for e in rec.events if e.kind != "order_check")


def _expected_comms(infos, replicas: int, expert_replicas: int = 1) -> Counter:
    """Per flat group of F > 1 ranks: an all-gather per pass (the root stays gathered for backward) and a
    reduce-scatter per backward; a 1-rank group issues nothing. Under HSDP (``replicas`` > 1) each dense
    group's reduce-scatter is followed by an all-reduce over the replicas; the experts' likewise over
    their mesh's replicate dim when it has one (``expert_replicas`` > 1)."""
    out: Counter = Counter()
    for u in infos:
        for g in u.flat_groups:
            size = len(g.shard_group_ranks)
            if size > 1:
                out[("forward", "all_gather", size)] += 1
                out[("backward", "all_gather", size)] += 0 if u.is_root else 1
                out[("backward", "reduce_scatter", size)] += int(g.requires_grad)
            expert = any(".expert." in f".{n}" for n in g.param_names)
            if replicas > 1 and not expert:
                out[("backward", "all_reduce", replicas)] += int(g.requires_grad)
            if expert_replicas > 1 and expert:
                out[("backward", "all_reduce", expert_replicas)] += int(g.requires_grad)
    return +out


def _full(model, grads: bool) -> list:
    out = []
    for n, p in model.named_parameters():
        t = p.grad if grads else p
        out.append((n, t.full_tensor().detach().clone(), t.device_mesh.mesh.tolist(), str(t.placements)))
    return out


def _one_step(model, opt, x, record):
    """One step on the token batch ``x``, forward and backward inside ``record``: ((loss, gradients,
    parameters after the step), what ``record`` gave)."""
    with record as rec:
        loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
        loss.backward()
    grads = _full(model, grads=True)
    opt.step()
    opt.zero_grad()
    return (loss.detach(), grads, _full(model, grads=False)), rec


def _train(
    world: int,
    expert_shape,
    shapes,
    opt_kind: str,
    rank: int,
    hsdp: bool = False,
    factor: float | None = None,
    expert_hsdp: bool = False,
) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    dense, efsdp, info = _meshes(world, expert_shape, hsdp, expert_hsdp)
    torch.manual_seed(0)
    base = Net(*shapes)
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    _shard(theirs, torch_fsdp.fully_shard, dense, _placement_fn(theirs, info))
    _shard(ours, flatshard.fully_shard, dense, _placement_fn(ours, info))
    if factor is not None:  # torchtitan's set_gradient_divide_factor on every unit, a one-rank mesh's included
        for model in (theirs, ours):
            for m in model.modules():
                if hasattr(m, "set_gradient_divide_factor"):
                    m.set_gradient_divide_factor(factor)
    infos = flatshard.units(ours)
    sizes = sorted({len(g.shard_group_ranks) for u in infos for g in u.flat_groups})
    assert sizes == sorted({dense.size(dense.ndim - 1), efsdp.size()}), sizes
    assert all(len(u.flat_groups) == 2 for u in infos if not u.is_root), [len(u.flat_groups) for u in infos]

    def make(ps):
        return torch.optim.SGD(ps, lr=0.05, momentum=0.9) if opt_kind == "sgd" else torch.optim.AdamW(ps, lr=1e-2)

    opts = make(theirs.parameters()), make(ours.parameters())
    out: dict = {"bitwise": True, "steps": 0, "differ": []}  # differ: (step, name, its mesh's size) not bitwise
    for step in range(STEPS):
        x = torch.randint(0, shapes[0], (PER_RANK, 6), generator=torch.Generator().manual_seed(100 * step + rank))
        seen = []
        for model, opt in zip((theirs, ours), opts):
            # flatshard's own collectives: only ``ours`` adds any
            result, rec = _one_step(model, opt, x, ours.record_comms(events=True))
            seen.append(result)
        expected = _expected_comms(
            infos, dense.size(0) if dense.ndim == 2 else 1, expert_shape[0] if expert_hsdp else 1
        )
        assert _comms(rec) == expected, (step, _comms(rec), expected)
        (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = seen
        torch.testing.assert_close(loss_b, loss_a, msg=lambda m: f"{opt_kind} step {step}: loss {m}")
        for (n, a, mesh_a, pl_a), (n_b, b, mesh_b, pl_b) in zip(grads_a + params_a, grads_b + params_b):
            assert (n, mesh_a, pl_a) == (n_b, mesh_b, pl_b), (n, mesh_a, pl_a, n_b, mesh_b, pl_b)
            torch.testing.assert_close(b, a, msg=lambda m: f"{opt_kind} step {step}: {n} {m}")
            out["bitwise"] = out["bitwise"] and torch.equal(a, b)
            if not torch.equal(a, b):
                out["differ"].append((step, n, len(mesh_a)))
        out["bitwise"] = out["bitwise"] and torch.equal(loss_a, loss_b)
        out["steps"] += 1
    return out


def _refusals(world: int, rank: int) -> dict:
    """What flatshard raises on every rank for meshes the ranks disagree on, and for what is not built."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, HSDPMeshInfo

    import flatshard

    dense = init_device_mesh("cpu", (world,))
    two_d = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("rep", "efsdp"))
    other = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("efsdp", "rep"))["efsdp"]
    mine = FSDPMeshInfo(mesh=two_d["efsdp"], shard_mesh_dim=0)
    crossed = FSDPMeshInfo(mesh=other, shard_mesh_dim=0)
    shapes = (11, 6, 10)

    def wrap(info, **kw):
        model = Net(*shapes)
        return lambda: _shard(model, flatshard.fully_shard, dense, _placement_fn(model, info), **kw)

    def own_call():  # the experts in a fully_shard call of their own on the expert mesh, under the block's
        model = Net(*shapes)
        for block in model.blocks:
            flatshard.fully_shard(block.expert, mesh=two_d["efsdp"])
            flatshard.fully_shard(block, mesh=dense)
        flatshard.fully_shard(model, mesh=dense)
        model(torch.randint(0, shapes[0], (2, 3)))

    out = {
        "own call on another mesh": raised(own_call),
        # ranks 0 and 1 put the experts on a mesh of their own, the others leave them on the call's mesh
        "half on the call's mesh": raised(wrap(mine if rank < 2 else None)),
        # ranks 0 and 1 on (rep, efsdp)'s efsdp dim, {0, 1}; ranks 2 and 3 on (efsdp, rep)'s: {0, 2} and {1, 3}
        "crossed meshes": raised(wrap(mine if rank < 2 else crossed)),
        "HSDPMeshInfo sharding dim 0": raised(wrap(HSDPMeshInfo(mesh=two_d, shard_mesh_dim=0, replicate_mesh_dim=1))),
        "2-D FSDPMeshInfo": raised(wrap(FSDPMeshInfo(mesh=two_d, shard_mesh_dim=1))),
        "int reshard_after_forward": raised(wrap(mine, reshard_after_forward=2)),
    }
    dist.barrier()  # every rank is past every refusal: nothing left waiting
    return out


def worker_4(rank: int, world: int) -> dict:
    shapes = (13, 7, 9)  # vocab, dim, hidden: odd, so both meshes' shards pad
    out = {kind: _train(world, (2, 2), shapes, kind, rank) for kind in ("sgd", "adamw")}
    out["hsdp"] = _train(world, (2, 2), shapes, "adamw", rank, hsdp=True)
    out["experts hsdp"] = _train(world, (2, 2), shapes, "adamw", rank, expert_hsdp=True)
    out["refusals"] = _refusals(world, rank)
    return out


def worker_2(rank: int, world: int) -> dict:
    out = {kind: _train(world, (2, 1), (11, 5, 7), kind, rank) for kind in ("sgd", "adamw")}
    out["factor"] = _train(world, (2, 1), (11, 5, 7), "sgd", rank, factor=float(world))
    return out


def test_experts_on_a_sub_mesh_train_as_fsdp2_at_w4():
    outs = run_distributed(worker_4, 4, timeout=300)
    for rank, out in enumerate(outs):
        for kind in ("sgd", "adamw"):
            assert out[kind]["steps"] == STEPS, (rank, out[kind])
        refusals = out["refusals"]
        for key in ("half on the call's mesh", "crossed meshes"):
            assert refusals[key].startswith("ValueError") and "expert.w_in.weight" in refusals[key], refusals
            assert refusals[key] == outs[0]["refusals"][key], (rank, refusals[key])  # the same words on every rank
        assert "on different meshes" in refusals["half on the call's mesh"], refusals
        assert "disagree" in refusals["crossed meshes"] and "[0, 2]" in refusals["crossed meshes"], refusals
        # what to do instead: the enclosing call's shard_placement_fn
        assert refusals["own call on another mesh"] == outs[0]["refusals"]["own call on another mesh"], refusals
        assert "fully_shard: pass the same mesh=" in refusals["own call on another mesh"], refusals
        assert "ShardPlacementResult" in refusals["own call on another mesh"], refusals
        for key in (
            "own call on another mesh",
            "HSDPMeshInfo sharding dim 0",
            "2-D FSDPMeshInfo",
            "int reshard_after_forward",
        ):
            assert refusals[key].startswith("NotBuiltError"), (key, refusals[key])
        assert "mesh['efsdp']" in refusals["2-D FSDPMeshInfo"], refusals
        # each refusal of a layout beside another mesh names what runs instead, and only that
        int_reshard = refusals["int reshard_after_forward"]
        assert int_reshard.rstrip().endswith("Pass reshard_after_forward as a bool."), int_reshard
        assert "call of its own" not in int_reshard, int_reshard
        for kind in ("sgd", "adamw"):
            # gloo sums 4 ranks' gradients in another order than flatshard's exchange (as at W = 3 in
            # tests/test_dtype_groups.py): the dense parameters match FSDP2's to fp32's default tolerance;
            # the experts' first step, summed over 2 ranks before any dense difference reaches them, to the bit
            assert not [d for d in out[kind]["differ"] if d[0] == 0 and d[2] == 2], (rank, kind, out[kind]["differ"])
        assert out["hsdp"]["steps"] == STEPS and out["hsdp"]["bitwise"], (rank, out["hsdp"])  # every group of 2 ranks
        # the experts under HSDP on their own (rep, efsdp) mesh: their first step's sums are of 2 ranks each
        hsdp_experts = out["experts hsdp"]
        assert hsdp_experts["steps"] == STEPS, (rank, hsdp_experts)
        assert not [d for d in hsdp_experts["differ"] if d[0] == 0 and ".expert." in d[1]], (rank, hsdp_experts)


def test_experts_on_a_one_rank_mesh_beside_padded_shards_train_as_fsdp2_at_w2():
    outs = run_distributed(worker_2, 2, timeout=300)
    for rank, out in enumerate(outs):
        # "factor": set_gradient_divide_factor(W) on every unit divides the one-rank mesh's gradients too
        for kind in ("sgd", "adamw", "factor"):
            assert out[kind]["steps"] == STEPS, (rank, out[kind])
            assert out[kind]["bitwise"], (rank, kind, out[kind]["differ"])  # 2 ranks: every step to the bit


def beside_tensor_parallel_worker(rank: int, world: int) -> dict:
    """Each block's fc tensor-parallel over a (dp, tp) = (2, 2) mesh's tp dim, the call's mesh the dp dim,
    and the experts placed on a mesh of their own (a one-rank mesh inside the dp group's ranks: placed
    meshes hold only ranks of the call's mesh); TP peers train on the same batch. Against FSDP2, AdamW,
    every step: loss, every gradient and parameter (full_tensor) at fp32's default tolerance and counted
    bitwise, the same meshes and placements."""
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module

    import flatshard

    dp_tp = init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))
    solo = init_device_mesh("cpu", (world, 1), mesh_dim_names=("all", "solo"))["solo"]
    torch.manual_seed(0)
    base = Net(13, 8, 9)
    models = []
    for fully_shard in (torch_fsdp.fully_shard, flatshard.fully_shard):
        model = copy.deepcopy(base)
        for block in model.blocks:
            parallelize_module(block, dp_tp["tp"], {"fc": ColwiseParallel(output_layouts=Replicate())})
        models.append(_shard(model, fully_shard, dp_tp["dp"], _placement_fn(model, FSDPMeshInfo(solo, 0))))
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in models]
    out = {"steps": 0, "compared": 0, "bitwise": 0}
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + dp_tp["dp"].get_local_rank())
        x = torch.randint(0, 13, (PER_RANK, 6), generator=gen)
        seen = [_one_step(model, opt, x, contextlib.nullcontext())[0] for model, opt in zip(models, opts)]
        (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = seen
        torch.testing.assert_close(loss_b, loss_a)
        for (n, a, mesh_a, pl_a), (n_b, b, mesh_b, pl_b) in zip(grads_a + params_a, grads_b + params_b):
            assert (n, mesh_a, pl_a) == (n_b, mesh_b, pl_b), (n, mesh_a, pl_a, n_b, mesh_b, pl_b)
            torch.testing.assert_close(b, a, msg=lambda m, n=n: f"step {step}: {n} {m}")
            out["compared"] += 1
            out["bitwise"] += int(torch.equal(a, b))
        out["steps"] += 1
    out["tp placements"] = sorted({pl for n, _, _, pl in params_b if n.endswith("fc.weight")})
    return out


def test_experts_on_their_mesh_beside_tensor_parallel_parameters_train_as_fsdp2_at_w4():
    outs = run_distributed(beside_tensor_parallel_worker, 4, timeout=300)
    for rank, out in enumerate(outs):
        assert out["steps"] == STEPS and out["compared"] > 0, (rank, out)
        # FSDP's chunk of the rows TP already cut, strided (FSDP2's placement, compared above as well)
        assert out["tp placements"] == ["(_StridedShard(dim=0, sf=2), Shard(dim=0))"], out
        # every sum is over 2 ranks (the dp group, TP's own), so the order is gloo's and flatshard's alike
        assert out["bitwise"] == out["compared"], (rank, out)
