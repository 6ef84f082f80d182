"""Mixed precision: which dtype each of a unit's tensors lives in, and casting forward inputs.

[Note: precision of a unit's tensors]
  * flat shard and grad shard: the master dtype (the parameters' own, fp32 in practice); the
    optimizer only ever sees these.
  * unsharded flat, compute views: ``param_dtype``; each rank casts its flat shard down before the
    all-gather, so the gather moves param_dtype bytes (half of fp32 for bf16).
  * unsharded flat's gradient: param_dtype (autograd's); cast to ``reduce_dtype`` (default:
    param_dtype, as in PyTorch FSDP) for the reduce-scatter and all-reduce; the reduced shard is cast
    up to the master dtype before it becomes ``.grad``.
  * buffers: ``buffer_dtype`` (cast once, when the root is first used).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from flatshard.api import MixedPrecision, NotBuiltError


@dataclass(frozen=True)
class UnitPrecision:
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True

    @property
    def mixed(self) -> bool:
        return self.compute != self.master


def resolve(policy: Optional[MixedPrecision], master: torch.dtype) -> UnitPrecision:
    if policy is None:
        return UnitPrecision(master, master, master)
    if policy.keep_low_precision_grads:
        raise NotBuiltError(
            "MixedPrecision(keep_low_precision_grads=True) is not built yet in flatshard: gradients are handed to "
            "the optimizer in the master dtype. Pass keep_low_precision_grads=False."
        )
    compute = policy.param_dtype or master
    reduce = policy.reduce_dtype or compute
    return UnitPrecision(master, compute, reduce, policy.cast_forward_inputs, policy.cast_root_forward_inputs)


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (others untouched)."""

    def cast(x: Any) -> Any:
        if torch.is_tensor(x) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        return x

    return tree_map(cast, tree)


def cast_buffers(module: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    if dtype is None:
        return
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and torch.is_floating_point(buf) and buf.dtype != dtype:
                sub._buffers[name] = buf.to(dtype)
