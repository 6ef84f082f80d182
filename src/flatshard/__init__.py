"""flatshard: Fully Sharded Data Parallel training for PyTorch, on torch.distributed.

The public names mirror ``torch.distributed.fsdp``; change the imports of a PyTorch FSDP script to
``flatshard`` and it runs (on CPU with gloo too). Reading path: fsdp.py → unit.py → flat_param.py →
collectives.py; schedule.py holds what spans units.

Names load on first use, so ``flatshard plan`` (pure arithmetic) starts without importing torch.
"""
from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "BackwardPrefetch": "flatshard.api",
    "CPUOffload": "flatshard.api",
    "MixedPrecision": "flatshard.api",
    "NotBuiltError": "flatshard.api",
    "ShardingStrategy": "flatshard.api",
    "StateDictType": "flatshard.api",
    "StateDictConfig": "flatshard.api",
    "FullStateDictConfig": "flatshard.api",
    "ShardedStateDictConfig": "flatshard.api",
    "LocalStateDictConfig": "flatshard.api",
    "OptimStateDictConfig": "flatshard.api",
    "FullOptimStateDictConfig": "flatshard.api",
    "ShardedOptimStateDictConfig": "flatshard.api",
    "LocalOptimStateDictConfig": "flatshard.api",
    "StateDictSettings": "flatshard.api",
    "FullyShardedDataParallel": "flatshard.fsdp",
    "CommRecorder": "flatshard.instrument",
    "MemoryRecorder": "flatshard.instrument",
    "param_groups": "flatshard.optim",
}

__all__ = sorted([*_EXPORTS, "FSDP"])


def __getattr__(name: str) -> Any:
    if name == "FSDP":
        name = "FullyShardedDataParallel"
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
