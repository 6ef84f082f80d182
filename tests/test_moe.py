"""Mixture-of-Experts end to end on ``fully_shard`` (tests/helpers/moe.py: a small MoE transformer as torchtitan
builds it, with expert parallelism by token all-to-all in the model's own code), against PyTorch's FSDP2 on
the same script.

At W = 4: EP 2 x expert-FSDP 2 (each expert's weights sharded over the 2 ranks that hold it), the dense
parameters over all 4 ranks, one fully_shard call per block holding both meshes (``ShardPlacementResult``,
as torchtitan 0.3.0's distributed/fsdp.py). Two layouts of experts: 4 experts, 2 per rank, sharded along dim
0 (odd hidden size: shards pad); 2 experts, 1 per rank, so the expert-FSDP degree exceeds the local experts
and they are sharded along dim 1, as torchtitan does. Every step, every rank: the loss, every gradient and
parameter (``full_tensor``) equal FSDP2's at fp32's default tolerance, and bitwise where the reduction order
matches: the experts' gradients of the first step, summed over 2 ranks before any dense difference reaches
them (gloo sums 4 ranks in another order than flatshard's exchange, so the dense ones, and later steps,
differ in the last bits); every parameter a DTensor on FSDP2's mesh and placement; flatshard's collectives
per step equal the formula (one all-gather per flat group of more than one rank per pass, none in backward
for the root, one reduce-scatter per trainable group per backward). ``-s`` prints the table of steps.

DTensor experts: the same, with the experts' weights DTensors on the ep mesh (Shard(0), as torchtitan's
expert parallelism leaves them), placed on the expert-FSDP mesh alike.

Idle experts: step 1 routes ranks 0 and 1's tokens to ep rank 0's experts only, so rank 1's experts get no
token while rank 3, holding the same experts, gets some. Computed on an empty batch (zero gradients), and
skipped (no gradient on rank 1) under ``set_reduce_scatter_unused_params(True)``: both train as FSDP2. Skipped
without that setting in a later step, and ranks placing the experts on different meshes: the same error on
every rank, naming the parameters, the mesh and the fix, not a hang.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.helpers import moe
from tests.helpers.dist import raised, run_distributed

STEPS, PER_RANK, SEQ, VOCAB, DIM, LAYERS = 3, 2, 5, 13, 6, 2
# (experts, top-k, hidden): 2 local experts along dim 0 (odd hidden: shards pad); 1 along dim 1, where FSDP2
# needs dim 1 (hidden, dim) to divide evenly
LAYOUTS = ((4, 2, 5), (2, 1, 4))


def _full(model, grads: bool) -> list:
    out = []
    for n, p in model.named_parameters():
        t = p.grad if grads else p
        if t is None:
            out.append((n, None, None, None))
            continue
        out.append((n, t.full_tensor().detach().clone(), t.device_mesh.mesh.tolist(), str(t.placements)))
    return out


def _comms(rec) -> dict:
    out: dict = {}
    for e in rec.events:
        if e.kind != "order_check":
            key = (str(e.phase), e.kind, e.group_size)
            out[key] = out.get(key, 0) + 1
    return out


def _expected_comms(infos) -> dict:
    """Per flat group of F > 1 ranks: an all-gather per pass (none in backward for the root, which stays
    gathered), a reduce-scatter per backward if trainable."""
    out: dict = {}
    for u in infos:
        for g in u.flat_groups:
            size = len(g.shard_group_ranks)
            if size == 1:
                continue
            for key, n in (
                (("forward", "all_gather", size), 1),
                (("backward", "all_gather", size), 0 if u.is_root else 1),
                (("backward", "reduce_scatter", size), int(g.requires_grad)),
            ):
                if n:
                    out[key] = out.get(key, 0) + n
    return out


def _idle_route(rank: int, num_experts: int, top_k: int):
    """Ranks 0 and 1 send every token to ep rank 0's experts; ranks 2 and 3 spread theirs over all."""
    local = num_experts // 2

    def forced(x):
        t = torch.arange(x.shape[0]).unsqueeze(1) + torch.arange(top_k).unsqueeze(0)
        return t % local if rank < 2 else t % num_experts

    return forced


def _pair(rank, world, num_experts, top_k, hidden, ep=2, dtensor_experts=False):
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    dp, efsdp, ep_group = moe.meshes(world, ep)
    theirs, ours = (moe.build(VOCAB, DIM, hidden, num_experts, top_k, LAYERS, ep_group) for _ in range(2))
    if dtensor_experts:  # the experts' weights DTensors on the ep mesh, as torchtitan's expert parallelism has them
        for model in (theirs, ours):
            for m in model.moes():
                m.experts.as_dtensors(moe.ep_mesh(efsdp))
    moe.shard(theirs, torch_fsdp.fully_shard, dp, efsdp, num_experts, ep)
    moe.shard(ours, flatshard.fully_shard, dp, efsdp, num_experts, ep)
    return theirs, ours


def _train(rank: int, world: int, layout: tuple, opt_kind: str, idle: str, dtensor_experts: bool = False) -> dict:
    """``idle``: "" (the router's choice every step), "zero" (step 1 routes idle experts, computed on an
    empty batch), "skip" (the same, their forward skipped, set_reduce_scatter_unused_params(True)).
    ``dtensor_experts``: the experts' weights DTensors on the ep mesh (``GroupedExperts.as_dtensors``)."""
    import flatshard

    num_experts, top_k, hidden = layout
    theirs, ours = _pair(rank, world, num_experts, top_k, hidden, dtensor_experts=dtensor_experts)
    infos = flatshard.units(ours)
    if idle == "skip":
        for model in (theirs, ours):
            model.set_reduce_scatter_unused_params(True)

    def make(ps):
        return torch.optim.SGD(ps, lr=0.05, momentum=0.9) if opt_kind == "sgd" else torch.optim.AdamW(ps, lr=1e-2)

    opts = make(theirs.parameters()), make(ours.parameters())
    out: dict = {"steps": 0, "bitwise": [], "tokens": []}  # tokens: each step, what each layer's experts got
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(100 * step + rank)
        x = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=gen)
        for model in (theirs, ours):
            for m in model.moes():
                m.forced = _idle_route(rank, num_experts, top_k) if idle and step == 1 else None
                m.experts.skip_idle = idle == "skip"
        seen = []
        for model, opt in zip((theirs, ours), opts):
            with ours.record_comms(events=True) as rec:
                loss = F.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loss.backward()
            seen.append((loss.detach(), _full(model, grads=True)))
            opt.step()
            opt.zero_grad()
            seen[-1] += (_full(model, grads=False),)
        out["tokens"].append([m.experts.tokens for m in ours.moes()])
        expected = _expected_comms(infos)
        assert _comms(rec) == expected, (step, _comms(rec), expected)
        (loss_a, grads_a, params_a), (loss_b, grads_b, params_b) = seen
        torch.testing.assert_close(loss_b, loss_a, msg=lambda m: f"step {step}: loss {m}")
        bitwise = {"loss": torch.equal(loss_a, loss_b)}
        for kind, a_list, b_list in (("grad", grads_a, grads_b), ("param", params_a, params_b)):
            for (n, a, mesh_a, pl_a), (n_b, b, mesh_b, pl_b) in zip(a_list, b_list):
                assert (n, mesh_a, pl_a) == (n_b, mesh_b, pl_b), (n, mesh_a, pl_a, n_b, mesh_b, pl_b)
                assert (a is None) == (b is None), (step, kind, n)
                if a is not None:
                    torch.testing.assert_close(b, a, msg=lambda m, n=n, kind=kind: f"step {step}: {kind} {n} {m}")
                    bitwise[f"{kind} {n}"] = torch.equal(a, b)
        out["bitwise"].append(bitwise)
        out["steps"] += 1
    return out


def worker_4(rank: int, world: int) -> dict:
    out = {}
    for layout in LAYOUTS:
        out[f"E{layout[0]}"] = _train(rank, world, layout, "sgd", "")
    return out


def worker_dtensor_experts(rank: int, world: int) -> dict:
    # SGD for the layouts, as worker_4: with top-1 routing (E2) the router's weights get a gradient of
    # rounding noise only (a score divided by itself), which AdamW scales to full steps in either implementation
    out = {}
    for layout in LAYOUTS:
        out[f"E{layout[0]}"] = _train(rank, world, layout, "sgd", "", dtensor_experts=True)
    out["idle"] = _train(rank, world, LAYOUTS[0], "adamw", "skip", dtensor_experts=True)
    return out


def test_dtensor_experts_on_an_ep_mesh_train_as_fsdp2_at_w4():
    """The experts' weights DTensors on the ep mesh (Shard(0): each rank's own experts, the model reading
    them with to_local(), as torchtitan's GroupedExperts), placed on the expert-FSDP mesh by
    ShardPlacementResult: each parameter FSDP2's mesh and placement, loss, gradients and parameters equal
    FSDP2's every step, every rank, collectives per the formula (checked in ``_train``), the experts'
    first-step gradients to the bit, both layouts and the idle-expert step skipped under
    set_reduce_scatter_unused_params(True)."""
    outs = run_distributed(worker_dtensor_experts, 4, timeout=300)
    for rank, out in enumerate(outs):
        for key, res in out.items():
            assert res["steps"] == STEPS, (rank, key, res)
            if key != "idle":  # the experts' first step, as test_moe_trains_as_fsdp2_at_w4's, to the bit
                first = {k: v for k, v in res["bitwise"][0].items() if k.startswith("grad") and ".experts." in k}
                assert len(first) == 3 * LAYERS and all(first.values()), (rank, key, first)
        idle = out["idle"]["tokens"][1]
        assert idle == [0] * LAYERS if rank == 1 else all(idle), (rank, out["idle"]["tokens"])
    print(_table([{k: v for k, v in out.items() if k != "idle"} for out in outs]))


def worker_idle(rank: int, world: int) -> dict:
    return {kind: _train(rank, world, LAYOUTS[0], "adamw", kind) for kind in ("zero", "skip")}


def test_idle_experts_train_as_fsdp2_at_w4():
    """Step 1 leaves rank 1's experts without a token while rank 3, holding the same ones, has some: computed
    on an empty batch, and skipped under set_reduce_scatter_unused_params(True) (FSDP2 alike): no hang,
    every rank's loss, gradients and parameters equal FSDP2's every step (checked in ``_train``)."""
    outs = run_distributed(worker_idle, 4, timeout=120)
    for rank, out in enumerate(outs):
        for key, res in out.items():
            assert res["steps"] == STEPS, (rank, key, res)
            # step 1: rank 1's experts idle in every layer, the others' (rank 3: the same experts) busy
            idle = res["tokens"][1]
            assert idle == [0] * LAYERS if rank == 1 else all(idle), (rank, key, res["tokens"])


def test_moe_trains_as_fsdp2_at_w4():
    outs = run_distributed(worker_4, 4, timeout=300)
    for rank, out in enumerate(outs):
        for key, res in out.items():
            assert res["steps"] == STEPS, (rank, key, res)
            # the experts' first step, summed over 2 ranks before any dense difference reaches them, to the bit
            first = {k: v for k, v in res["bitwise"][0].items() if k.startswith("grad") and ".experts." in k}
            assert len(first) == 3 * LAYERS and all(first.values()), (rank, key, first)
    print(_table(outs))


def _table(outs) -> str:
    """Per layout and step: how many of the loss, gradients and parameters equal FSDP2's to the bit, over
    every rank (all equal to fp32's default tolerance, or the test failed)."""
    lines = []
    for key in outs[0]:
        for step in range(STEPS):
            rows = [out[key]["bitwise"][step] for out in outs]
            n, bit = sum(len(r) for r in rows), sum(sum(r.values()) for r in rows)
            ex = [v for r in rows for k, v in r.items() if ".experts." in k]
            lines.append(f"{key} step {step}: {bit}/{n} bitwise ({sum(ex)}/{len(ex)} of the experts'), all equal")
    return "\n".join(lines)


def _skip_without_setting(rank: int, world: int) -> str:
    """Step 1 skips rank 1's idle experts without set_reduce_scatter_unused_params: what flatshard raises."""
    import flatshard

    dp, efsdp, ep_group = moe.meshes(world, 2)
    model = moe.build(VOCAB, DIM, LAYOUTS[0][2], LAYOUTS[0][0], LAYOUTS[0][1], LAYERS, ep_group)
    moe.shard(model, flatshard.fully_shard, dp, efsdp, LAYOUTS[0][0], 2)

    def step(s: int) -> None:
        x = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=torch.Generator().manual_seed(s + rank))
        for m in model.moes():
            m.forced = _idle_route(rank, LAYOUTS[0][0], LAYOUTS[0][1]) if s == 1 else None
            m.experts.skip_idle = True
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()

    step(0)  # the first step, order-checked for every unit anyway
    return raised(lambda: step(1))


def _disagreeing_meshes(rank: int, world: int) -> str:
    """Ranks 0 and 1 put the experts on the expert-FSDP mesh, ranks 2 and 3 leave them on the call's."""
    import flatshard

    dp, efsdp, ep_group = moe.meshes(world, 2)
    model = moe.build(VOCAB, DIM, LAYOUTS[0][2], LAYOUTS[0][0], LAYOUTS[0][1], LAYERS, ep_group)
    return raised(lambda: moe.shard(model, flatshard.fully_shard, dp, efsdp if rank < 2 else dp, 4, 2))


def worker_refusals(rank: int, world: int) -> dict:
    return {"skip": _skip_without_setting(rank, world), "meshes": _disagreeing_meshes(rank, world)}


def test_moe_mistakes_raise_alike_on_every_rank():
    """Idle experts skipped in a later step without set_reduce_scatter_unused_params, and ranks that place the
    experts on different meshes: the same error on every rank, naming what and how to fix it, not a hang."""
    outs = run_distributed(worker_refusals, 4, timeout=120)
    for rank, out in enumerate(outs):
        skip, meshes = out["skip"], out["meshes"]
        assert skip == outs[0]["skip"] and meshes == outs[0]["meshes"], (rank, out, outs[0])
        assert skip.startswith("RuntimeError") and "set_reduce_scatter_unused_params(True)" in skip, skip
        assert "moe.experts.w1" in skip and "mesh of 2 ranks" in skip, skip
        assert meshes.startswith("ValueError") and "moe.experts.w1" in meshes and "different meshes" in meshes, meshes
