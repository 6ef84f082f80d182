"""PyTorch FSDP's own enums and configs, accepted as flatshard's: the one module that imports
``torch.distributed.fsdp`` (to recognise them, never to run them).

A script that swapped some imports and not others still runs: ``torch.distributed.fsdp``'s
``ShardingStrategy``, ``BackwardPrefetch``, ``StateDictType``, ``MixedPrecision``, ``CPUOffload``, the
state-dict configs and FSDP2's ``MixedPrecisionPolicy`` / ``OffloadPolicy`` / ``CPUOffloadPolicy`` are
translated by name and fields. A field flatshard does not build raises ``NotBuiltError``.

It also gives ``fully_shard``'s modules PyTorch's ``FSDPModule`` as a base class (``TorchFSDPModule``
below says why), so the frameworks that ask ``isinstance(m, torch.distributed.fsdp.FSDPModule)``
before calling FSDP2's public methods call flatshard's.
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


# isinstance of PyTorch's FSDPModule.
# Frameworks find FSDP2's modules with ``isinstance(m, torch.distributed.fsdp.FSDPModule)`` and then call
# its public methods: torchtitan calls ``set_gradient_divide_factor(1.0)`` on each (it divides the loss by
# the global token count itself; a module it misses divides its gradients by W a second time, and the
# run trains differently with no error), and ``set_reshard_after_forward`` / ``set_requires_gradient_sync``
# / ``unshard`` / ``reshard`` on its chunked loss's head; Lightning Fabric calls
# ``set_requires_gradient_sync`` in ``no_backward_sync``; Accelerate leaves a model that already is one as
# it is. So flatshard's ``FSDPModule`` derives from PyTorch's, and what the check then says is true of it:
# every method of PyTorch's class is overridden by flatshard's (FSDP2's public ones with FSDP2's meaning,
# or a ``NotBuiltError`` naming the alternative), so no line of PyTorch's FSDP runs on a flatshard module.
# Its private ``_get_fsdp_state`` (read by torch's own ``register_fsdp_forward_method``, ``share_comm_ctx``,
# pipelining and FSDP2's memory tracker) raises RuntimeError instead of handing out a state flatshard does
# not have: PyTorch's internals are not a feature to build. ``_apply`` (``model.to``) is ``nn.Module``'s,
# as before. tests/test_frameworks.py checks the overrides.
class TorchFSDPModule(torch_fsdp.FSDPModule):
    """PyTorch's ``FSDPModule`` as the base of flatshard's, with its private methods refused."""

    def _get_fsdp_state(self):
        raise RuntimeError(
            f"{type(self).__name__} was sharded by flatshard's fully_shard, which has no PyTorch FSDPState: the "
            "caller reads PyTorch FSDP2's internals. Use flatshard's functions (flatshard.register_fsdp_forward_method "
            "for torch's), or shard this model with torch.distributed.fsdp.fully_shard"
        )

    def _set_unshard_async_op(self, async_op: bool) -> None:  # noqa: ARG002 - refused
        self._get_fsdp_state()

    def _apply(self, *args, **kwargs):
        """``nn.Module._apply``, not FSDP2's (which reshards through its FSDPState first)."""
        apply = super(torch_fsdp.FSDPModule, self)._apply  # type: ignore[misc]  # a mixin; nn.Module follows it
        return apply(*args, **kwargs)


def translate(value: Any) -> Any:
    """``value`` as flatshard's own type if it is one of PyTorch FSDP's enums or configs; else unchanged."""
    for theirs, ours in _ENUMS.items():
        if isinstance(value, theirs):
            return ours[value.name]
    if isinstance(value, torch_fsdp.MixedPrecision):
        return _mixed_precision(value)
    for their_config, our_config in _CONFIGS.items():
        if type(value) is their_config:
            return our_config(**{f.name: getattr(value, f.name) for f in dataclasses.fields(our_config)})
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
