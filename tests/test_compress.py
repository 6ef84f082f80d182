"""compress_inter_node="int8" ([Note: inter-node compression], runtime/comm/int8.py).

The codec on its own (error within half a step of each block's scale, the message size, non-finite
blocks); then four ranks as two "nodes" of two (``ranks_per_node=2``): HYBRID_SHARD's replicate
all-reduce across the nodes compressed, within the quantisation error of the exact sum, the same bits
on every replica, and the bytes the recorder counts equal to the int8 formula; FULL_SHARD's
all-gathers and reduce-scatters exact to the rank on the same node and int8 to the two on the other;
and the keyword refused, on every rank, wherever it cannot apply."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from flatshard.runtime.comm import int8
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

STEPS = 3


# ---- the codec ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("numel", [0, 1, 255, 256, 257, 1000])
def test_codec_error_is_within_half_a_step(numel):
    x = (
        torch.randn(numel, generator=torch.Generator().manual_seed(numel))
        * torch.logspace(-3, 2, max(numel, 1))[:numel]
    )
    packed = int8.quantize(x)
    assert packed.dtype == torch.uint8 and packed.numel() == int8.packed_nbytes(numel)
    assert int8.packed_nbytes(numel) == 4 * -(-numel // int8.BLOCK) + numel
    back = int8.dequantize(packed, numel)
    assert back.dtype == torch.float32 and back.shape == x.shape
    pad = -numel % int8.BLOCK
    blocks = F.pad(x, (0, pad)).view(-1, int8.BLOCK) if numel else x.view(0, int8.BLOCK)
    step = (blocks.abs().amax(dim=1) / 127).repeat_interleave(int8.BLOCK)[:numel]
    err = (back - x).abs()
    assert torch.all(err <= step / 2 * (1 + 1e-5) + 1e-30), (err - step / 2).max()
    if numel > 1:
        assert err.max() > 0, "int8 rounds: some element must move"
        # the largest element of every block is exact to fp32 rounding (it is ±127 steps)
        assert torch.allclose(back[x.abs().argmax()], x[x.abs().argmax()], rtol=1e-6)


def test_codec_zeros_and_non_finite_blocks():
    zeros = torch.zeros(300)
    assert torch.equal(int8.dequantize(int8.quantize(zeros), 300), zeros)
    x = torch.ones(600)
    x[10], x[300] = float("inf"), float("nan")
    back = int8.dequantize(int8.quantize(x), 600)
    assert back[:256].isnan().all() and back[256:512].isnan().all(), "a block with inf or NaN reads as NaN"
    assert torch.equal(back[512:], x[512:]), "the other blocks are untouched"
    half = torch.full((5,), 0.5, dtype=torch.bfloat16)
    assert torch.equal(int8.dequantize(int8.quantize(half), 5), half.float())


# ---- four ranks, two nodes ----------------------------------------------------------------------------
def _model(strategy: str, **kw):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    return FSDP(
        TinyGPT(layers=2, dim=40),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        ranks_per_node=2,
        **kw,
    )


def _batch(step: int, rank: int):
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randint(0, 37, (3, 8), generator=g)


def _backward(model, x) -> None:
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()


def hybrid_worker(rank: int, world: int) -> dict:
    """Each step: every replicate all-reduce's input captured, the exact sum of the two replicas'
    inputs (divided by W) beside the compressed gradient, and the bound from both inputs' block scales."""
    from flatshard import units
    from flatshard.runtime.comm import collectives

    exact = _model("HYBRID_SHARD", sharding_factor=2)
    packed = _model("HYBRID_SHARD", sharding_factor=2, compress_inter_node="int8")
    opt = torch.optim.AdamW(packed.parameters(), lr=1e-2)
    inputs: list[tuple[int, torch.Tensor]] = []  # (where it lands, its value before the sum)
    real = collectives.all_reduce

    def capture(tensor, group, *args, **kwargs):
        inputs.append((tensor.data_ptr(), tensor.detach().clone()))
        return real(tensor, group, *args, **kwargs)

    worst, first_vs_exact, wire, expected_wire = 0.0, None, [], []
    for step in range(STEPS):
        x = _batch(step, rank)
        inputs.clear()
        with mock.patch.object(collectives, "all_reduce", capture), packed.record_comms() as rec:
            _backward(packed, x)
        wire.append(rec.wire_bytes(kind="all_reduce", group="replicate"))
        expected_wire.append(sum(int8.packed_nbytes(u.shard_numel) for u in units(packed)))  # R - 1 = 1
        # the replica with the same shard rank (rank ± 2) issued the same all-reduces in the same order
        partner = [torch.empty_like(t) for _, t in inputs]
        for (_, mine), theirs in zip(inputs, partner):
            ops = [dist.P2POp(dist.isend, mine, (rank + 2) % 4), dist.P2POp(dist.irecv, theirs, (rank + 2) % 4)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        sums = {ptr: (a, b) for (ptr, a), b in zip(inputs, partner)}  # the reduced shard is the grad shard
        grads = _grad_shards(packed)
        assert sorted(sums) == sorted(g.data_ptr() for g in grads), "one all-reduce per unit, into its grad shard"
        for got in grads:
            a, b = sums[got.data_ptr()]
            want = (a + b) / world
            bound = (_half_steps(a) + _half_steps(b)) / world * 1.001 + 1e-7
            assert torch.all((got - want).abs() <= bound), ("beyond the quantisation error", step)
            worst = max(worst, ((got - want).abs() / bound).max().item())
        if step == 0:  # the same weights as the exact model's: its gradient is the same sum, unrounded
            _backward(exact, x)
            first_vs_exact = [(g - e).abs().max().item() for g, e in zip(grads, _grad_shards(exact))]
        opt.step()
        opt.zero_grad()
    flat = torch.cat([s.detach() for s in packed.parameters()])
    return {"worst": worst, "vs_exact": first_vs_exact, "wire": wire, "expected": expected_wire, "flat": flat}


def _grad_shards(model) -> list[torch.Tensor]:
    from flatshard import testing

    return [u.flat_group.grad_shard for u in testing.engine_units(model)]


def _half_steps(t: torch.Tensor) -> torch.Tensor:
    """Half of each element's quantisation step (its block's max |value| / 127)."""
    n = t.numel()
    blocks = F.pad(t.float(), (0, -n % int8.BLOCK)).view(-1, int8.BLOCK)
    return (blocks.abs().amax(dim=1) / 254).repeat_interleave(int8.BLOCK)[:n]


def test_hybrid_replicate_all_reduce_in_int8():
    out = run_distributed(hybrid_worker, 4, timeout=180)
    for r in out:
        assert r["wire"] == r["expected"], (r["wire"], r["expected"])
        assert 0 < r["worst"] <= 1, r["worst"]  # rounded (not exact), and never beyond the bound
        assert max(r["vs_exact"]) > 0
    # replicas sum the same dequantised values in the same order: rank r and r + 2 hold the same shard
    for a, b in ((0, 2), (1, 3)):
        assert torch.equal(out[a]["flat"], out[b]["flat"]), "the replicas' parameters drifted apart"


def full_shard_worker(rank: int, world: int) -> dict:
    from flatshard import units

    packed = _model("FULL_SHARD", compress_inter_node="int8")
    exact = _model("FULL_SHARD")
    x = _batch(0, rank)
    with packed.record_comms() as rec:
        out = packed(x)
        F.cross_entropy(out.flatten(0, 1), x.flatten()).backward()
    ref = exact(x)
    F.cross_entropy(ref.flatten(0, 1), x.flatten()).backward()
    shards = [u.shard_numel for u in units(packed)]
    grads = [
        (g - e).abs().max().item() / e.abs().max().item() for g, e in zip(_grad_shards(packed), _grad_shards(exact))
    ]
    return {
        "gather": rec.wire_bytes(kind="all_gather"),
        "gathers": rec.count(kind="all_gather"),
        "reduce": rec.wire_bytes(kind="reduce_scatter"),
        "shards": shards,
        "out": ((out - ref).abs().max() / ref.abs().max()).item(),
        "grads": grads,
    }


def test_full_shard_gathers_and_reductions_across_nodes_in_int8():
    """W = 4, nodes {0, 1} and {2, 3}: each message to the same node's other rank is the shard in fp32,
    each of the two to the other node is int8 with its scales."""
    for r in run_distributed(full_shard_worker, 4, timeout=120):
        per_unit = [4 * s + 2 * int8.packed_nbytes(s) for s in r["shards"]]
        root, others = per_unit[0], per_unit[1:]
        # the root gathers once (it stays gathered); every other unit in forward and again in backward
        assert r["gathers"] == 1 + 2 * len(others)
        assert r["gather"] == root + 2 * sum(others), (r["gather"], per_unit)
        assert r["reduce"] == sum(per_unit), (r["reduce"], per_unit)
        assert 0 < r["out"] < 0.02, r["out"]  # the forward used rounded weights of the other node
        # the gradient of the rounded weights (logits up to ~40 in this tiny model amplify it), reduced in int8
        assert max(r["grads"]) < 0.15, r["grads"]


def refusal_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import NotBuiltError, ShardingStrategy

    out = {}
    cases = {
        "mode": dict(compress_inter_node="fp8", ranks_per_node=2),
        "one node": dict(compress_inter_node="int8"),  # no LOCAL_WORLD_SIZE, no ranks_per_node: one node
        "nodes inside groups": dict(compress_inter_node="int8", ranks_per_node=4),
        "uneven nodes": dict(ranks_per_node=3),
        "in flight": dict(inter_node_in_flight="yes"),
    }
    for name, kw in cases.items():
        try:
            FSDP(TinyGPT(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, sharding_factor=2, **kw)
            out[name] = "accepted"
        except (ValueError, TypeError, NotBuiltError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    with mock.patch.object(dist, "get_backend", return_value="nccl"):
        try:
            FSDP(TinyGPT(), sharding_factor=2, compress_inter_node="int8", ranks_per_node=2)
            out["nccl"] = "accepted"
        except NotBuiltError as e:
            out["nccl"] = f"NotBuiltError: {e}"
    return out


def test_compression_is_refused_where_it_cannot_apply():
    for out in run_distributed(refusal_worker, 4, timeout=60):
        assert out["mode"].startswith("ValueError") and "('int8',)" in out["mode"], out["mode"]
        assert out["one node"].startswith("ValueError") and "ranks_per_node" in out["one node"], out["one node"]
        assert "has none" in out["nodes inside groups"] or "have none" in out["nodes inside groups"]
        assert out["uneven nodes"].startswith("ValueError") and "divide" in out["uneven nodes"]
        assert out["in flight"].startswith("TypeError"), out["in flight"]
        assert out["nccl"].startswith("NotBuiltError") and "gloo" in out["nccl"], out["nccl"]
