"""Optimizers that need whole tensors are stopped at their first step, alike on every rank.

[Note: optimizers on shard views]
An element-wise optimizer (SGD, Adam, AdamW, ...) updates each element from that element's gradient
and state, so stepping each rank's shard views is exactly stepping the whole model. Optimizers that
look at a whole tensor do not: LBFGS takes dot products over all parameters (each rank would use its
own), Adafactor factors a matrix's rows and columns (a 1-D, possibly empty, view has neither), Muon
orthogonalises matrices. flatshard registers one optimizer step pre-hook (torch's public
``register_optimizer_step_pre_hook``, the only process-wide registration it makes, once): before any
step of an optimizer known to need whole tensors that holds pieces of parameters (shard views that are
not whole: ``shard_boundaries="params"`` keeps them whole, tree.py ``owned_named_parameters``), it
raises ``NotBuiltError``.
Every rank runs the same optimizer on the same views, so every rank raises, before anything is
updated. An optimizer of another class is let through (element-wise or not, flatshard cannot tell).
torch.optim.Muon refuses 1-D parameters in its own constructor, with its own message.
"""

from __future__ import annotations

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from flatshard.api import NotBuiltError
from flatshard.runtime.tree import is_whole

WHOLE_TENSOR = {"LBFGS", "Adafactor", "Muon"}  # torch.optim classes that read whole tensors
_installed: list = []  # the hook's handle, once registered (see the Note)


def _whole_tensor_class(optimizer: torch.optim.Optimizer) -> str | None:
    for cls in type(optimizer).__mro__:
        if cls.__name__ in WHOLE_TENSOR and getattr(torch.optim, cls.__name__, None) is cls:
            return cls.__name__
    return None


def _before_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:  # noqa: ARG001 - torch's hook signature
    name = _whole_tensor_class(optimizer)
    if name is None:
        return
    pieces = [p for group in optimizer.param_groups for p in group["params"] if not is_whole(p)]
    if pieces:
        raise NotBuiltError(
            f"torch.optim.{name} needs whole parameters (it reads each tensor as a whole: dot products, row and "
            "column statistics or orthogonalisation), but flatshard's shard views are 1-D pieces of each "
            "parameter, different on each rank, so its step would differ from a single process's. Use an "
            "element-wise optimizer (AdamW, Adam, SGD, RMSprop, ...), which is exact on shard views, or wrap with "
            'shard_boundaries="params" and give it flatshard.owned_named_parameters(model): each parameter '
            "whole on the rank that owns it."
        )


def install() -> None:
    """Register the step pre-hook (once per process)."""
    if not _installed:
        _installed.append(register_optimizer_step_pre_hook(_before_step))
