"""``flatshard.fully_shard`` against PyTorch's FSDP2, step by step: the same model sharded both ways, the
same batches, compared after every step (losses, gradient norms from torch.nn.utils.clip_grad_norm_,
every rank's local shard of every parameter). fp32 at W = 2 (SGD-momentum and AdamW, gradient
accumulation through set_requires_gradient_sync) and HSDP on a 2x2 mesh at W = 4; bf16 mixed precision;
DCP checkpoints written by one and read by the other, both ways and at another world size; FSDP2's
methods."""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.helpers.cases import fsdp2_pair, token_loss
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyGPT

STEPS = 5
PER_RANK = 3


def _locals(model):
    return [p._local_tensor.detach().clone() for p in model.parameters()]


def parity_worker(rank: int, world: int, hsdp: bool, mp: bool) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    dtype = torch.bfloat16 if mp else None
    out = {"bitwise_steps": 0, "steps": 0}
    for opt_kind in ("sgd", "adamw"):
        theirs, ours = fsdp2_pair(mesh, dtype)
        assert isinstance(ours, flatshard.FSDPModule) and all(
            isinstance(p, torch.distributed.tensor.DTensor) for p in ours.parameters()
        )
        make = (
            (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
            if opt_kind == "sgd"
            else (lambda ps: torch.optim.AdamW(ps, lr=1e-2))
        )
        opts = make(theirs.parameters()), make(ours.parameters())
        # bf16: gathered parameters and gradients are rounded to 8 bits; AdamW's first steps move each
        # element by about lr whatever its gradient's size, so a rounding flip of a near-zero gradient moves
        # it by up to lr: its tolerance is lr
        tol = ({"rtol": 2e-2, "atol": 2e-3 if opt_kind == "sgd" else 1.5e-2}) if mp else {}
        for step in range(STEPS):
            g = torch.Generator().manual_seed(100 * step + rank)
            micro = [torch.randint(0, 37, (PER_RANK, 8), generator=g) for _ in range(2)]
            losses, norms = [], []
            for model, opt in zip((theirs, ours), opts):
                model.set_requires_gradient_sync(False)  # gradient accumulation: the first micro-batch unreduced
                loss = token_loss(model, micro[0]) / 2
                loss.backward()
                model.set_requires_gradient_sync(True)
                loss2 = token_loss(model, micro[1]) / 2
                loss2.backward()
                losses.append((loss + loss2).item())
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)))
                opt.step()
                opt.zero_grad()
            what = f"hsdp={hsdp} mp={mp} {opt_kind} step {step}"
            torch.testing.assert_close(losses[1], losses[0], msg=lambda m: f"{what}: loss {m}", **tol)
            torch.testing.assert_close(norms[1], norms[0], msg=lambda m: f"{what}: grad norm {m}", **tol)
            a, b = _locals(theirs), _locals(ours)
            assert [t.shape for t in a] == [t.shape for t in b], "the same local shards (Shard(0), torch.chunk)"
            for t_a, t_b in zip(a, b):
                torch.testing.assert_close(t_b, t_a, msg=lambda m: f"{what}: parameter {m}", **tol)
            out["bitwise_steps"] += all(map(torch.equal, a, b)) and losses[0] == losses[1] and norms[0] == norms[1]
            out["steps"] += 1
    return out


@pytest.mark.parametrize(("world", "hsdp", "mp"), [(2, False, False), (4, True, False), (2, False, True)])
def test_fully_shard_matches_pytorch_fsdp2_step_by_step(world, hsdp, mp):
    for out in run_distributed(parity_worker, world, hsdp, mp, timeout=400):
        assert out["steps"] == 2 * STEPS
        if not mp:  # the same reduction order at W = 2 and in HSDP's shard groups of 2: losses, gradient
            # norms (clip_grad_norm_'s) and every local shard to the bit, every step
            assert out["bitwise_steps"] == out["steps"], out


def smaller_group_worker(rank: int, world: int) -> dict:
    """reshard_after_forward=2 at W = 4: each block keeps half its parameters after forward, and backward
    gathers them within pairs of ranks; results equal flatshard's own run that frees them (to the bit)
    and PyTorch's FSDP2 with the same setting (its 4-way reduce-scatter sums in another order)."""
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    torch.manual_seed(0)
    base = TinyGPT()
    theirs, ours, freed = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    import torch.distributed as dist

    groups = {}
    for model, shard, after in (
        (theirs, torch_fsdp.fully_shard, 2),
        (ours, flatshard.fully_shard, 2),
        (freed, flatshard.fully_shard, True),
    ):
        before = dist.get_pg_count()
        for block in model.blocks:
            shard(block, reshard_after_forward=after)
        shard(model)
        groups[model is ours] = dist.get_pg_count() - before
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours, freed)]
    out = {"bitwise": 0}
    for step in range(3):
        x = torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(step + 10 * rank))
        losses = []
        for model, opt in zip((theirs, ours, freed), opts):
            if model is ours:
                with ours.record_comms(events=True) as rec:
                    loss = token_loss(model, x)
                    loss.backward()
            else:
                loss = token_loss(model, x)
                loss.backward()
            losses.append(loss.item())
            opt.step()
            opt.zero_grad()
        a, b, c = _locals(theirs), _locals(ours), _locals(freed)
        for t_a, t_b in zip(a, b):
            torch.testing.assert_close(t_b, t_a)
        out["bitwise"] += all(map(torch.equal, b, c)) and losses[1] == losses[2]
    blocks = [u for u in flatshard.units(ours) if u.name.startswith("blocks.")]
    half = [-(-u.padded_numel // 2) for u in blocks]  # rank r keeps piece r mod 2: the first half, or the rest
    piece = [h if u.shard_rank % 2 == 0 else u.padded_numel - h for h, u in zip(half, blocks)]
    gathers = sorted(e.wire_bytes for e in rec.events if e.group == "post_forward")
    out["post_forward gathers"] = gathers == sorted(float(p * 4) for p in piece)  # one piece sent to one peer
    out["full backward gathers"] = sum(
        1 for e in rec.events if e.kind == "all_gather" and e.phase == "backward" and e.group == "shard"
    )
    # every block's call with the same mesh and g = 2 shares the two groups of 2 ranks, made once
    out["groups made"] = (groups[True], len(model.blocks))
    return out


def test_reshard_after_forward_to_a_smaller_group():
    for out in run_distributed(smaller_group_worker, 4, timeout=300):
        assert out.pop("groups made") == (2, 2), out  # (groups, blocks): one group per block would be 4
        assert out == {"bitwise": 3, "post_forward gathers": True, "full backward gathers": 0}, out


# ---- DCP checkpoints across the two implementations ------------------------------------------------------
def dcp_save_worker(rank: int, world: int, path: str, writer: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    theirs, ours = fsdp2_pair(seed=1)
    model = theirs if writer == "torch" else ours
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(2):
        x = torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(step + 7 * rank))
        token_loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return _full_state(model, opt)


def _full_state(model, opt) -> list:
    """Every parameter and every optimizer state tensor, whole (an all-gather of each DTensor)."""
    out = [p.full_tensor() for p in model.parameters()]
    for p in model.parameters():
        for v in opt.state[p].values():
            out.append(v.full_tensor() if isinstance(v, torch.distributed.tensor.DTensor) else v.clone())
    return out


def dcp_load_worker(rank: int, world: int, path: str, reader: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    theirs, ours = fsdp2_pair(seed=2)  # other weights: the load must overwrite them
    model = theirs if reader == "torch" else ours
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 37, (PER_RANK, 8))
    token_loss(model, x).backward()
    opt.step()  # optimizer state exists, to be overwritten
    opt.zero_grad()
    sd = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(model, sd["model"])
    set_optimizer_state_dict(model, opt, sd["optim"])
    state = _full_state(model, opt)
    token_loss(model, x).backward()  # and it trains on from there
    opt.step()
    return state


@pytest.mark.parametrize(
    ("writer", "reader", "load_world"),
    [("torch", "flatshard", 2), ("flatshard", "torch", 2), ("flatshard", "flatshard", 3)],
)
def test_dcp_checkpoints_move_between_pytorch_fsdp2_and_flatshard(tmp_path, writer, reader, load_world):
    path = str(tmp_path / "dcp")
    saved = run_distributed(dcp_save_worker, 2, path, writer, timeout=200)[0]
    assert os.listdir(path)
    for loaded in run_distributed(dcp_load_worker, load_world, path, reader, timeout=200):
        assert len(loaded) == len(saved)
        for a, b in zip(saved, loaded):
            assert torch.equal(a, b), (writer, reader, load_world)


# ---- FSDP2's methods ----------------------------------------------------------------------------------
def methods_worker(rank: int, world: int) -> dict:
    import flatshard
    from flatshard import NotBuiltError, testing

    _, ours = fsdp2_pair()
    out = {}
    block = ours.blocks[0]
    handle = block.unshard(async_op=True)
    handle.wait()
    out["unshard"] = testing.is_gathered(block)
    block.reshard()
    out["reshard"] = not testing.is_gathered(block)
    ours.set_reshard_after_forward(False)
    x = torch.randint(0, 37, (PER_RANK, 8))
    y = ours(x)
    out["kept after forward"] = testing.is_gathered(ours.blocks[1])
    y.sum().backward()
    for p in ours.parameters():
        p.grad = None
    ours.set_reshard_after_forward(True)
    ours.blocks[0].set_modules_to_forward_prefetch([ours.blocks[1]])
    ours.blocks[1].set_modules_to_backward_prefetch([ours.blocks[0]])
    torch.manual_seed(0)
    ref = TinyGPT()  # the same initial weights; every rank used the same x: the sum is W times its gradient
    token_loss(ref, x).backward()
    # the root's own parameters only, as in FSDP2 (its param groups): the blocks still take the mean
    ours.set_gradient_divide_factor(1.0)  # a sum, not a mean, over the ranks
    token_loss(ours, x).backward()
    scale = {n: 1 if n.startswith("blocks.") else world for n, _ in ours.named_parameters()}
    out["divide factor on the root only"] = [
        n
        for (n, p), r in zip(ours.named_parameters(), ref.parameters())
        if not torch.allclose(p.grad.full_tensor(), r.grad * scale[n], rtol=1e-4, atol=1e-5)
    ]
    assert 1 in scale.values() and world in scale.values(), scale  # both kinds are there to tell apart
    for p in ours.parameters():
        p.grad = None
    for m in ours.modules():  # as torchtitan sets it: on every FSDPModule
        if isinstance(m, flatshard.FSDPModule):
            m.set_gradient_divide_factor(1.0)
    token_loss(ours, x).backward()
    summed = [p.grad.full_tensor() for p in ours.parameters()]
    out["divide factor"] = all(
        torch.allclose(s, r.grad * world, rtol=1e-4, atol=1e-5) for s, r in zip(summed, ref.parameters())
    )
    try:
        ours.set_symm_mem_for_comm()
        out["not built"] = "no error"
    except NotBuiltError as e:
        out["not built"] = str(e)
    try:  # flatshard's checkpoints take fully_shard models (tests/test_checkpoint_fully_shard.py)
        flatshard.checkpoint.save(os.devnull + "/ckpt", ours)  # under a file: cannot be created
    except flatshard.CheckpointError as e:
        out["flatshard checkpoint"] = str(e)
    return out


def test_fsdp2_methods():
    for out in run_distributed(methods_worker, 2, timeout=200):
        assert out["unshard"] and out["reshard"] and out["kept after forward"] and out["divide factor"], out
        assert out["divide factor on the root only"] == [], out
        assert out["not built"].startswith("FSDPModule.set_symm_mem_for_comm is not built"), out
        assert os.devnull + "/ckpt.partial" in out["flatshard checkpoint"], out
