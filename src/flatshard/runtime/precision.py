"""Mixed precision: which dtype each of a unit's tensors lives in, and casting forward inputs.

[Note: precision of a unit's tensors]
  * flat shard and grad shard: the master dtype (the parameters' own, fp32 in practice); the
    optimizer only ever sees these.
  * unsharded flat, compute views: ``param_dtype``; each rank casts its flat shard down before the
    all-gather, so the gather moves param_dtype bytes (half of fp32 for bf16).
  * unsharded flat's gradient: param_dtype (autograd's); cast to ``reduce_dtype`` (default:
    param_dtype, as in PyTorch FSDP) for the reduce-scatter and all-reduce; the reduced shard is cast
    up to the master dtype before it becomes ``.grad`` — unless ``keep_low_precision_grads``: then
    ``.grad`` stays in reduce_dtype, for an optimizer that steps from low-precision gradients (autograd
    forbids a gradient in another dtype than its parameter's, so unit.py sets it through ``.data``).
  * buffers: ``buffer_dtype`` (cast once, when the root is first used).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch.utils._pytree import tree_map

from flatshard.api import MixedPrecision


@dataclass(frozen=True)
class UnitPrecision:
    master: torch.dtype
    compute: torch.dtype
    reduce: torch.dtype
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True
    keep_low_precision_grads: bool = False

    @property
    def grad(self) -> torch.dtype:
        """The dtype of the gradients the optimizer sees."""
        return self.reduce if self.keep_low_precision_grads else self.master

    @property
    def mixed(self) -> bool:
        return self.compute != self.master


def resolve(policy: Optional[MixedPrecision], master: torch.dtype) -> UnitPrecision:
    """The precision of a flat group of ``master`` dtype under ``policy``. ``param_dtype`` casts floating
    parameters only, as in PyTorch FSDP: a group of integer parameters (frozen, by necessity) is gathered
    and computed with as it is."""
    if policy is None or not master.is_floating_point:
        return UnitPrecision(master, master, master)
    compute = policy.param_dtype or master
    reduce = policy.reduce_dtype or compute
    return UnitPrecision(
        master,
        compute,
        reduce,
        policy.cast_forward_inputs,
        policy.cast_root_forward_inputs,
        policy.keep_low_precision_grads,
    )


def cast_floating(tree: Any, dtype: torch.dtype) -> Any:
    """``tree`` with every floating-point tensor cast to ``dtype`` (others untouched), also inside
    dataclass instances (a copy with the cast fields), as PyTorch FSDP's input casts reach them."""

    def cast(x: Any) -> Any:
        if torch.is_tensor(x) and torch.is_floating_point(x) and x.dtype != dtype:
            return x.to(dtype)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            fields = {f.name: cast_floating(getattr(x, f.name), dtype) for f in dataclasses.fields(x) if f.init}
            return dataclasses.replace(x, **fields)
        return x

    return tree_map(cast, tree)


def cast_buffers(module: torch.nn.Module, dtype: Optional[torch.dtype]) -> None:
    if dtype is None:
        return
    for sub in module.modules():
        for name, buf in sub._buffers.items():
            if buf is not None and torch.is_floating_point(buf) and buf.dtype != dtype:
                sub._buffers[name] = buf.to(dtype)
