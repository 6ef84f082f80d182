"""``sharding_factor="auto"``: the planner picks F from the real model's units.

The paper's R4: the smallest sharding factor whose peak fits, not full sharding by default. The
units are known before any parameter is sharded (the wrap policy and placement do not depend on F),
so the planner sees the real element count of every unit and of the root, and the number of
original parameters (AdamW's ``step`` tensors). The budget is what parameters, gradients,
optimizer state and gathered units may use on one rank: ``memory_budget`` bytes, or the
accelerator's free memory. Activations are not known at wrap time and are not counted.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch
import torch.distributed as dist

from flatshard.api import ShardingStrategy
from flatshard.planner import PlanInputs, choose_sharding_factor

logger = logging.getLogger("flatshard")


def auto_sharding_factor(
    *,
    strategy: ShardingStrategy,
    unit_sizes: list[int],
    root_size: int,
    param_tensors: int,
    world_size: int,
    memory_budget: Optional[int],
    device: torch.device,
    optimizer: str = "adam",
) -> tuple[int, str]:
    if strategy is ShardingStrategy.NO_SHARD:
        raise ValueError('sharding_factor="auto" chooses how far to shard; NO_SHARD fixes F = 1. Drop one of the two.')
    budget = memory_budget if memory_budget is not None else _free_device_memory(device)
    inputs = PlanInputs(
        world_size=world_size,
        unit_elements=tuple(unit_sizes),
        root_elements=root_size,
        gpus_per_node=world_size,
        device_memory_bytes=int(budget),
        headroom=0.0,
        optimizer=optimizer,
        param_tensors=param_tensors,
    )
    factor, why = choose_sharding_factor(inputs, reshard_after_forward=strategy.reshard_after_forward)
    if why.startswith("nothing fits"):
        raise ValueError(
            f'sharding_factor="auto": {why}. Give a larger memory_budget, more ranks, or smaller units; or pass '
            "sharding_factor=W to shard fully anyway."
        )
    if dist.get_rank() == 0:
        logger.info("sharding_factor=auto chose F=%d of W=%d: %s", factor, world_size, why)
    return factor, why


def _free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    raise ValueError(
        'sharding_factor="auto" needs a memory budget: on a CPU device pass memory_budget=<bytes per rank> '
        "(what parameters, gradients, optimizer state and gathered units may use); on a GPU the device's free "
        "memory is used when memory_budget is not given."
    )
