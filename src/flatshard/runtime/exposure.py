"""A unit's reduced gradient made the shard views' ``.grad`` (Unit._expose_grads), and read back.

After ``zero_grad()`` (set_to_none, PyTorch's default) the reduced shard becomes the *grad shard*: each
trainable shard view's ``.grad`` a slice of it. Where a view still holds a gradient
(``zero_grad(set_to_none=False)``, or no zero_grad at all) the new gradient is added to it in place, as
``torch.autograd`` accumulates. fully_shard's views and gradients are DTensors over the same storage
(``Unit.grad_as`` wraps each slice).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Optional

import torch
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from flatshard.runtime.unit import Unit


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (fully_shard's parameters and gradients); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def grad_shard(unit: Unit) -> Optional[torch.Tensor]:
    """The tensor the trainable shard views' ``.grad`` slice, while they still do (else None: no gradient
    yet, ``zero_grad(set_to_none=True)`` dropped it, or the views hold gradients of their own)."""
    grad = unit._grad_shard() if unit._grad_shard is not None else None
    if grad is None:
        return None
    ptr = grad.untyped_storage().data_ptr()
    views = [v for v in unit.shard_views if v.requires_grad]
    if any(v.grad is None or local(v.grad).untyped_storage().data_ptr() != ptr for v in views):
        return None
    return grad


def expose_grads(unit: Unit, reduced: torch.Tensor) -> None:
    """Make ``reduced`` this rank's gradient: the grad shard when no trainable view holds a gradient,
    else added in place to what each view holds, and ``reduced`` dropped."""
    if unit.offload:
        reduced = reduced.to(unit.flat_shard.device)
    slices = unit.owner_layout.local_slices(unit.owner_rank)
    trainable = [(i, v, lo, hi) for i, (v, (lo, hi)) in enumerate(zip(unit.shard_views, slices)) if v.requires_grad]
    wrap = unit.grad_as or (lambda _i, g: g)
    if all(v.grad is None for _, v, _, _ in trainable):
        for i, view, lo, hi in trainable:
            _set_grad(view, wrap(i, reduced[lo:hi].view(local(view).shape)))
        unit._grad_shard = weakref.ref(reduced)
    else:
        for i, view, lo, hi in trainable:
            if view.grad is None:
                _set_grad(view, wrap(i, reduced[lo:hi].view(local(view).shape).clone()))
            else:
                local(view.grad).add_(reduced[lo:hi].view(local(view.grad).shape))
    if unit.grad_as is not None:
        _run_post_accumulate_grad_hooks([v for _, v, _, _ in trainable])


def _run_post_accumulate_grad_hooks(views: list[torch.Tensor]) -> None:
    """fully_shard's parameters get their gradient from the reduction, not from autograd, so autograd
    never runs hooks registered with ``register_post_accumulate_grad_hook`` on them: they run here, once
    the reduced gradient is on ``.grad``, as FSDP2 runs them (an optimizer stepped per parameter from
    its hook, the reduction's memory freed as it goes)."""
    for view in views:
        for hook in list((getattr(view, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(view)


def _set_grad(view: torch.Tensor, grad: torch.Tensor) -> None:
    """``view.grad = grad``, also when ``grad`` is in another dtype (keep_low_precision_grads): autograd
    refuses that assignment, so a same-dtype placeholder that allocates nothing (a broadcast scalar) is
    assigned first and its ``.data`` swapped for ``grad``."""
    if grad.dtype == view.dtype:
        view.grad = grad
        return
    view.grad = torch.zeros((), dtype=view.dtype, device=view.device).expand(view.shape)
    view.grad.data = grad
