"""State dicts, one spawn at W = 3 (padding everywhere): FULL round trip through a plain nn.Module,
exactly (tied weights across units, a frozen nested unit, buffers); the FULL state equal to an
unwrapped reference trained alongside, optimizer state included; SHARDED (ShardedTensors) across strategies; LOCAL
only into its own layout; key, shape and layout errors raised alike on every rank."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from tests.helpers.cases import (
    assert_state_equal,
    build,
    full_osd,
    full_sd,
    make_optimizer,
    train_rank_batches,
)
from tests.helpers.dist import run_distributed

MODELS = ("gpt_tie_across_units", "frozen_nested_manual")


def ref_osd_by_name(ref, ref_opt):
    """The reference optimizer's state dict keyed by parameter names."""
    names = {id(p): n for n, p in ref.named_parameters()}
    params = [p for g in ref_opt.param_groups for p in g["params"]]
    packed = ref_opt.state_dict()
    return {names[id(params[i])]: s for i, s in packed["state"].items()}


def full_roundtrip(rank, world, kind):
    from flatshard import FullOptimStateDictConfig, FullStateDictConfig, StateDictType
    from flatshard import FullyShardedDataParallel as FSDP

    ref, model, batch, loss_fn = build(kind, "FULL_SHARD")
    ref_opt, opt = make_optimizer("adamw", ref), make_optimizer("adamw", model)
    train_rank_batches(model, opt, batch, loss_fn, rank, world, 3, ref=ref, ref_opt=ref_opt)
    sd = model.state_dict()  # FULL is the default
    assert list(sd) == list(ref.state_dict()), f"{kind}: FULL keys must be the unwrapped model's"
    # the reference trained alongside: equal to PyTorch's default fp32 tolerances
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, msg=lambda m: f"{kind}: FULL {k}: {m}")
    osd = full_osd(model, opt)
    for name, ref_state in ref_osd_by_name(ref, ref_opt).items():
        for key, v in ref_state.items():
            torch.testing.assert_close(osd["state"][name][key], v, msg=lambda m: f"{kind}: optim {name}.{key}: {m}")
    # exactly through a plain module, strict
    plain = build(kind, "FULL_SHARD")[0]
    plain.load_state_dict(sd, strict=True)
    assert_state_equal(plain.state_dict(), sd, f"{kind}: plain module")
    torch.manual_seed(rank + 7)  # a different init: the load must overwrite everything
    _, other, _, _ = build(kind, "FULL_SHARD")
    other.load_state_dict(plain.state_dict())
    assert_state_equal(other.state_dict(), sd, f"{kind}: back into flatshard")
    with FSDP.state_dict_type(
        model, StateDictType.FULL_STATE_DICT, FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    ):
        only0 = model.state_dict()
    assert (only0 == {}) == (rank != 0), "rank0_only: a dict on rank 0, an empty one elsewhere"
    if rank == 0:
        assert_state_equal(only0, sd, f"{kind}: rank0_only")
    # the optimizer: FULL round trip, then more steps equal the uninterrupted ones bitwise
    other_opt = make_optimizer("adamw", other)
    with FSDP.state_dict_type(other, StateDictType.FULL_STATE_DICT):
        other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, osd))
    assert_state_equal(full_osd(other, other_opt), osd, f"{kind}: optimizer FULL round trip")
    config = FullOptimStateDictConfig(rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None, config):
        only0 = FSDP.optim_state_dict(model, opt)
        assert (only0 == {}) == (rank != 0), "rank0_only: an optimizer state dict on rank 0 only"
        again = make_optimizer("adamw", model)
        again.load_state_dict(FSDP.optim_state_dict_to_load(model, again, only0 if rank == 0 else None))
    assert_state_equal(full_osd(model, again), osd, f"{kind}: optimizer from rank 0 only")
    a = train_rank_batches(model, opt, batch, loss_fn, rank, world, 2, start=3)
    b = train_rank_batches(other, other_opt, batch, loss_fn, rank, world, 2, start=3)
    assert a == b, f"{kind}: losses after a FULL round trip differ: {a} vs {b}"
    assert_state_equal(full_sd(other), full_sd(model), f"{kind}: after training on")


def buffers_roundtrip(rank, world):
    """BatchNorm running statistics and a counter buffer, FULL and SHARDED, through a plain module."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType
    from flatshard.wrap import lambda_auto_wrap_policy
    from tests.helpers.models import WithBuffers

    def wrapped(seed):
        torch.manual_seed(seed)
        m = WithBuffers()
        return FSDP(m, auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda mod: mod is m.fc))

    model = wrapped(0)
    model(torch.randn(5, 6, generator=torch.Generator().manual_seed(3))).sum().backward()
    sd = model.state_dict()
    assert list(sd) == list(WithBuffers().state_dict()) and int(sd["calls"]) == 1, list(sd)
    plain = WithBuffers()
    plain.load_state_dict(sd)
    assert_state_equal(plain.state_dict(), sd, "buffers: plain module")
    for kind in (StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT):
        with FSDP.state_dict_type(model, kind):
            saved = model.state_dict()
        other = wrapped(rank + 5)
        with FSDP.state_dict_type(other, kind):
            other.load_state_dict(saved)
        assert_state_equal(other.state_dict(), sd, f"buffers: {kind.name}")


def sharded_across_strategies(rank, world):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    _, model, batch, loss_fn = build("gpt_tie_in_root", "FULL_SHARD")
    opt = make_optimizer("sgd_momentum", model)
    train_rank_batches(model, opt, batch, loss_fn, rank, world, 2)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    want, want_o = full_sd(model), full_osd(model, opt)
    # SHARDED values are ShardedTensors of the full shape (tests/test_dcp.py takes them through DCP)
    assert all(
        type(sd[k]).__name__ == "ShardedTensor" and tuple(sd[k].metadata().size) == want[k].shape
        for k in sd
        if k in dict(model.named_parameters())
    ), "SHARDED parameters are ShardedTensors"
    for strategy in ("NO_SHARD", "SHARD_GRAD_OP"):
        torch.manual_seed(11)
        _, other, _, _ = build("gpt_tie_in_root", strategy)
        other_opt = make_optimizer("sgd_momentum", other)
        with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
            other.load_state_dict(sd)
            other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, osd))
        assert_state_equal(full_sd(other), want, f"SHARDED into {strategy}")
        assert_state_equal(full_osd(other, other_opt), want_o, f"SHARDED optimizer into {strategy}")
    return model, opt


def local_and_errors(rank, world, model, opt) -> list[str]:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        sd, osd = model.state_dict(), FSDP.optim_state_dict(model, opt)
    _, same, _, _ = build("gpt_tie_in_root", "FULL_SHARD")
    same_opt = make_optimizer("sgd_momentum", same)
    with FSDP.state_dict_type(same, StateDictType.LOCAL_STATE_DICT):
        same.load_state_dict(sd)
        same_opt.load_state_dict(FSDP.optim_state_dict_to_load(same, same_opt, osd))
    assert_state_equal(full_sd(same), full_sd(model), "LOCAL round trip")
    assert_state_equal(full_osd(same, same_opt), full_osd(model, opt), "LOCAL optimizer round trip")
    messages = []
    _, other, _, _ = build("gpt_tie_in_root", "NO_SHARD")
    with FSDP.state_dict_type(other, StateDictType.LOCAL_STATE_DICT):
        messages.append(_error(lambda: other.load_state_dict(sd)))
    assert "loads only into the same layout" in messages[-1], messages[-1]
    broken = full_sd(model)
    if rank == 1:  # one rank's dict lacks a key: every rank raises, none hangs
        del broken["blocks.0.fc.weight"]
    messages.append(_error(lambda: other.load_state_dict(broken)))
    assert '"blocks.0.fc.weight"' in messages[-1] and "[rank 1 of 3]" in messages[-1], messages[-1]
    bad_shape = dict(full_sd(model))
    bad_shape["ln_f.weight"] = torch.zeros(5)
    messages.append(_error(lambda: other.load_state_dict(bad_shape)))
    assert "size mismatch for ln_f.weight" in messages[-1], messages[-1]
    return messages


def _error(fn) -> str:
    try:
        fn()
    except RuntimeError as exc:
        return str(exc)
    raise AssertionError("expected an error")


def through_plain_parent(rank, world) -> str:
    """Only part of the model wrapped (with units nested inside): the plain parent's state_dict and
    load_state_dict (strict and not) reach flatshard ([Note: loading through a plain parent])."""
    from torch import nn

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy
    from tests.helpers.models import Block, TinyGPT

    torch.manual_seed(0)
    ref = nn.ModuleDict({"trunk": TinyGPT(), "head": nn.Linear(37, 2)})
    torch.manual_seed(0)
    model = nn.ModuleDict({"trunk": TinyGPT(), "head": nn.Linear(37, 2)})
    model["trunk"] = FSDP(model["trunk"], auto_wrap_policy=ModuleWrapPolicy({Block}))
    assert_state_equal(model.state_dict(), ref.state_dict(), "state_dict through a plain parent")
    new = {k: v + 0.5 for k, v in ref.state_dict().items()}
    assert not model.load_state_dict(new).missing_keys
    ref.load_state_dict(new)
    assert_state_equal(model.state_dict(), ref.state_dict(), "load_state_dict through a plain parent")
    partial = {k: v for k, v in new.items() if k != "trunk.ln_f.bias"}
    assert model.load_state_dict(partial, strict=False).missing_keys == ["trunk.ln_f.bias"]
    return _error(lambda: model.load_state_dict(partial))


def worker(rank: int, world: int) -> list[str]:
    for kind in MODELS:
        full_roundtrip(rank, world, kind)
    buffers_roundtrip(rank, world)
    model, opt = sharded_across_strategies(rank, world)
    messages = local_and_errors(rank, world, model, opt)
    messages.append(through_plain_parent(rank, world))
    assert 'Missing key(s) in state_dict: "trunk.ln_f.bias"' in messages[-1], messages[-1]
    dist.barrier()
    return messages


def test_state_dicts_w3():
    messages = run_distributed(worker, 3, timeout=300)
    assert messages[0] == messages[1] == messages[2], "every rank raises the same error"
