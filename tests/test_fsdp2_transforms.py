"""``fully_shard`` models under torch.func's transforms, as PyTorch's FSDP2 runs them: forward-mode AD
(``torch.func.jvp``) through a model whose units keep (``reshard_after_forward=False``) or free their
parameters after forward gives FSDP2's output and tangent, to the bit, at W = 2; a training step after it
still matches ([Note: outside function transforms], runtime/unit.py)."""

from __future__ import annotations

import copy

import torch
from torch import nn

from tests.helpers.dist import raised, run_distributed


def worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    out: dict = {}
    for reshard in (False, True):
        torch.manual_seed(0)
        base = nn.Sequential(nn.Linear(8, 9), nn.Tanh(), nn.Linear(9, 5))  # odd rows: the chunks pad
        pair = []
        for shard in (torch_fsdp.fully_shard, flatshard.fully_shard):
            model = copy.deepcopy(base)
            for m in (model[0], model[2]):
                shard(m, reshard_after_forward=reshard)
            shard(model, reshard_after_forward=reshard)
            pair.append(model)
        gen = torch.Generator().manual_seed(rank)
        x, v = torch.randn(3, 8, generator=gen), torch.randn(3, 8, generator=gen)
        results = []
        for model in pair:
            got: list = []
            error = raised(lambda m=model: got.extend(torch.func.jvp(m, (x,), (v,))))
            model(x).square().sum().backward()  # and a backward after it, reduced as usual
            grads = [p.grad.to_local().clone() for p in model.parameters()]
            results.append((error, got, grads))
        (err_a, a, ga), (err_b, b, gb) = results
        out[reshard] = {
            "errors": (err_a, err_b),
            "bitwise": len(a) == len(b) == 2 and all(map(torch.equal, a, b)),
            "grads bitwise": all(map(torch.equal, ga, gb)),
        }
    return out


def test_jvp_through_fully_shard_matches_fsdp2():
    for out in run_distributed(worker, 2):
        for reshard in (False, True):
            assert out[reshard] == {"errors": ("no error", "no error"), "bitwise": True, "grads bitwise": True}, out
