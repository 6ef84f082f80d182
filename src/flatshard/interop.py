"""PyTorch FSDP's own enums and configs, accepted as flatshard's: the one module that imports
``torch.distributed.fsdp`` (to recognise them, never to run them).

A script that swapped some imports and not others still runs: ``torch.distributed.fsdp``'s
``ShardingStrategy``, ``BackwardPrefetch``, ``StateDictType``, ``MixedPrecision``, ``CPUOffload``, the
state-dict configs and FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` are
translated by name and fields. A field flatshard does not build raises ``NotBuiltError``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch.distributed.fsdp as torch_fsdp

from flatshard import api

_ENUMS = {
    torch_fsdp.ShardingStrategy: api.ShardingStrategy,
    torch_fsdp.BackwardPrefetch: api.BackwardPrefetch,
    torch_fsdp.StateDictType: api.StateDictType,
}
_CONFIGS = {
    torch_fsdp.CPUOffload: api.CPUOffload,
    torch_fsdp.FullStateDictConfig: api.FullStateDictConfig,
    torch_fsdp.ShardedStateDictConfig: api.ShardedStateDictConfig,
    torch_fsdp.LocalStateDictConfig: api.LocalStateDictConfig,
    torch_fsdp.FullOptimStateDictConfig: api.FullOptimStateDictConfig,
    torch_fsdp.ShardedOptimStateDictConfig: api.ShardedOptimStateDictConfig,
    torch_fsdp.LocalOptimStateDictConfig: api.LocalOptimStateDictConfig,
    torch_fsdp.StateDictConfig: api.StateDictConfig,
    torch_fsdp.OptimStateDictConfig: api.OptimStateDictConfig,
}
# FSDP2's policies: flatshard's own live in the fully_shard front end; their names and fields are these
TORCH_MIXED_PRECISION_POLICY = torch_fsdp.MixedPrecisionPolicy
TORCH_OFFLOAD_POLICIES = (torch_fsdp.OffloadPolicy, torch_fsdp.CPUOffloadPolicy)
TORCH_CPU_OFFLOAD_POLICY = torch_fsdp.CPUOffloadPolicy


def translate(value: Any) -> Any:
    """``value`` as flatshard's own type if it is one of PyTorch FSDP's enums or configs; else unchanged."""
    for theirs, ours in _ENUMS.items():
        if isinstance(value, theirs):
            return ours[value.name]
    if isinstance(value, torch_fsdp.MixedPrecision):
        return _mixed_precision(value)
    for theirs, ours in _CONFIGS.items():
        if type(value) is theirs:
            return ours(**{f.name: getattr(value, f.name) for f in dataclasses.fields(ours)})
    return value


def _mixed_precision(value: torch_fsdp.MixedPrecision) -> api.MixedPrecision:
    default = torch_fsdp.MixedPrecision()._module_classes_to_ignore
    if tuple(value._module_classes_to_ignore) != tuple(default):
        raise api.NotBuiltError(
            "MixedPrecision(_module_classes_to_ignore=...) is not built in flatshard: wrap the modules that must "
            "stay in full precision as units of their own without mixed_precision."
        )
    fields = (
        "param_dtype",
        "reduce_dtype",
        "buffer_dtype",
        "keep_low_precision_grads",
        "cast_forward_inputs",
        "cast_root_forward_inputs",
    )
    return api.MixedPrecision(**{f: getattr(value, f) for f in fields})
