"""A flat group's gradients on this rank (``GradState``), and the marks of an open accumulation window
(``WindowMarks``, also used by the parameters that gather themselves, fsdp2/extensions.py).

After ``zero_grad()`` (set_to_none, PyTorch's default) the reduced shard becomes the *grad shard*: each
trainable shard view's ``.grad`` a slice of it. Where a view still holds a gradient
(``zero_grad(set_to_none=False)``, or no zero_grad at all) the new gradient is added to it in place, as
``torch.autograd`` accumulates. fully_shard's views and gradients are DTensors over the same storage
(the flat group's ``wrap_grad`` wraps each slice).
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Callable, Sequence
from typing import Optional

import torch
from torch.distributed.tensor import DTensor

# (index of a parameter, a local tensor) -> what its ``.grad`` is: fully_shard's DTensor, or the tensor itself
WrapGrad = Callable[[int, torch.Tensor], torch.Tensor]


def local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local tensor (fully_shard's parameters and gradients); any other tensor itself."""
    return t._local_tensor if isinstance(t, DTensor) else t


def set_grad(view: torch.Tensor, grad: torch.Tensor) -> None:
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
# ``.grad``, or ``GradState.unsynced``), out of the optimizer's sight; so do, under HSDP, the shard-group
# sums of backwards that skip the all-reduce across replicas (fully_shard's set_requires_all_reduce(False):
# ``GradState.partial``, this rank's shard). On an unwrapped model they would be
# on ``.grad``, where the loop's ``zero_grad()`` drops them -- the loop that gives up a window part-way (a
# backward raising before it reaches any unit, a non-finite loss whose backward it skips) relies on that.
# So while a window is open each trainable shard view's ``.grad`` is *marked* (``WindowMarks``): a view with
# no gradient gets a zero that allocates nothing (a broadcast scalar; a DTensor of one for fully_shard) --
# the synchronised gradient so far, which is nothing until the window's synchronised backward -- and each
# view's gradient object and version are remembered. Before the root's next forward, a view whose ``.grad``
# is no longer that object (``zero_grad()``, ``p.grad = None``) or was written in place
# (``zero_grad(set_to_none=False)``) has its part of the accumulation zeroed: the whole window when the loop
# cleared every parameter, as on an unwrapped model, where the micro-batches so far had given it a gradient:
# zeroed in place, it is a zero gradient then, not None. When the window's reduction is exposed the marks go
# first, so a marked view takes the reduced gradient as a view that had none. The parameters that gather
# themselves (fsdp2/extensions.py) keep their unreduced gradients apart and mark their sharded parameters
# the same way, with the same ``WindowMarks``. PyTorch FSDP1 gets the same from its optimizer holding the
# flat parameter whose ``.grad`` is the accumulation (or, with use_orig_params, from finding every original
# parameter's ``.grad`` None); PyTorch FSDP2 shows ``None`` mid-window and keeps the window through
# ``zero_grad()`` until ``reset_iter_state()`` -- a difference README's "Differences from PyTorch FSDP" lists.
# flatshard's clip_grad_norm_ inside an open window raises (runtime/grad_utils.py): nothing there is reduced
# yet, and a broadcast zero cannot be scaled in place. Not seen: a foreach or fused optimizer's
# ``zero_grad(set_to_none=False)`` under fully_shard, whose ``torch._foreach_zero_`` of DTensor gradients
# bumps no version counter (``grad_version``).
@dataclasses.dataclass
class WindowMark:
    """One parameter's ``.grad`` while a window is open: which object and version it was, and whether
    flatshard made it (the mark that allocates nothing) or the loop's own gradient was there."""

    grad: weakref.ref[torch.Tensor]
    version: tuple[int, int]
    made: bool

    def cleared(self, param: torch.Tensor) -> bool:
        """Whether the loop cleared the marked ``.grad`` since: set to None or to another tensor, or
        written in place."""
        grad = self.grad()
        return grad is None or param.grad is not grad or grad_version(grad) != self.version

    def holds(self, param: torch.Tensor) -> bool:
        """Whether ``param.grad`` is still the zero flatshard made."""
        return self.made and self.grad() is not None and param.grad is self.grad()


def grad_version(grad: torch.Tensor) -> tuple[int, int]:
    """What an in-place write to ``grad`` changes: its version and its local tensor's (a DTensor's ``zero_()``
    bumps its own; ``torch._foreach_zero_`` of DTensors, a foreach or fused optimizer's
    ``zero_grad(set_to_none=False)``, bumps neither -- that one clear is not seen)."""
    return grad._version, local(grad)._version


class WindowMarks:
    """The marks of one open window over a list of parameters, by index ([Note: an open accumulation
    window]). ``wrap`` makes a ``.grad`` of a local tensor (fully_shard: a DTensor)."""

    def __init__(self, wrap: Optional[WrapGrad] = None):
        self.wrap = wrap
        self.marks: dict[int, WindowMark] = {}

    def wrapped(self, i: int, t: torch.Tensor) -> torch.Tensor:
        return t if self.wrap is None else self.wrap(i, t)

    def __bool__(self) -> bool:
        return bool(self.marks)

    def mark(self, params: Sequence[torch.Tensor], indices: list[int]) -> None:
        """End of a backward that left the window open: mark ``params[i].grad`` for each ``i`` in
        ``indices`` (a mark an earlier backward of the window made, and the loop left, stays)."""
        marks = {}
        for i in indices:
            param, mark = params[i], self.marks.get(i)
            if mark is None or mark.cleared(param):
                made = param.grad is None
                if made:
                    zero = torch.zeros((), dtype=param.dtype, device=param.device).expand(local(param).shape)
                    set_grad(param, self.wrapped(i, zero))
                grad = param.grad
                assert grad is not None  # the loop's own, or the zero just set
                mark = WindowMark(weakref.ref(grad), grad_version(grad), made)
            marks[i] = mark
        self.marks = marks

    def drop_cleared(self, params: Sequence[torch.Tensor]) -> set[int]:
        """Before the root's next forward: the indices whose ``.grad`` the loop cleared since the last
        backward, unmarked; a mark zeroed in place (``zero_grad(set_to_none=False)``) becomes a zero
        gradient of its own, as on an unwrapped model."""
        cleared = {i for i, mark in self.marks.items() if mark.cleared(params[i])}
        for i in cleared:
            mark, param = self.marks.pop(i), params[i]
            if mark.holds(param):  # zeroed in place
                zero = torch.zeros(local(param).shape, dtype=param.dtype, device=param.device)
                set_grad(param, self.wrapped(i, zero))
        return cleared

    def unmark(self, params: Sequence[torch.Tensor]) -> None:
        """The window closed (reduced, or dropped): a parameter still holding flatshard's mark has no
        gradient again."""
        for i, mark in self.marks.items():
            if mark.holds(params[i]):
                params[i].grad = None
        self.marks = {}


class GradState:
    """A flat group's gradients on this rank: the grad shard its trainable shard views' ``.grad`` slice,
    the unreduced accumulation of an open window kept in the reduce dtype (``unsynced``, fully_shard), the
    shard-group sums kept from the all-reduce across replicas (``partial``, fully_shard's
    ``set_requires_all_reduce(False)``: also an open window), and the window's marks."""

    def __init__(self, wrap: Optional[WrapGrad] = None):
        self._shard: Optional[weakref.ref] = None
        self.unsynced: Optional[torch.Tensor] = None
        self.partial: Optional[torch.Tensor] = None  # this rank's shard, in the reduce dtype, undivided
        self.marks = WindowMarks(wrap)

    @property
    def wrap(self) -> Optional[WrapGrad]:
        return self.marks.wrap

    @wrap.setter
    def wrap(self, wrap: Optional[WrapGrad]) -> None:
        self.marks.wrap = wrap

    def forget_shard(self) -> None:
        """The views were rebuilt (a unit given its parameters back): no view slices the old grad shard."""
        self._shard = None

    def grad_shard(self, views: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
        """The tensor the trainable ``views``' ``.grad`` slice, while they still do (else None: no gradient
        yet, ``zero_grad(set_to_none=True)`` dropped it, or the views hold gradients of their own)."""
        grad = self._shard() if self._shard is not None else None
        if grad is None:
            return None
        ptr = grad.untyped_storage().data_ptr()
        trainable = [v for v in views if v.requires_grad]
        if any(v.grad is None or local(v.grad).untyped_storage().data_ptr() != ptr for v in trainable):
            return None
        return grad

    def expose(self, reduced: torch.Tensor, views: Sequence[torch.Tensor], slices: list[tuple[int, int]]) -> None:
        """Make ``reduced`` this rank's gradient: the grad shard when no trainable view holds a gradient,
        else added in place to what each view holds, and ``reduced`` dropped."""
        self.marks.unmark(views)  # [Note: an open accumulation window]
        wrap = self.marks.wrapped
        trainable = [(i, v, lo, hi) for i, (v, (lo, hi)) in enumerate(zip(views, slices)) if v.requires_grad]
        if all(v.grad is None for _, v, _, _ in trainable):
            for i, view, lo, hi in trainable:
                set_grad(view, wrap(i, reduced[lo:hi].view(local(view).shape)))
            self._shard = weakref.ref(reduced)
        else:
            for i, view, lo, hi in trainable:
                if view.grad is None:
                    set_grad(view, wrap(i, reduced[lo:hi].view(local(view).shape).clone()))
                else:
                    local(view.grad).add_(reduced[lo:hi].view(local(view.grad).shape))
        if self.wrap is not None:
            _run_post_accumulate_grad_hooks([v for _, v, _, _ in trainable])

    def add_partial(self, shard_sum: torch.Tensor) -> None:
        """A backward that stopped at the shard group's sum: add it to those kept (PyTorch FSDP2's order)."""
        self.partial = shard_sum if self.partial is None else self.partial.add_(shard_sum)

    def take_partial(self) -> Optional[torch.Tensor]:
        """The kept shard-group sums, for a reduction that all-reduces them with its own."""
        partial, self.partial = self.partial, None
        return partial

    def window_open(self, unsharded: torch.Tensor) -> bool:
        """Whether an unreduced accumulation is held (an open window): on the unsharded flat, apart, or as
        shard-group sums not yet all-reduced across replicas."""
        return unsharded.grad is not None or self.unsynced is not None or self.partial is not None

    def mark_window(self, views: Sequence[torch.Tensor]) -> None:
        """End of a backward that left the window open: mark each trainable shard view's ``.grad``."""
        self.marks.mark(views, [i for i, v in enumerate(views) if v.requires_grad])

    def drop_cleared(
        self,
        views: Sequence[torch.Tensor],
        unsharded: torch.Tensor,
        split_sizes: list[int],
        local_slices: list[tuple[int, int]],
    ) -> None:
        """Before the root's next forward: zero the part of the open window whose views the loop cleared
        since the last backward; the whole window (and the marks) when every one was. ``split_sizes`` cut
        the full-size accumulations, ``local_slices`` this rank's shard (``partial``)."""
        if not self.marks or not self.window_open(unsharded):
            return
        cleared = self.marks.drop_cleared(views)
        if not self.marks:  # every marked view was cleared: the window is gone, as on an unwrapped model
            unsharded.grad = self.unsynced = self.partial = None
            return
        for held in (unsharded.grad, self.unsynced):
            if held is not None and cleared:
                pieces = torch.split(held, split_sizes)
                for i in cleared:
                    pieces[i].zero_()
        if self.partial is not None:
            for i in cleared:
                lo, hi = local_slices[i]
                self.partial[lo:hi].zero_()

    def drop_unreduced(self, views: Sequence[torch.Tensor], unsharded: torch.Tensor) -> None:
        """A step that raised: what backward had not reduced is dropped, with the window's marks."""
        unsharded.grad = self.unsynced = self.partial = None
        self.marks.unmark(views)


def _run_post_accumulate_grad_hooks(views: list[torch.Tensor]) -> None:
    """fully_shard's parameters get their gradient from the reduction, not from autograd, so autograd
    never runs hooks registered with ``register_post_accumulate_grad_hook`` on them: they run here, once
    the reduced gradient is on ``.grad``, as FSDP2 runs them (an optimizer stepped per parameter from
    its hook, the reduction's memory freed as it goes)."""
    for view in views:
        for hook in list((getattr(view, "_post_accumulate_grad_hooks", None) or {}).values()):
            hook(view)
