"""Layout of one unit's flat parameter, and the views that users and modules see.

[Note: flatshard tensors]
Each unit names five tensors, always with these words:
  * flat shard     1-D, master dtype, S = ceil(T / F) elements for T parameter elements; rank k of the
                   shard group owns elements [kS, (k+1)S) of the zero-padded concatenation. Persistent.
  * shard views    per original parameter, the slice of its flattened range inside this rank's flat
                   shard, as an ``nn.Parameter`` (1-D, maybe empty) under the original name. What
                   ``named_parameters()`` and the optimizer see; ``orig_shape`` holds the full shape.
  * grad shard     S elements where reduced gradients land; each shard view's ``.grad`` views into it
                   (``Unit.grad_shard``).
  * unsharded flat F·S elements, filled by all-gather; its storage is freed on reshard and refilled
                   into the same tensor, so tensors autograd saved in forward are valid in backward.
  * compute views  the unsharded flat in the original shapes (one ``torch.split`` per pass, so
                   backward yields one flat gradient), set on the modules while a unit computes.

This file knows layouts and views only; it never communicates.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


@dataclass(frozen=True)
class ParamInfo:
    """One original parameter of a unit: where it lives in the flat, and every (module, attr) that holds it.

    ``uses`` has more than one entry for a tied parameter (an embedding shared with an output head).
    """

    name: str  # fully qualified name under the unit's module (the first name of a tied parameter)
    shape: torch.Size
    numel: int
    offset: int  # start in the unpadded flat
    requires_grad: bool
    uses: tuple[tuple[nn.Module, str], ...]


class FlatLayout:
    """Offsets, padding and per-rank ranges of one unit's flat parameter."""

    def __init__(self, infos: list[ParamInfo], shard_size: int):
        self.infos = infos
        self.total = sum(i.numel for i in infos)  # T
        self.shard_numel = math.ceil(self.total / shard_size) if self.total else 0  # S
        self.padded = self.shard_numel * shard_size  # F·S
        self.split_sizes = [i.numel for i in infos] + [self.padded - self.total]

    def local_slices(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its piece inside rank ``rank``'s flat shard."""
        lo_rank, hi_rank = rank * self.shard_numel, (rank + 1) * self.shard_numel
        out = []
        for info in self.infos:
            lo = max(info.offset, lo_rank)
            hi = min(info.offset + info.numel, hi_rank)
            out.append((lo - lo_rank, hi - lo_rank) if hi > lo else (0, 0))
        return out

    def param_ranges(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its flattened elements that rank ``rank`` holds."""
        return [
            (lo + rank * self.shard_numel - info.offset, hi + rank * self.shard_numel - info.offset)
            if hi > lo
            else (0, 0)
            for info, (lo, hi) in zip(self.infos, self.local_slices(rank))
        ]

    def flatten(self, tensors: list[torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zero-padded concatenation of ``tensors`` (one per parameter, in layout order)."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for info, t in zip(self.infos, tensors):
            flat[info.offset : info.offset + info.numel].copy_(t.detach().reshape(-1))
        return flat


def make_shard_views(layout: FlatLayout, flat_shard: torch.Tensor, rank: int) -> list[nn.Parameter]:
    """One ``nn.Parameter`` per original parameter, aliasing its slice of the flat shard."""
    views = []
    for info, (lo, hi) in zip(layout.infos, layout.local_slices(rank)):
        view = nn.Parameter(flat_shard[lo:hi], requires_grad=info.requires_grad)
        view.orig_shape = info.shape  # shard views are 1-D; the full shape stays readable
        views.append(view)
    return views


def make_compute_views(layout: FlatLayout, unsharded: torch.Tensor) -> list[torch.Tensor]:
    """Original-shape views of the unsharded flat, made with one split so backward makes one flat grad.

    Frozen parameters take their view from a detached alias: no gradient is computed for them.
    """
    chunks = torch.split(unsharded, layout.split_sizes)
    detached = None
    views = []
    for info, chunk in zip(layout.infos, chunks):
        if not info.requires_grad and unsharded.requires_grad:
            if detached is None:
                detached = torch.split(unsharded.detach(), layout.split_sizes)
            chunk = detached[len(views)]
        views.append(chunk.view(info.shape))
    return views


def set_views_on_modules(layout: FlatLayout, views: list[torch.Tensor], *, as_params: bool) -> None:
    """Make ``module.<attr>`` return ``views[i]`` for every use of every parameter.

    Shard views go into ``module._parameters`` (so ``named_parameters()`` yields them); compute
    views go into the instance ``__dict__`` with the ``_parameters`` slot held at ``None``, which
    keeps the slot's position (and so the order of ``named_parameters()``) stable across passes.
    """
    for info, view in zip(layout.infos, views):
        for module, attr in info.uses:
            if as_params:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = view
            else:
                module._parameters[attr] = None
                module.__dict__[attr] = view
