"""Parity with a single-process reference on the global batch, every step, at fp32 default tolerances.

One spawn per world size runs every (model, strategy, optimizer) case: the forward output on the
local micro-batch, every gradient after backward and every parameter after the step must equal the
unwrapped model's (PyTorch's default fp32 tolerances), for 5 steps (cases.STEPS). World size 3 exercises padding
(odd element counts everywhere)."""

from __future__ import annotations

import itertools

import pytest

from tests.helpers.cases import run_case, shared_references
from tests.helpers.dist import run_distributed

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD")
MODELS = ("odd_mlp", "gpt_tie_in_root", "gpt_tie_across_units", "frozen_nested_manual")
OPTIMIZERS = ("sgd_momentum", "adamw")


def parity_worker(rank: int, world: int) -> int:
    cases = list(itertools.product(MODELS, STRATEGIES, OPTIMIZERS))
    with shared_references():  # [Note: one reference per trajectory]
        for kind, strategy, opt_kind in cases:
            run_case(rank, world, kind, strategy, opt_kind)
    return len(cases)


# make test runs W = 3 (padding, more than two ranks); the other worlds in make test-slow and CI ([Note: two tiers],
# tests/conftest.py)
@pytest.mark.parametrize(
    "world",
    [
        pytest.param(1, marks=pytest.mark.slow),
        pytest.param(2, marks=pytest.mark.slow),
        3,
        pytest.param(4, marks=pytest.mark.slow),
    ],
)
def test_parity_all_strategies(world):
    counts = run_distributed(parity_worker, world, timeout=400)
    assert counts == [len(MODELS) * len(STRATEGIES) * len(OPTIMIZERS)] * world
