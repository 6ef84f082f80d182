"""clip_grad_norm_ and no_sync at parity with the unwrapped model."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers.cases import PER_RANK, build, make_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.util import assert_grads_match, assert_params_match


def clip_worker(rank: int, world: int) -> int:
    checked = 0
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for norm_type in (2.0, 1.0, math.inf):
            ref, model, batch, loss_fn = build("gpt_tie_in_root", strategy)
            ref_opt, opt = make_optimizer("sgd_momentum", ref), make_optimizer("sgd_momentum", model)
            local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
            for step in range(3):
                x, y = batch(step, world * PER_RANK)
                loss_fn(ref(x), y).backward()
                loss_fn(model(x[local]), y[local]).backward()
                ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, norm_type)
                with model.record_comms() as rec:
                    norm = model.clip_grad_norm_(0.05, norm_type)
                what = f"{strategy} norm_type={norm_type} step {step}"
                torch.testing.assert_close(norm, ref_norm, msg=lambda m: f"{what}: {m}")
                assert float(ref_norm) > 0.05, "the test must actually clip"
                sharded = strategy != "NO_SHARD" and world > 1
                assert rec.count("all_reduce", "optimizer") == (1 if sharded else 0), rec.summary()
                assert rec.count() == rec.count("all_reduce"), "clip_grad_norm_ issues one all-reduce, nothing else"
                assert_grads_match(model, ref, what)
                ref_opt.step(), opt.step()
                ref_opt.zero_grad(), opt.zero_grad()
                checked += 1
            assert_params_match(model, ref, f"{strategy} after clipped steps")
    return checked


def test_clip_grad_norm_parity():
    for world in (2, 3):
        assert run_distributed(clip_worker, world, timeout=300) == [27] * world


def no_sync_worker(rank: int, world: int) -> int:
    """4 micro-batches (3 under no_sync, the last one synced) equal one batch of 4× the size."""
    micro = 4
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        for opt_kind in ("sgd_momentum", "adamw"):
            ref, model, batch, loss_fn = build("gpt_tie_across_units", strategy)
            ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
            for step in range(3):
                x, y = batch(step, world * PER_RANK * micro)
                loss_fn(ref(x), y).backward()
                mine = torch.arange(x.shape[0]).view(world, micro, PER_RANK)[rank]
                with model.record_comms() as rec:
                    with model.no_sync():
                        for k in range(micro - 1):
                            (loss_fn(model(x[mine[k]]), y[mine[k]]) / micro).backward()
                    assert rec.count(phase="backward", kind="reduce_scatter") == 0
                    assert rec.count(phase="backward", kind="all_reduce") == 0
                    # no synchronised gradient yet: each .grad is the open window's mark, a zero that
                    # allocates nothing ([Note: an open accumulation window])
                    for p in model.parameters():
                        assert p.grad is not None and not p.grad.any(), "a zero .grad until the synced backward"
                        assert p.grad.untyped_storage().nbytes() <= p.grad.element_size(), "the mark allocates"
                    (loss_fn(model(x[mine[-1]]), y[mine[-1]]) / micro).backward()
                what = f"no_sync {strategy}/{opt_kind} step {step}"
                assert_grads_match(model, ref, what)
                ref_opt.step(), opt.step()
                assert_params_match(model, ref, what)
                ref_opt.zero_grad(), opt.zero_grad()
    return 1


# W = 3 in make test, W = 2 in make test-slow ([Note: two tiers], tests/conftest.py)
@pytest.mark.parametrize("world", [pytest.param(2, marks=pytest.mark.slow), 3])
def test_no_sync_gradient_accumulation_parity(world):
    run_distributed(no_sync_worker, world, timeout=300)


def no_sync_exception_worker(rank: int, world: int) -> bool:
    """An exception inside no_sync() leaves gradient synchronisation on."""
    _, model, batch, loss_fn = build("odd_mlp", "FULL_SHARD")
    try:
        with model.no_sync():
            raise KeyError("user error inside the block")
    except KeyError:
        pass
    x, y = batch(0, PER_RANK)
    with model.record_comms() as rec:
        loss_fn(model(x), y).backward()
    return rec.count("reduce_scatter") > 0 or world == 1


def test_no_sync_is_exception_safe():
    assert all(run_distributed(no_sync_exception_worker, 2, timeout=120))
