"""Public enums and frozen configuration dataclasses, named as in ``torch.distributed.fsdp``.

A script written for PyTorch FSDP imports these names from ``flatshard`` instead and keeps every
keyword. Options whose engine has not landed yet exist so that a script can name them, but passing
them with a value that asks for the missing behaviour raises :class:`NotBuiltError` (never a silent
no-op): see ``fsdp.py``.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Optional

import torch


class NotBuiltError(NotImplementedError):
    """A documented FSDP feature that flatshard has not built yet; the message says what to pass instead."""


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


class BackwardPrefetch(enum.Enum):
    BACKWARD_PRE = enum.auto()
    BACKWARD_POST = enum.auto()


class StateDictType(enum.Enum):
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
