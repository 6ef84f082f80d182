"""``fully_shard(..., shard_boundaries="params")``: every parameter whole on one rank, a DTensor on its
owner's one-rank mesh ([Note: whole parameters on fully_shard], src/flatshard/fsdp2/whole.py).

Multi-process: every parameter whole on exactly one rank, owners balanced by size; parity with one
process over the global batch every step at W = 2 and 3 for SGD with momentum (with
``clip_grad_norm_``), AdamW and Adafactor, and for Muon + AdamW against a control that differs only
by rounding (Muon stepping the same gradients in one process, bitwise), with no collective inside
``optimizer.step()``; ``torch.distributed.checkpoint`` saving at W = 4 and loading at W = 2, model and
optimizer; what is not built refused alike on every rank."""

from __future__ import annotations

import collections
import copy

import pytest
import torch
import torch.distributed as dist

from flatshard.testing import count_dist_calls
from tests.helpers.dist import raised, run_distributed
from tests.helpers.models import TinyGPT

PER_RANK = 2
STEPS = 4


def _sharded(world_unused=None):
    import flatshard

    torch.manual_seed(0)
    model = TinyGPT(dim=16, heads=2, layers=2)
    for block in model.blocks:
        flatshard.fully_shard(block, shard_boundaries="params")
    flatshard.fully_shard(model, shard_boundaries="params")
    return model


def _full(p: torch.Tensor, held=None) -> torch.Tensor:
    """The whole tensor of a parameter (or gradient, or ``held``, its optimizer state) held by its owner,
    on every rank (test-only: a sum)."""
    out = torch.zeros(p.shape, dtype=p.dtype)
    local = (held if held is not None else p).to_local()
    if local.numel():
        out.copy_(local)
    dist.all_reduce(out)
    return out


def _optimizers(recipe: str, params: list) -> list:
    if recipe == "sgd":
        return [torch.optim.SGD(params, lr=0.05, momentum=0.9)] if params else []
    if recipe == "adamw":
        return [torch.optim.AdamW(params, lr=1e-2)] if params else []
    if recipe == "adafactor":
        return [torch.optim.Adafactor(params, lr=1e-2)] if params else []
    matrices = [p for p in params if p.ndim == 2]  # a rank may own no matrix, or nothing else
    rest = [p for p in params if p.ndim != 2]
    return [o(ps, lr=1e-2) for o, ps in ((torch.optim.Muon, matrices), (torch.optim.AdamW, rest)) if ps]


def _check_placement(model, rank: int, world: int) -> dict:
    """Each parameter a DTensor on a one-rank mesh, whole on that rank and empty on the others."""
    owned = [0] * world
    largest = 0
    for name, p in model.named_parameters():
        mesh = p.device_mesh
        assert mesh.size() == 1, (name, mesh)
        owner = int(mesh.mesh.reshape(-1)[0])
        local = p.to_local()
        assert (tuple(local.shape) == tuple(p.shape)) if owner == rank else local.numel() == 0, (name, local.shape)
        owned[owner] += p.numel()
        largest = max(largest, p.numel())
    return {"owned": owned, "largest": largest}


def parity_worker(rank: int, world: int) -> dict:
    """Every recipe for STEPS steps; SGD, AdamW and Adafactor against one process over the global batch
    (fp32 tolerances, every parameter and gradient every step). Muon runs Newton-Schulz in bf16, so two
    runs whose gradients differ by rounding part whatever runs them: each step the reference restarts
    from the sharded parameters and the gradients are checked against it (fp32 tolerances), and the step
    against a mirror, Muon in one process given the same gradients, bitwise."""
    import flatshard
    from flatshard.fsdp2 import clip_grad_norm_

    out: dict = {"comms": {}}
    loss_fn = torch.nn.functional.cross_entropy
    for recipe in ("sgd", "adamw", "adafactor", "muon+adamw"):
        torch.manual_seed(0)
        ref = TinyGPT(dim=16, heads=2, layers=2)
        mirror = copy.deepcopy(ref)
        model = _sharded()
        out.setdefault("placement", _check_placement(model, rank, world))  # the first model: nothing else alive
        # AdamW is given every parameter (the empty ones of other ranks too: their ops do nothing), the
        # others this rank's own
        owned = (
            list(model.parameters()) if recipe == "adamw" else [p for _, p in flatshard.owned_named_parameters(model)]
        )
        opts, ref_opts = _optimizers(recipe, owned), _optimizers(recipe, list(ref.parameters()))
        mirror_opts = _optimizers(recipe, list(mirror.parameters()))
        comms: collections.Counter = collections.Counter()
        for step in range(STEPS):
            what = f"{recipe} W={world} step {step}"
            g = torch.Generator().manual_seed(step)
            x = torch.randint(0, 37, (world * PER_RANK, 8), generator=g)
            mine = x[rank * PER_RANK : (rank + 1) * PER_RANK]
            if recipe == "muon+adamw":
                with torch.no_grad():
                    for p, r in zip(model.parameters(), ref.parameters()):
                        r.copy_(_full(p))
            loss_fn(ref(x).flatten(0, 1), x.flatten()).backward()
            loss_fn(model(mine).flatten(0, 1), mine.flatten()).backward()
            for (name, p), r in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(_full(p.grad), r.grad, msg=lambda m, n=name: f"{what} grad {n}: {m}")
            if recipe == "sgd":  # clipping that bites: the global norm over every rank's matrices
                norm = clip_grad_norm_(model.parameters(), 0.5)
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
                torch.testing.assert_close(norm, ref_norm)
                assert norm > 0.5, norm
            if recipe == "muon+adamw":
                with torch.no_grad():
                    for p, m in zip(model.parameters(), mirror.parameters()):
                        m.copy_(_full(p))
                        m.grad = _full(p.grad)
            with count_dist_calls() as seen:  # at torch.distributed: anyone's communication
                for o in opts:
                    o.step()
            comms += seen.calls + seen.ops
            for o in (*opts, *ref_opts, *mirror_opts):
                if o not in opts:
                    o.step()
                o.zero_grad()
            against, tol = (mirror, {"atol": 0, "rtol": 0}) if recipe == "muon+adamw" else (ref, {})
            for (name, p), r in zip(model.named_parameters(), against.parameters()):
                torch.testing.assert_close(_full(p), r.detach(), **tol, msg=lambda m, n=name: f"{what} {n}: {m}")
        out["comms"][recipe] = dict(comms)
    return out


# W = 3 in make test, W = 2 in make test-slow ([Note: two tiers], tests/conftest.py)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_whole_parameters_match_a_single_process(world):
    for out in run_distributed(parity_worker, world, timeout=300):
        assert all(c == {} for c in out["comms"].values()), f"communication inside optimizer.step(): {out}"
        owned, largest = out["placement"]["owned"], out["placement"]["largest"]
        assert all(owned), f"a rank owns nothing: {owned}"
        assert max(owned) - min(owned) <= largest, f"owners not balanced by size: {owned}"


def save_worker(rank: int, world: int, path: str) -> dict:
    """Two steps of Muon + AdamW at W, then the model and optimizer saved with torch.distributed.checkpoint;
    returns every parameter and optimizer state tensor whole."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    model = _sharded()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # every parameter: the same groups on every rank
    for step in range(2):
        x = torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(step * world + rank))
        torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        opt.step()
        opt.zero_grad()
    dcp.save({"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}, checkpoint_id=path)
    return _whole_state(model, opt)


def _whole_state(model, opt) -> dict:
    params = {n: _full(p) for n, p in model.named_parameters()}
    state = {}
    for n, p in model.named_parameters():  # every rank walks every parameter: _full is collective
        for key in ("exp_avg", "exp_avg_sq"):
            state[f"{n}.{key}"] = _full(p, opt.state.get(p, {}).get(key))
    return {"params": params, "state": state}


def load_worker(rank: int, world: int, path: str) -> dict:  # noqa: ARG001 - run_distributed's signature
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    torch.manual_seed(1)  # other initial values: everything must come from the file
    model = _sharded()
    with torch.no_grad():
        for p in model.parameters():
            p.to_local().normal_()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x = torch.randint(0, 37, (PER_RANK, 8))  # a step makes the optimizer state the load fills
    torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad()
    state = {"model": get_model_state_dict(model), "optim": get_optimizer_state_dict(model, opt)}
    dcp.load(state, checkpoint_id=path)
    set_model_state_dict(model, state["model"])
    set_optimizer_state_dict(model, opt, state["optim"])
    return _whole_state(model, opt)


def test_dcp_saves_at_4_and_loads_at_2(tmp_path):
    path = str(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 4, path, timeout=180)[0]
    for loaded in run_distributed(load_worker, 2, path, timeout=180):
        for kind in ("params", "state"):
            assert loaded[kind].keys() == saved[kind].keys()
            for name, t in saved[kind].items():
                assert torch.equal(loaded[kind][name], t), (kind, name)


def errors_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - run_distributed's signature
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard

    def call(**kwargs):
        return lambda: flatshard.fully_shard(TinyGPT(), **kwargs)

    return {
        "flat": raised(call(shard_boundaries="flat")),
        "bogus": raised(call(shard_boundaries="whole")),
        "2d": raised(call(shard_boundaries="params", mesh=init_device_mesh("cpu", (1, world)))),
        "placement_fn": raised(call(shard_boundaries="params", shard_placement_fn=lambda p: None)),
        "int_reshard": raised(call(shard_boundaries="params", reshard_after_forward=1 if world == 1 else 2)),
        "chunks": raised(lambda: _check_placement(flatshard.fully_shard(TinyGPT()), 0, world)),
    }


def test_what_is_not_built_is_refused_on_every_rank():
    outs = run_distributed(errors_worker, 4, timeout=120)
    assert all(o == outs[0] for o in outs), outs
    out = outs[0]
    assert out["flat"].startswith("NotBuiltError/") and "shard_boundaries='flat') is not built" in out["flat"], out
    assert out["bogus"].startswith("ValueError/") and "shard_boundaries='whole'): pass \"params\"" in out["bogus"], out
    assert out["2d"].startswith("NotBuiltError/") and '"params") is built on a 1-D mesh' in out["2d"], out
    assert out["placement_fn"].startswith("NotBuiltError/") and "with shard_placement_fn" in out["placement_fn"], out
    assert "not built with an int reshard_after_forward" in out["int_reshard"], out
    assert out["chunks"].startswith("AssertionError"), out  # the placement check fails on FSDP2's chunks
