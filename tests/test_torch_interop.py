"""A script with some imports still on torch.distributed.fsdp runs: PyTorch's enums and configs are taken as
flatshard's. And PyTorch's get_state_dict family on the FSDP1 wrapper raises on every rank before anything
is written (it would save each rank's 1-D optimizer pieces as if they were whole tensors)."""

from __future__ import annotations

import os

import torch

from tests.helpers.cases import PER_RANK, build, make_optimizer
from tests.helpers.dist import run_distributed


def half_swapped_worker(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision, ShardingStrategy, StateDictType
    from flatshard.wrap import ModuleWrapPolicy
    from tests.helpers.models import Block, TinyGPT

    _, _, batch, loss_fn = build("gpt_tie_in_root", "FULL_SHARD")
    model = FSDP(
        TinyGPT(),
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        sharding_strategy=torch_fsdp.ShardingStrategy.SHARD_GRAD_OP,
        backward_prefetch=torch_fsdp.BackwardPrefetch.BACKWARD_POST,
        mixed_precision=torch_fsdp.MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        cpu_offload=torch_fsdp.CPUOffload(offload_params=False),
    )
    x, y = batch(0, PER_RANK)
    loss_fn(model(x), y).backward()
    with FSDP.state_dict_type(
        model, torch_fsdp.StateDictType.SHARDED_STATE_DICT, torch_fsdp.ShardedStateDictConfig(offload_to_cpu=True)
    ):
        sd = model.state_dict()
        settings = FSDP.get_state_dict_type(model)
    return {
        "strategy": model.sharding_strategy is ShardingStrategy.SHARD_GRAD_OP,
        "precision": model.mixed_precision == MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
        "settings": settings.state_dict_type is StateDictType.SHARDED_STATE_DICT
        and settings.state_dict_config.offload_to_cpu,
        "sharded": type(next(iter(sd.values()))).__name__,
    }


def test_pytorch_fsdp_enums_and_configs_are_accepted():
    expected = {"strategy": True, "precision": True, "settings": True, "sharded": "ShardedTensor"}
    assert run_distributed(half_swapped_worker, 2, timeout=120) == [expected] * 2


def get_state_dict_worker(rank: int, world: int, path: str) -> list:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict, get_state_dict

    _, model, batch, loss_fn = build("odd_mlp", "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    x, y = batch(0, PER_RANK)
    loss_fn(model(x), y).backward()
    opt.step()
    out = []
    for call in (
        lambda: get_state_dict(model, opt),
        lambda: get_model_state_dict(model),
        lambda: get_optimizer_state_dict(model, opt),
    ):
        try:
            sd = call()
            dcp.save({"state": sd}, checkpoint_id=path)
            out.append("no error")
        except Exception as e:  # the message is returned so the parent checks it on every rank
            out.append(f"{type(e).__name__}: {e}")
    return out


def test_pytorch_get_state_dict_on_the_wrapper_raises_before_writing(tmp_path):
    path = str(tmp_path / "dcp")
    for messages in run_distributed(get_state_dict_worker, 2, path, timeout=120):
        for message in messages:
            assert message.startswith("NotBuiltError: torch.distributed.checkpoint.state_dict"), message
            assert "flatshard.checkpoint" in message and "SHARDED_STATE_DICT" in message, message
    assert not os.path.exists(path) or not os.listdir(path), "nothing may be written"
