"""flatshard: Fully Sharded Data Parallel training for PyTorch, on torch.distributed.

The public names mirror ``torch.distributed.fsdp``; change the imports of a PyTorch FSDP script to
``flatshard`` and it runs (on CPU with gloo too). Reading path: fsdp.py → unit.py → flat_param.py →
collectives.py; schedule.py holds what spans units.
"""
from flatshard.api import (
    BackwardPrefetch,
    CPUOffload,
    MixedPrecision,
    NotBuiltError,
    ShardingStrategy,
    StateDictType,
)
from flatshard.fsdp import FullyShardedDataParallel
from flatshard.instrument import CommRecorder, MemoryRecorder
from flatshard.optim import param_groups

FSDP = FullyShardedDataParallel

__version__ = "0.1.0"

__all__ = [
    "BackwardPrefetch",
    "CPUOffload",
    "CommRecorder",
    "FSDP",
    "FullyShardedDataParallel",
    "MemoryRecorder",
    "MixedPrecision",
    "NotBuiltError",
    "ShardingStrategy",
    "StateDictType",
    "param_groups",
]
