"""Where ``shard_boundaries`` cut a unit's flat between ranks: sizes and shapes in, owners and bounds out.

The one implementation of the arithmetic: the engine's layout (runtime/layout.py, whose
[Note: shard boundaries] says what each mode means) calls it with the parameters of a unit being
built, the planner with the parameter shapes it was given, so what the planner predicts for a mode
is what the engine builds. Pure: no torch, shapes are tuples of ints.

    cut([(7, 15), (15,)], 2, "rows")      # Cut(order=(0, 1), bounds=(0, 60, 120))
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

BOUNDARIES = ("flat", "rows", "params")  # the FSDP1 wrapper's shard_boundaries
PLANNED = (*BOUNDARIES, "chunks")  # and fully_shard's layout, which the planner models too

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Cut:
    """One unit's cut. ``order``: the layout order, as indices into the parameters given (rank by rank
    under ``"params"``, as given otherwise). ``bounds``: F + 1 offsets into the flat in that order; rank
    k of the shard group holds [bounds[k], bounds[k+1]). The flat's length is ``bounds[-1]`` (F·S for
    ``"flat"``, with padding; the parameters' total otherwise)."""

    order: tuple[int, ...]
    bounds: tuple[int, ...]

    @property
    def sizes(self) -> tuple[int, ...]:
        """Each rank's shard length."""
        return tuple(b - a for a, b in zip(self.bounds, self.bounds[1:]))


def check_boundaries(boundaries: str) -> None:
    if boundaries not in BOUNDARIES:
        raise ValueError(f"shard_boundaries must be one of {BOUNDARIES}, got {boundaries!r}")


def numel_of(shape: Shape) -> int:
    return math.prod(shape)


def deal(numels: Sequence[int], shard_size: int, loads: Sequence[int]) -> list[int]:
    """The owner of each parameter under ``"params"``: largest first (ties in order), each to the rank
    holding fewest elements so far (``loads`` plus what it has taken; ties to the lower rank)."""
    held = list(loads)
    owners = [0] * len(numels)
    for i in sorted(range(len(numels)), key=lambda i: (-numels[i], i)):
        owner = min(range(shard_size), key=lambda r: (held[r], r))
        owners[i] = owner
        held[owner] += numels[i]
    return owners


def rank_order(owners: Sequence[int]) -> list[int]:
    """The parameters rank by rank, each rank's in their own order."""
    return sorted(range(len(owners)), key=lambda i: (owners[i], i))


def row_cut(shapes: Sequence[Shape], target: int) -> int:
    """The row boundary (dim 0 of the parameter holding element ``target`` of the flat of ``shapes``,
    laid out in this order) nearest to ``target``; a 0-D parameter is cut before it."""
    offset = 0
    for shape in shapes:
        numel = numel_of(shape)
        if offset <= target < offset + numel:
            if len(shape) == 0:
                return offset
            row = math.prod(shape[1:]) if len(shape) > 1 else 1
            return offset + round((target - offset) / row) * row
        offset += numel
    return target


def chunk_rows(shape: Shape, shard_size: int) -> int:
    """Rows of ``shape`` in each of fully_shard's F chunks (dim 0 cut as ``torch.chunk`` cuts it)."""
    return math.ceil(shape[0] / shard_size) if shape else 1


def chunk_real(shapes: Sequence[Shape], shard_size: int) -> tuple[int, ...]:
    """Each rank's parameter elements under fully_shard's chunks (a trailing rank's chunks may be short)."""
    out = []
    for k in range(shard_size):
        real = 0
        for shape in shapes:
            c, d0 = chunk_rows(shape, shard_size), (shape[0] if shape else 1)
            real += max(0, min(d0, (k + 1) * c) - k * c) * numel_of(shape[1:])
        out.append(real)
    return tuple(out)


def cut(shapes: Sequence[Shape], shard_size: int, boundaries: str = "flat", loads: Sequence[int] | None = None) -> Cut:
    """The cut of a unit of parameters of ``shapes`` (in the unit's order) over ``shard_size`` ranks.
    ``loads``: elements each rank holds of the units laid out before this one in the same wrap call;
    ``"params"`` deals against them (the caller adds ``sizes`` to them for the next unit). ``"chunks"``:
    fully_shard's layout ([Note: chunked layout], runtime/chunked.py), every rank S = the sum over the
    parameters of their chunk's rows (ceil(d0 / F)) times a row's elements, padding included."""
    if boundaries == "chunks":
        s = sum(chunk_rows(shape, shard_size) * numel_of(shape[1:]) for shape in shapes)
        return Cut(tuple(range(len(shapes))), tuple(k * s for k in range(shard_size + 1)))
    check_boundaries(boundaries)
    numels = [numel_of(s) for s in shapes]
    total = sum(numels)
    f = shard_size
    if boundaries == "flat" or f == 1:
        s = math.ceil(total / f) if total else 0
        return Cut(tuple(range(len(shapes))), tuple(k * s for k in range(f + 1)))
    if boundaries == "rows":
        inner = [row_cut(shapes, total * k // f) for k in range(1, f)]
        return Cut(tuple(range(len(shapes))), (0, *inner, total))
    owners = deal(numels, f, loads if loads is not None else [0] * f)
    mine = [0] * f
    for numel, owner in zip(numels, owners):
        mine[owner] += numel
    return Cut(tuple(rank_order(owners)), tuple(sum(mine[:k]) for k in range(f + 1)))
