"""``fully_shard(..., shard_optimizer_across_replicas=True)`` on HSDP's 2x2 mesh (W = 4, F = 2, R = 2)
([Note: optimizer state across replicas on fully_shard], fsdp2/frontend.py; [Note: pieces in the chunked
layout], runtime/across_replicas.py), beside plain ``fully_shard`` HSDP on the same TinyGPT (37 rows of the
tied embedding: chunks of 19 over F, of 10 over W, padded), same batches:

* every step, SGD-momentum and AdamW: the loss, every parameter (``full_tensor()``) bitwise equal to plain
  HSDP's (sums of two numbers round alike, so the order of the reductions does not matter at 2x2);
  ``torch.nn.utils.clip_grad_norm_``'s norm within fp32 tolerance (summed over other pieces);
* the parameters are DTensors ``Shard(0)`` on the mesh flattened (4 ranks), holding 1/W of each;
  the optimizer state per rank is 1/W of the elements, where plain HSDP's is 1/F;
* DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict`` (full) equal plain HSDP's bitwise;
* wire bytes per phase against the formula: the shard group's traffic is unchanged in kind; across the
  replicas the all-reduce of S = R·S_w elements becomes a reduce-scatter to S_w in backward and an
  all-gather of the S_w pieces in the next forward, (R-1)·S_w elements each;
* refusals, alike on every rank.
"""

from __future__ import annotations

import copy

import torch

from tests.helpers.cases import token_loss
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyGPT

B = 4  # bytes per fp32 element


def _models(**kw):
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    base = TinyGPT()
    plain, pieces = copy.deepcopy(base), copy.deepcopy(base)
    for model, extra in ((plain, {}), (pieces, {"shard_optimizer_across_replicas": True, **kw})):
        for block in model.blocks:
            flatshard.fully_shard(block, mesh=mesh, **extra)
        flatshard.fully_shard(model, mesh=mesh, **extra)
    return plain, pieces


def _optimizer(name: str, model):
    if name == "sgd":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _batch(rank: int, step: int) -> torch.Tensor:
    return torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(100 * step + rank))


def _state_elements(opt) -> int:
    return sum(t._local_tensor.numel() for s in opt.state.values() for t in s.values() if hasattr(t, "_local_tensor"))


def parity_worker(rank: int, world: int, opt_name: str) -> dict:  # noqa: ARG001 - the harness's signature
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
    from torch.distributed.tensor import DTensor, Shard

    plain, pieces = _models()
    opts = [_optimizer(opt_name, plain), _optimizer(opt_name, pieces)]
    for p in pieces.parameters():
        assert isinstance(p, DTensor) and p.device_mesh.ndim == 1 and p.device_mesh.size() == 4, p
        assert p.placements == (Shard(0),), p.placements
    for step in range(4):
        losses, norms = [], []
        for model, opt in zip((plain, pieces), opts):
            loss = token_loss(model, _batch(rank, step))
            loss.backward()
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1e9).full_tensor())  # coefficient 1
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        assert torch.equal(losses[0], losses[1]), (step, losses)
        torch.testing.assert_close(norms[1], norms[0])
        for (name, a), b in zip(plain.named_parameters(), pieces.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), (step, name)
    full = StateDictOptions(full_state_dict=True)
    msd = [get_model_state_dict(m, options=full) for m in (plain, pieces)]
    osd = [get_optimizer_state_dict(m, o, options=full) for m, o in zip((plain, pieces), opts)]
    assert msd[0].keys() == msd[1].keys() and all(torch.equal(msd[0][k], msd[1][k]) for k in msd[0])
    for key, state in osd[0]["state"].items():
        for what, t in state.items():
            assert torch.equal(t, osd[1]["state"][key][what]), (key, what)
    total = sum(p.numel() for p in plain.parameters())
    return {"state": [_state_elements(o) for o in opts], "total": total}


def _check_parity(opt_name: str) -> None:
    results = run_distributed(parity_worker, 4, opt_name, timeout=300)
    total = results[0]["total"]
    per_moment = 2 if opt_name == "adamw" else 1
    # every element's optimizer state once over the W ranks with pieces, once per replica (R = 2) without
    assert sum(r["state"][1] for r in results) == per_moment * total, results
    assert sum(r["state"][0] for r in results) == 2 * per_moment * total, results


def test_parity_with_plain_hsdp_sgd_momentum():
    _check_parity("sgd")


def test_parity_with_plain_hsdp_adamw():
    _check_parity("adamw")


def wire_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import flatshard

    out = {}
    for name, model in zip(("plain", "pieces"), _models()):
        opt = _optimizer("adamw", model)
        for step in range(3):  # count the third step: the pieces of the second step's update travel in it
            with model.record_comms() as rec:
                token_loss(model, _batch(rank, step)).backward()
                opt.step()
            opt.zero_grad()
        units = flatshard.units(model)
        totals = {k: (v["count"], v["wire_bytes"]) for k, v in rec.summary().items() if "order_check" not in k}
        out[name] = {
            "totals": totals,
            "shards": [u.shard_numel for u in units],
            "padded": [u.padded_numel for u in units],
        }
        out[name]["memory"] = model.memory_bytes(opt)
    return out


def test_wire_bytes_and_memory_against_the_formula():
    for rank, r in enumerate(run_distributed(wire_worker, 4, timeout=300)):
        plain, pieces = r["plain"], r["pieces"]
        units = len(pieces["shards"])
        piece = [s // 2 for s in pieces["shards"]]  # S_w: a flat shard is R = 2 pieces
        # across replicas: plain HSDP all-reduces S per unit (2·(R-1)/R·S elements sent); with pieces a
        # reduce-scatter of S to S_w in backward and an all-gather of the pieces in the next forward
        assert plain["totals"]["backward/all_reduce/replicate"] == (units, sum(s * B for s in plain["shards"])), rank
        assert pieces["totals"]["backward/reduce_scatter/replicate"] == (units, sum(p * B for p in piece)), rank
        assert pieces["totals"]["forward/all_gather/replicate"] == (units, sum(p * B for p in piece)), rank
        assert not any("all_reduce/replicate" in k for k in pieces["totals"]), pieces["totals"]
        # inside the shard group the same collectives, each (F-1)/F of the F·S gathered or reduced
        for key in ("forward/all_gather/shard", "backward/reduce_scatter/shard"):
            assert pieces["totals"][key] == (plain["totals"][key][0], sum(s * B for s in pieces["shards"])), key
        # memory: parameters T/F as plain HSDP; AdamW's two moments within the pieces (S_w, T/W), plain HSDP's
        # over the shard (S, T/F), beside one step counter per parameter (a tensor's storage each)
        m_on, m_off = pieces["memory"], plain["memory"]
        assert m_on["params"] == sum(pieces["shards"]) * B and m_off["params"] == sum(plain["shards"]) * B
        counters = 26 * 4 * B
        assert m_on["optimizer"] <= 2 * sum(piece) * B + counters, (m_on, piece)
        assert m_off["optimizer"] > 2 * (sum(plain["shards"]) - 2 * units * 12) * B, (m_off, plain["shards"])


def refused_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard
    from tests.helpers.dist import raised

    mesh = init_device_mesh("cpu", (2, 2))
    flat = init_device_mesh("cpu", (4,))
    out = {
        "1-D": raised(lambda: flatshard.fully_shard(TinyGPT(), mesh=flat, shard_optimizer_across_replicas=True)),
    }
    with torch.device("meta"):
        meta = TinyGPT()
    out["meta"] = raised(lambda: flatshard.fully_shard(meta, mesh=mesh, shard_optimizer_across_replicas=True))
    model = flatshard.fully_shard(TinyGPT(), mesh=mesh, shard_optimizer_across_replicas=True)
    out["all_reduce"] = raised(lambda: model.set_requires_all_reduce(False))
    return out


def test_combinations_not_built_are_refused_alike():
    results = run_distributed(refused_worker, 4, timeout=120)
    assert all(r == results[0] for r in results), results
    out = results[0]
    assert out["1-D"].startswith("ValueError") and "2-D (replicate, shard) mesh" in out["1-D"], out["1-D"]
    assert out["meta"].startswith("NotBuiltError") and "meta device" in out["meta"], out["meta"]
    assert out["all_reduce"].startswith("NotBuiltError") and "set_requires_gradient_sync" in out["all_reduce"]
