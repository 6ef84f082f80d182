"""A unit's reduced gradient made the shard views' ``.grad`` (Unit._expose_grads), and read back.

After ``zero_grad()`` (set_to_none, PyTorch's default) the reduced shard becomes the *grad shard*: each
trainable shard view's ``.grad`` a slice of it. Where a view still holds a gradient
(``zero_grad(set_to_none=False)``, or no zero_grad at all) the new gradient is added to it in place, as
``torch.autograd`` accumulates. fully_shard's views and gradients are DTensors over the same storage
(``Unit.grad_as`` wraps each slice).
"""

from __future__ import annotations

import dataclasses
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
    unmark(unit)  # [Note: an open accumulation window]
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


# [Note: an open accumulation window]
# Between a backward that does not synchronise (no_sync, set_requires_gradient_sync(False)) and the one
# that does, the micro-batches' gradients accumulate unreduced inside the units (the unsharded flat's
# ``.grad``, or ``Unit.unsynced``), out of the optimizer's sight. On an unwrapped model they would be on
# ``.grad``, where the loop's ``zero_grad()`` drops them -- the loop that gives up a window part-way (a
# backward raising before it reaches any unit, a non-finite loss whose backward it skips) relies on that.
# So while a window is open each trainable shard view's ``.grad`` is *marked*: a view with no gradient gets
# a zero that allocates nothing (a broadcast scalar; a DTensor of one for fully_shard) -- the synchronised
# gradient so far, which is nothing until the window's synchronised backward -- and each view's gradient
# object and version are remembered. Before the root's next forward, a view whose ``.grad`` is no longer
# that object (``zero_grad()``, ``p.grad = None``) or was written in place (``zero_grad(set_to_none=False)``)
# has its part of the accumulation zeroed: the whole window when the loop cleared every parameter, as on an
# unwrapped model, where the micro-batches so far had given it a gradient: zeroed in place, it is a zero
# gradient then, not None. When the window's reduction is exposed the marks go first, so a marked view takes the
# reduced gradient as a view that had none. PyTorch FSDP1 gets the same from its optimizer holding the
# flat parameter whose ``.grad`` is the accumulation (or, with use_orig_params, from finding every original
# parameter's ``.grad`` None); PyTorch FSDP2 shows ``None`` mid-window and keeps the window through
# ``zero_grad()`` until ``reset_iter_state()`` -- a difference README's "Differences from PyTorch FSDP" lists.
# flatshard's clip_grad_norm_ inside an open window raises (runtime/grad_utils.py): nothing there is reduced
# yet, and a broadcast zero cannot be scaled in place. Not seen: a foreach or fused optimizer's
# ``zero_grad(set_to_none=False)`` under fully_shard, whose ``torch._foreach_zero_`` of DTensor gradients
# bumps no version counter (``grad_version``).
def window_open(unit: Unit) -> bool:
    """Whether ``unit`` holds an unreduced accumulation (an open window)."""
    return unit.unsharded.grad is not None or unit.unsynced is not None


def mark_window(unit: Unit) -> None:
    """End of a backward that left ``unit``'s window open: mark each trainable shard view's ``.grad``."""
    ours = {m.index for m in unit.window_marks if m.made and not m.cleared(unit)}  # marked by an earlier backward
    marks = []
    for i, view in enumerate(unit.shard_views):
        if not view.requires_grad:
            continue
        made = view.grad is None or i in ours
        if view.grad is None:
            zero = torch.zeros((), dtype=view.dtype, device=view.device).expand(local(view).shape)
            _set_grad(view, unit.grad_as(i, zero) if unit.grad_as is not None else zero)
        marks.append(WindowMark(i, weakref.ref(view.grad), grad_version(view.grad), made))
    unit.window_marks = marks


@dataclasses.dataclass
class WindowMark:
    """One trainable shard view's ``.grad`` while a window is open: which object and version it was, and
    whether flatshard made it (the mark that allocates nothing) or the loop's own gradient was there."""

    index: int
    grad: weakref.ref
    version: tuple[int, int]
    made: bool

    def cleared(self, unit: Unit) -> bool:
        return grad_cleared(self.grad, self.version, unit.shard_views[self.index].grad)


def grad_cleared(marked: weakref.ref, version: tuple[int, int], current: Optional[torch.Tensor]) -> bool:
    """Whether the loop cleared a marked ``.grad`` (``marked``, at ``version``) that now reads ``current``:
    set to None or to another tensor, or written in place."""
    grad = marked()
    return grad is None or current is not grad or grad_version(grad) != version


def grad_version(grad: torch.Tensor) -> tuple[int, int]:
    """What an in-place write to ``grad`` changes: its version and its local tensor's (a DTensor's ``zero_()``
    bumps its own; ``torch._foreach_zero_`` of DTensors, a foreach or fused optimizer's
    ``zero_grad(set_to_none=False)``, bumps neither -- that one clear is not seen)."""
    return grad._version, local(grad)._version


def drop_cleared(unit: Unit) -> None:
    """Before the root's next forward: zero the part of ``unit``'s open window whose views the loop cleared
    since the last backward; the whole window (and the marks) when every one was."""
    if not unit.window_marks or not window_open(unit):
        return
    cleared = {m.index for m in unit.window_marks if m.cleared(unit)}
    for mark in unit.window_marks:  # a mark zeroed in place (zero_grad(set_to_none=False)): a zero gradient
        view = unit.shard_views[mark.index]
        if mark.index in cleared and mark.made and mark.grad() is not None and view.grad is mark.grad():
            zero = torch.zeros(local(view).shape, dtype=view.dtype, device=view.device)
            _set_grad(view, unit.grad_as(mark.index, zero) if unit.grad_as is not None else zero)
    if len(cleared) == len(unit.window_marks):
        unit.unsharded.grad = unit.unsynced = None
        unmark(unit)
        return
    for held in (unit.unsharded.grad, unit.unsynced):
        if held is not None and cleared:
            pieces = torch.split(held, unit.layout.split_sizes)
            for i in cleared:
                pieces[i].zero_()
    unit.window_marks = [m for m in unit.window_marks if m.index not in cleared]


def unmark(unit: Unit) -> None:
    """The window closed (reduced, or dropped): a view still holding flatshard's mark has no gradient again."""
    for mark in unit.window_marks:
        if mark.made and mark.grad() is not None and unit.shard_views[mark.index].grad is mark.grad():
            unit.shard_views[mark.index].grad = None
    unit.window_marks = []
