"""Optimizer parameter groups that stay right on shard views.

Shard views are 1-D, so the common idiom ``p.dim() >= 2`` (decay matrices, not norms and biases)
would put every parameter in the no-decay group. Each shard view carries its full shape in
``p.orig_shape``; ``param_groups`` decides on that shape (and works on an unwrapped model too).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Optional

from torch import nn


def full_ndim(param: nn.Parameter) -> int:
    """The number of dimensions of the full parameter behind ``param`` (a shard view or a plain parameter)."""
    return len(getattr(param, "orig_shape", param.shape))


def param_groups(
    model: nn.Module,
    weight_decay: float,
    no_decay: Optional[Callable[[str, nn.Parameter], bool]] = None,
) -> list[dict]:
    """Two groups for ``torch.optim``: matrices (full ndim >= 2) with ``weight_decay``; biases, norm
    weights and other vectors with none. ``no_decay(name, param)`` overrides the rule for a parameter
    when it returns True. Frozen parameters are left out."""
    decay: list[nn.Parameter] = []
    keep: list[nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exempt = full_ndim(p) < 2 or (no_decay is not None and no_decay(name, p))
        (keep if exempt else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": keep, "weight_decay": 0.0},
    ]
