"""Public enums, frozen configuration dataclasses and error types, named as in ``torch.distributed.fsdp``.

A script written for PyTorch FSDP imports these names from ``flatshard`` instead and keeps every
keyword. A keyword or method whose engine is not built raises :class:`NotBuiltError`, naming what to
use instead (never a silent no-op).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


class NotBuiltError(NotImplementedError):
    """A documented FSDP feature that flatshard has not built yet; the message says what to pass instead."""


class CheckpointError(RuntimeError):
    """A checkpoint or state dict that cannot be saved or loaded; the message names the file or parameter
    and the fix. Raised alike on every rank."""


class ShardingStrategy(enum.Enum):
    """How a unit's parameters, gradients and optimizer state are split across ranks.

    In sharding-factor terms (F ranks share one copy; R = W / F replicas):
    FULL_SHARD is F = W, parameters freed after each unit's forward; SHARD_GRAD_OP is F = W with
    parameters kept gathered from forward to the end of backward; NO_SHARD is F = 1 (gradients
    all-reduced, as DDP). HYBRID_SHARD and _HYBRID_SHARD_ZERO2 are 1 < F < W.
    """

    FULL_SHARD = enum.auto()
    SHARD_GRAD_OP = enum.auto()
    NO_SHARD = enum.auto()
    HYBRID_SHARD = enum.auto()
    _HYBRID_SHARD_ZERO2 = enum.auto()

    @property
    def reshard_after_forward(self) -> bool:
        """Whether a unit frees its unsharded flat after forward (and gathers again in backward)."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)

    @property
    def is_hybrid(self) -> bool:
        """Whether the strategy takes shard groups smaller than the world (1 <= F <= W)."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(enum.Enum):
    """When a unit's backward all-gather is issued, as PyTorch FSDP1's enum of the same name.

    ``BACKWARD_PRE`` (the wrapper's default): the next unit's parameters are gathered before the current
    unit's gradient computation, so the gather overlaps it (more memory: two gathered units at once).
    ``BACKWARD_POST``: after the current unit's gradients are computed (less overlap, less memory).
    ``backward_prefetch=None``: no prefetch; each unit gathers when its backward starts.
    """

    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns under ``FullyShardedDataParallel.state_dict_type``, as PyTorch FSDP1's enum.

    ``FULL_STATE_DICT``: full tensors under the original names (gathered; ``FullStateDictConfig`` chooses
    CPU offload and rank 0 only). ``LOCAL_STATE_DICT``: each rank's flat shards as they are, loadable only
    at the same world size and wrapping. ``SHARDED_STATE_DICT``: ``ShardedTensor`` values of the full
    shapes, which ``torch.distributed.checkpoint`` saves and loads at any world size, factor or strategy.
    """

    FULL_STATE_DICT = enum.auto()
    LOCAL_STATE_DICT = enum.auto()
    SHARDED_STATE_DICT = enum.auto()


@dataclass(frozen=True)
class MixedPrecision:
    """Dtypes for gathered parameters, gradient reduction and buffers (FSDP's meanings)."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    buffer_dtype: Optional[torch.dtype] = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffload:
    """Keep flat shards and gradient shards in CPU memory between uses."""

    offload_params: bool = False


# ---- state-dict configurations (``torch.distributed.fsdp``'s names, fields and defaults) -------------
@dataclass(frozen=True)
class StateDictConfig:
    """Base of the module state-dict configurations: ``offload_to_cpu`` moves returned tensors to CPU."""

    offload_to_cpu: bool = False


@dataclass(frozen=True)
class FullStateDictConfig(StateDictConfig):
    """FULL_STATE_DICT: full tensors, gathered one unit at a time; with ``rank0_only`` only global rank 0
    of the model's process group keeps them (the others return an empty dict)."""

    rank0_only: bool = False


@dataclass(frozen=True)
class ShardedStateDictConfig(StateDictConfig):
    """SHARDED_STATE_DICT: each original parameter as a ``ShardedTensor`` of its full shape whose local
    shards are this rank's flat range cut into boxes (state/sharded_tensors.py), for torch.distributed.checkpoint."""

    _use_dtensor: bool = False


@dataclass(frozen=True)
class LocalStateDictConfig(StateDictConfig):
    """LOCAL_STATE_DICT: each rank's flat shards as they are; loads only into the same layout."""


@dataclass(frozen=True)
class OptimStateDictConfig:
    """Base of the optimizer state-dict configurations."""

    offload_to_cpu: bool = True


@dataclass(frozen=True)
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass(frozen=True)
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    _use_dtensor: bool = False


@dataclass(frozen=True)
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass(frozen=True)
class StateDictSettings:
    """What ``set_state_dict_type`` returns: the settings in force before the call."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig
