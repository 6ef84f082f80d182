"""Parity with a single-process reference on the global batch, every step, at fp32 default tolerances.

One spawn per world size runs every (model, strategy, optimizer) case: the forward output on the
local micro-batch, every gradient after backward and every parameter after the step must equal the
unwrapped model's (PyTorch's default fp32 tolerances), for 10 steps. World size 3 exercises padding
(odd element counts everywhere)."""

from __future__ import annotations

import functools
import itertools

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist import run_distributed
from tests.models import Block, FrozenTrunk, OddMLP, TinyGPT
from tests.util import assert_grads_match, assert_params_match

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
MODELS = ("odd_mlp", "gpt_tie_in_root", "gpt_tie_across_units", "frozen_nested_manual")
OPTIMIZERS = ("sgd_momentum", "adamw")
STEPS = 10
PER_RANK = 3  # odd micro-batch


def build(kind: str, strategy: str, **fsdp_kwargs):
    """(reference, wrapped, batch(step, global_size) -> (inputs, targets), loss_fn).

    ``fsdp_kwargs`` go to every FullyShardedDataParallel call (groups, sharding_factor, ...)."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    strat = ShardingStrategy[strategy]
    FSDP = functools.partial(FSDP, **fsdp_kwargs)
    torch.manual_seed(0)
    make = {"odd_mlp": OddMLP, "frozen_nested_manual": FrozenTrunk}.get(kind, TinyGPT)
    ref = make()
    torch.manual_seed(0)
    model = make()
    if kind == "odd_mlp":
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is model.fc1)
        wrapped = FSDP(model, sharding_strategy=strat, auto_wrap_policy=policy)
    elif kind == "gpt_tie_in_root":
        wrapped = FSDP(model, sharding_strategy=strat, auto_wrap_policy=ModuleWrapPolicy({Block}))
    elif kind == "gpt_tie_across_units":
        # the embedding and the head become units of their own: their shared weight goes to the root
        wrapped = FSDP(
            model, sharding_strategy=strat, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding, nn.Linear})
        )
    else:  # manual nested wrapping: a frozen unit, and a unit whose module runs twice per forward
        model.trunk = FSDP(model.trunk, sharding_strategy=strat)
        model.shared = FSDP(model.shared, sharding_strategy=strat)
        wrapped = FSDP(model, sharding_strategy=strat)

    def batch(step: int, n: int):
        g = torch.Generator().manual_seed(1000 + step)
        if make is TinyGPT:
            return torch.randint(0, 37, (n, 8), generator=g), torch.randint(0, 37, (n, 8), generator=g)
        d_in, d_out = (7, 3) if make is OddMLP else (5, 2)
        return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)

    def loss_fn(out, target):
        if make is TinyGPT:
            return F.cross_entropy(out.flatten(0, 1), target.flatten())
        return F.mse_loss(out, target)

    return ref, wrapped, batch, loss_fn


def make_optimizer(kind: str, model: nn.Module):
    from flatshard import param_groups

    if kind == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2)


def run_case(rank: int, world: int, kind: str, strategy: str, opt_kind: str, **fsdp_kwargs) -> nn.Module:
    """Train ``kind`` for STEPS steps beside its reference, checking every step; returns the wrapped model."""
    ref, model, batch, loss_fn = build(kind, strategy, **fsdp_kwargs)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    for step in range(STEPS):
        what = f"{kind}/{strategy}/{opt_kind} {fsdp_kwargs} W={world} step {step}"
        x, y = batch(step, world * PER_RANK)
        ref_out = ref(x)
        loss_fn(ref_out, y).backward()
        out = model(x[local])
        torch.testing.assert_close(out, ref_out[local], msg=lambda m: f"{what}: forward output: {m}")
        loss_fn(out, y[local]).backward()
        assert_grads_match(model, ref, what)
        ref_opt.step()
        opt.step()
        assert_params_match(model, ref, what)
        ref_opt.zero_grad()
        opt.zero_grad()
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach(), frozen_before[n]), f"{kind}: frozen {n} changed"
            assert p not in opt.state, f"{kind}: frozen {n} has optimizer state"
    for p in opt.state:
        local_numel = p.numel()
        for v in opt.state[p].values():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.numel() == local_numel, "optimizer state must be shard-sized"
    return model


def parity_worker(rank: int, world: int) -> int:
    cases = list(itertools.product(MODELS, STRATEGIES, OPTIMIZERS))
    for kind, strategy, opt_kind in cases:
        run_case(rank, world, kind, strategy, opt_kind)
    return len(cases)


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_parity_all_strategies(world):
    counts = run_distributed(parity_worker, world, timeout=400)
    assert counts == [len(MODELS) * len(STRATEGIES) * len(OPTIMIZERS)] * world
