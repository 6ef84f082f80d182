"""flatshard: Fully Sharded Data Parallel training for PyTorch, on torch.distributed.

The public names mirror ``torch.distributed.fsdp``; change the imports of a PyTorch FSDP script to
``flatshard`` and it runs (on CPU with gloo too). The package, by layer (each imports only those
below it; tests/test_layering.py holds it so):

  __init__.py, __main__.py, cli.py   the lazy public names; the ``flatshard`` command (plan, consolidate,
               inspect, env); envreport.py, what ``flatshard env`` prints for a bug report
  fsdp.py      front end 1: FullyShardedDataParallel, FSDP1's API, translated onto the engine
  fsdp2/       front end 2: fully_shard, FSDP2's API (DTensor parameters) on the same engine: frontend.py,
               module.py, checks.py, tensor_parallel.py, extensions.py (its __init__ says what each holds)
  ft.py        replica groups that drop out and rejoin, on torchft (an add-on beside the front ends)
  testing.py   what flatshard's own tests read of the engine, in one documented place
  checkpoint/  files on disk: save, load, consolidate, inspect, resume
  state/       in-memory state dicts (FULL, LOCAL, SHARDED; optimizer), torch.distributed.checkpoint
  runtime/     the engine: units and their flat groups, hooks, schedule; comm/ (bytes between ranks) and
               build/ (construction) below and beside it (its docstring: one step of one unit)
  api.py, wrap.py, weight_decay.py, interop.py   enums and configs, wrap policies, parameter groups,
               PyTorch FSDP's own enums and configs accepted
  planner/     the cost model (pure; imports no torch)

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
    "CheckpointError": "flatshard.api",
    "FullyShardedDataParallel": "flatshard.fsdp",
    "fully_shard": "flatshard.fsdp2",
    "FSDPModule": "flatshard.fsdp2",
    "MixedPrecisionPolicy": "flatshard.fsdp2",
    "OffloadPolicy": "flatshard.fsdp2",
    "CPUOffloadPolicy": "flatshard.fsdp2",
    "UnshardHandle": "flatshard.fsdp2",
    "register_fsdp_forward_method": "flatshard.fsdp2",
    "CommRecorder": "flatshard.runtime.instrument",
    "MemoryRecorder": "flatshard.runtime.instrument",
    "UnitInfo": "flatshard.runtime.tree",
    "FlatGroupInfo": "flatshard.runtime.tree",
    "units": "flatshard.runtime.tree",
    "owned_named_parameters": "flatshard.runtime.tree",
    "param_groups": "flatshard.weight_decay",
}

__all__ = sorted([*_EXPORTS, "FSDP"])


_SUBPACKAGES = ("checkpoint", "planner", "testing", "wrap")


def __getattr__(name: str) -> Any:
    if name in _SUBPACKAGES:  # ``flatshard.checkpoint.save(...)`` after a bare ``import flatshard``
        return importlib.import_module(f"flatshard.{name}")
    if name == "FSDP":
        name = "FullyShardedDataParallel"
    if name not in _EXPORTS:
        raise AttributeError(f"module 'flatshard' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
