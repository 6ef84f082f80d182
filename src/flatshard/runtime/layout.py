"""Layout of one unit's flat parameter, and the views that users and modules see.

[Note: flatshard tensors]
Each unit names five tensors, always with these words:
  * flat shard     1-D, master dtype, S = ceil(T / F) elements for T parameter elements; rank k of the
                   shard group owns elements [kS, (k+1)S) of the zero-padded concatenation. Persistent.
  * shard views    per original parameter, the slice of its flattened range inside this rank's flat
                   shard, as an ``nn.Parameter`` (1-D, maybe empty) under the original name. What
                   ``named_parameters()`` and the optimizer see; ``orig_shape`` holds the full shape.
  * grad shard     S elements where reduced gradients land; each shard view's ``.grad`` views into it
                   (``FlatGroup.grad_shard``).
  * unsharded flat F·S elements, filled by all-gather; its storage is freed on reshard and refilled
                   into the same tensor, so tensors autograd saved in forward are valid in backward.
  * compute views  the unsharded flat in the original shapes (one ``torch.split`` per pass, so
                   backward yields one flat gradient), set on the modules while a unit computes.

This file knows layouts and views only; it never communicates.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Optional, Protocol, cast

import torch
from torch import nn

from flatshard.planner import boundaries as cuts


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


BOUNDARIES = cuts.BOUNDARIES


class FlatLayout:
    """Offsets, shard boundaries and per-rank ranges of one unit's flat parameter.

    [Note: shard boundaries]
    The flat is the unit's parameters concatenated in layout order; rank k of the shard group owns
    elements [bounds[k], bounds[k+1]). Three ways to place the bounds (``shard_boundaries``):
      * ``"flat"``   equal shards of S = ceil(T / F) elements, the last zero-padded: the cuts fall
                     anywhere, so a rank holds 1-D pieces of parameters;
      * ``"rows"``   each cut moved to the row boundary (dim 0) nearest to k·T/F: a rank's piece of a
                     parameter is a block of whole rows, its shard view keeps the parameter's ndim;
      * ``"params"`` every parameter whole on one rank: parameters are dealt to ranks largest first,
                     each to the rank holding fewest elements so far (ties to the lower rank), and laid
                     out rank by rank, so each rank's parameters are contiguous in the flat. "So far"
                     counts the units built before this one in the same wrap call (``loads``): a rank
                     that took a unit's largest matrix takes less of the next, so the model's bytes per
                     rank balance even where one unit's cannot.
    The arithmetic (shapes in, order and bounds out) is planner/boundaries.py's ``cut``, torch-free, so
    the planner (``PlanInputs.shard_boundaries``) predicts the shards the engine builds.
    Shards of ``"rows"`` and ``"params"`` differ in size (``shard_numel_of``); nothing is padded, and
    the unsharded flat is still the parameters in layout order, so compute views stay zero-copy
    splits. On gloo the point-to-point exchanges move ragged shards as they are; other backends need
    equal sizes, paid as padding and one copy per collective (comm/collectives.py).
    """

    def __init__(
        self,
        infos: list[ParamInfo],
        shard_size: int,
        boundaries: str = "flat",
        loads: Optional[list[int]] = None,
        replicas: int = 1,
    ):
        """``loads``: elements each shard rank holds of the units laid out before this one (``"params"``
        deals against them and adds this unit's shards to them). ``replicas`` R > 1 (``"flat"`` only):
        each shard is R equal pieces, the "flat" shards over F·R ranks ([Note: optimizer state across
        replicas], across_replicas.py)."""
        self.boundaries = boundaries
        self.shard_size = shard_size  # F
        loads = loads if loads is not None else [0] * shard_size
        cut = cuts.cut([tuple(i.shape) for i in infos], shard_size, boundaries, loads)
        self.infos = _laid_out(infos, cut.order) if boundaries == "params" and shard_size > 1 else infos
        self.total = sum(i.numel for i in self.infos)  # T
        self.bounds = list(cut.bounds)
        if replicas > 1:
            piece = -(-self.total // (shard_size * replicas)) if self.total else 0
            self.bounds = [k * replicas * piece for k in range(shard_size + 1)]
        for rank, size in enumerate(self.shard_sizes):
            loads[rank] += size
        self.padded = self.bounds[-1]  # the unsharded flat: F·S for "flat", T otherwise
        self.split_sizes = [i.numel for i in self.infos] + [self.padded - self.total]

    rank_major: Literal[False] = False  # the unsharded flat is gathered as it is (runtime/chunked.py is the other kind)

    def segment(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flat shard cut from the whole flat ``full`` (a view)."""
        return full[self.bounds[rank] : self.bounds[rank + 1]]

    @property
    def signature(self) -> str:
        """What must match for a LOCAL state dict to load: the mode and every shard's bounds."""
        return f"{self.boundaries} {self.bounds}"

    @property
    def shard_numel(self) -> int:
        """The largest shard (S for ``"flat"``, where every shard has S elements)."""
        return max(self.shard_sizes)

    @property
    def shard_sizes(self) -> list[int]:
        return [b - a for a, b in zip(self.bounds, self.bounds[1:])]

    def shard_numel_of(self, rank: int) -> int:
        return self.bounds[rank + 1] - self.bounds[rank]

    @property
    def uniform(self) -> bool:
        return len(set(self.shard_sizes)) <= 1

    def local_slices(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its piece inside rank ``rank``'s flat shard."""
        lo_rank, hi_rank = self.bounds[rank], self.bounds[rank + 1]
        out = []
        for info in self.infos:
            lo = max(info.offset, lo_rank)
            hi = min(info.offset + info.numel, hi_rank)
            out.append((lo - lo_rank, hi - lo_rank) if hi > lo else (0, 0))
        return out

    def param_ranges(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its flattened elements that rank ``rank`` holds."""
        base = self.bounds[rank]
        return [
            (lo + base - info.offset, hi + base - info.offset) if hi > lo else (0, 0)
            for info, (lo, hi) in zip(self.infos, self.local_slices(rank))
        ]

    def flatten(self, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The zero-padded concatenation of ``tensors`` (by parameter name) in layout order."""
        flat = torch.zeros(self.padded, dtype=dtype, device=device)
        for info in self.infos:
            flat[info.offset : info.offset + info.numel].copy_(tensors[info.name].detach().reshape(-1))
        return flat

    def local_shape(self, info: ParamInfo, lo: int, hi: int) -> tuple[int, ...]:
        """The shape of a shard view holding elements [lo, hi) of ``info``'s parameter: 1-D for
        ``"flat"``; a block of whole rows (the parameter's ndim) for ``"rows"`` and ``"params"``."""
        n = hi - lo
        if self.boundaries == "flat" or len(info.shape) == 0:  # a 0-D parameter's view stays 1-D everywhere
            return (n,)
        row = math.prod(info.shape[1:])
        return (n // row if row else 0, *info.shape[1:])


def _laid_out(infos: list[ParamInfo], order: tuple[int, ...]) -> list[ParamInfo]:
    """``infos`` in layout ``order`` (rank by rank under ``"params"``), with offsets to match."""
    out, offset = [], 0
    for i in order:
        out.append(dataclasses.replace(infos[i], offset=offset))
        offset += infos[i].numel
    return out


class Layout(Protocol):
    """What the views below read of a layout: ``FlatLayout``, or chunked.py's ``ChunkedLayout``."""

    infos: list[ParamInfo]
    split_sizes: list[int]

    def local_slices(self, rank: int) -> list[tuple[int, int]]: ...

    def local_shape(self, info: ParamInfo, lo: int, hi: int) -> tuple[int, ...]: ...


def make_shard_views(layout: Layout, flat_shard: torch.Tensor, rank: int) -> list[nn.Parameter]:
    """One ``nn.Parameter`` per original parameter, aliasing its slice of the flat shard."""
    views = []
    for info, (lo, hi) in zip(layout.infos, layout.local_slices(rank)):
        view = nn.Parameter(flat_shard[lo:hi].view(layout.local_shape(info, lo, hi)), requires_grad=info.requires_grad)
        view.orig_shape = info.shape  # type: ignore[attr-defined]  # flatshard's attribute: the full shape
        views.append(view)
    return views


def make_compute_views(layout: Layout, unsharded: torch.Tensor) -> list[torch.Tensor]:
    """Original-shape views of the unsharded flat, made with one split so backward makes one flat grad.

    Frozen parameters take their view from a detached alias: no gradient is computed for them.
    """
    chunks = torch.split(unsharded, layout.split_sizes)
    detached = None
    views: list[torch.Tensor] = []
    for info, chunk in zip(layout.infos, chunks):
        if not info.requires_grad and unsharded.requires_grad:
            if detached is None:
                detached = torch.split(unsharded.detach(), layout.split_sizes)
            chunk = detached[len(views)]
        views.append(chunk.view(info.shape))
    return views


def set_views_on_modules(layout: Layout, views: Sequence[torch.Tensor], *, as_params: bool) -> None:
    """Make ``module.<attr>`` return ``views[i]`` for every use of every parameter.

    Shard views go into ``module._parameters`` (so ``named_parameters()`` yields them); compute
    views go into the instance ``__dict__`` with the ``_parameters`` slot held at ``None``, which
    keeps the slot's position (and so the order of ``named_parameters()``) stable across passes.
    """
    for info, view in zip(layout.infos, views):
        for module, attr in info.uses:
            if as_params:
                module.__dict__.pop(attr, None)
                module._parameters[attr] = cast(nn.Parameter, view)  # as_params: the shard views, parameters
            else:
                module._parameters[attr] = None
                module.__dict__[attr] = view
