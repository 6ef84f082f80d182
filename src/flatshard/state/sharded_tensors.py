"""SHARDED state-dict values: a rank's flat range of a parameter as a ``ShardedTensor`` of its full
shape (made of boxes, for torch.distributed.checkpoint), and back to the flat piece (``ShardedPiece``)
that module.py and optim.py load from. No communication (but for 0-D parameters): every rank
computes every shard rank's boxes from the unit's layout.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import (
    Shard,
    ShardedTensor,
    ShardedTensorMetadata,
    ShardMetadata,
    TensorProperties,
)

from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.agree import Record, collective_device


@dataclass(frozen=True)
class ShardedPiece:
    """This rank's piece of one original parameter (or of its optimizer state) in a SHARDED state dict:
    ``tensor`` holds elements [start, end) of the flattened parameter of full ``shape``."""

    tensor: torch.Tensor
    shape: torch.Size
    start: int
    end: int

    @property
    def dtype(self) -> torch.dtype:
        return self.tensor.dtype


# [Note: flat ranges as boxes]
# A rank holds elements [start, end) of a parameter's row-major flattening (its slice of the unit's
# flat shard). torch.distributed.checkpoint wants rectangular shards with N-D offsets, so the range
# is cut into boxes, in order: the rest of a partial first row (cut the same way one dimension
# down), then whole rows of dimension 0, then the beginning of a partial last row (again one
# dimension down). That is at most 2·ndim − 1 boxes; each one is a run of consecutive elements
# of the flattening, so it is a contiguous view of the flat shard, and a box converts back to a
# flat range exactly. Every rank computes every shard rank's boxes from the layout, so the
# ShardedTensor's global metadata is built without communication (shards of replicas, under
# HYBRID_SHARD or NO_SHARD, are the same boxes; DCP writes each once).
def flat_range_boxes(start: int, end: int, shape) -> list[tuple[list[int], list[int]]]:
    """(offsets, sizes) of the boxes covering elements [start, end) of a row-major tensor of ``shape``, in order."""
    shape = list(shape)
    if end <= start:
        return []
    if not shape:
        return [([], [])]
    rest, inner = shape[1:], math.prod(shape[1:])
    row, boxes = start // inner, []
    if start % inner:  # the rest of a partial first row
        stop = min(end, (row + 1) * inner)
        boxes += [([row] + o, [1] + z) for o, z in flat_range_boxes(start - row * inner, stop - row * inner, rest)]
        row, start = row + 1, stop
    whole = (end - start) // inner
    if whole:
        boxes.append(([row] + [0] * len(rest), [whole] + rest))
        row, start = row + whole, start + whole * inner
    if start < end:  # the beginning of a partial last row
        boxes += [([row] + o, [1] + z) for o, z in flat_range_boxes(0, end - start, rest)]
    return boxes


def box_flat_range(offsets, sizes, shape) -> Optional[tuple[int, int]]:
    """The flat range [start, end) a box covers, or None if its elements are not consecutive in the flattening."""
    n = math.prod(sizes)
    first = next((d for d, z in enumerate(sizes) if z > 1), len(sizes))
    if n and any(offsets[d] != 0 or sizes[d] != shape[d] for d in range(first + 1, len(shape))):
        return None
    strides = [math.prod(shape[d + 1 :]) for d in range(len(shape))]
    start = sum(o * s for o, s in zip(offsets, strides))
    return start, start + n


def _shard_ranks(unit) -> tuple[Any, list[int]]:
    """(the ShardedTensor's process group, the global rank of each owner rank: each shard rank, or each
    piece's owner when the optimizer state is split over the replicas, across_replicas.py)."""
    groups = unit.flat_group.groups
    if unit.flat_group.pieces is not None:
        return groups.process_group, list(unit.flat_group.pieces.global_ranks)
    if groups.shard_size == 1:
        return groups.process_group, [dist.get_rank()]
    return groups.shard_group, dist.get_process_group_ranks(groups.shard_group)


def _empty_box(shape: list[int]) -> list[tuple[list[int], list[int]]]:
    """A rank that holds no element of a parameter still gets one local shard, of size 0: DCP drops a
    ShardedTensor without local shards from that rank's plan, and then fails to load it ("Missing key
    ... param_groups"). The box sits at the far corner (offsets = shape), where no real box starts,
    so DCP, which tells chunks apart by offset, never confuses it with one; a 0-D parameter has no
    empty box (the rank gets no local shard)."""
    if not shape:
        return []
    return [(shape if math.prod(shape) else [0] * len(shape), [0] * len(shape))]


def sharded_tensor(param: Any, flat: torch.Tensor, record: Record = None) -> Union[ShardedTensor, torch.Tensor]:
    """``flat`` (this rank's elements [param.start, param.end) of the parameter, or of optimizer state
    shaped like it) as a ShardedTensor of the full shape; its local shards are views of ``flat``.

    A 0-D parameter is the exception: its one element lives on one shard rank, a 0-D tensor has no
    empty box for the others (_empty_box), and DCP cannot load a ShardedTensor into a rank without local
    shards; so it is a whole 0-D tensor on every rank, broadcast from the rank that holds it (DCP
    writes a tensor that every rank holds once)."""
    flat = flat.reshape(-1)  # a shard view of "rows" or "params" has the parameter's ndim; its data is one run
    shape, layout, info = list(param.info.shape), param.unit.flat_group.owner_layout, param.info
    index = next(i for i, x in enumerate(layout.infos) if x is info)
    group, ranks = _shard_ranks(param.unit)
    if not shape:
        return _whole_scalar(param, flat, group, ranks, record)
    device = str(flat.device)
    metas, local = [], []
    for shard_rank, global_rank in enumerate(ranks):
        # the elements of the parameter in shard rank's flat shard (FlatLayout.param_ranges, for one parameter)
        start, end = layout.param_ranges(shard_rank)[index]
        for offsets, sizes in flat_range_boxes(start, end, shape) or _empty_box(shape):
            meta = ShardMetadata(offsets, sizes, f"rank:{global_rank}/{device}")
            metas.append(meta)
            if shard_rank == param.unit.flat_group.owner_rank:
                run = box_flat_range(offsets, sizes, shape) if math.prod(sizes) else (param.start, param.start)
                assert run is not None  # each box flat_range_boxes cuts is a run of the flattening
                a, b = run
                local.append(Shard(flat[a - param.start : b - param.start].view(sizes), meta))
    properties = TensorProperties(dtype=flat.dtype, requires_grad=False, pin_memory=flat.is_pinned())
    metadata = ShardedTensorMetadata(metas, torch.Size(shape), properties)
    return ShardedTensor._init_from_local_shards_and_global_metadata(local, metadata, process_group=group)


def _whole_scalar(param: Any, flat: torch.Tensor, group, ranks: list[int], record: Record) -> torch.Tensor:
    layout = param.unit.flat_group.owner_layout  # the owner rank holding the element
    index = next(i for i, x in enumerate(layout.infos) if x is param.info)
    owner = next(r for r in range(layout.shard_size) if layout.param_ranges(r)[index][1] > 0)
    if len(ranks) == 1:
        return flat.reshape(())
    owner = dist.get_group_rank(group, ranks[owner])  # its rank in ``group``
    device = collective_device(group)
    value = flat.reshape(()).to(device) if flat.numel() else torch.zeros((), dtype=flat.dtype, device=device)
    result = collectives.broadcast(value, owner, group)
    if record is not None:
        record(result)
    return value.to(flat.device)


def piece_of(value: ShardedTensor, name: str) -> tuple[Optional[ShardedPiece], Optional[str]]:
    """A ShardedTensor's local shards as one flat piece (or a message saying why they are not one)."""
    shape = list(value.metadata().size)  # not value.size(): ShardedTensor's torch functions warn
    parts = []
    for shard in value.local_shards():
        md = shard.metadata
        if shard.tensor.numel() == 0:
            continue
        rng = box_flat_range(md.shard_offsets, md.shard_sizes, shape)
        if rng is None:
            return None, (
                f"state_dict[{name!r}]: a local shard at offsets {md.shard_offsets} of sizes "
                f"{md.shard_sizes} is not a run of consecutive elements of the flattened {tuple(shape)} "
                "tensor; flatshard loads ShardedTensors sharded by flat ranges or along dimension 0 "
                "(as its own SHARDED state dicts are). Load a FULL state dict instead."
            )
        parts.append((rng, shard.tensor))
    parts.sort(key=lambda p: p[0])
    if not parts:
        dtype = value.metadata().tensor_properties.dtype
        return ShardedPiece(torch.empty(0, dtype=dtype), torch.Size(shape), 0, 0), None
    for (_, prev_end), ((start, _), _) in zip([p[0] for p in parts], parts[1:]):
        if start != prev_end:
            return None, (
                f"state_dict[{name!r}]: this rank's local shards cover a non-contiguous part of the "
                "flattened tensor; flatshard loads one flat range per rank. Load a FULL state dict instead."
            )
    flat = torch.cat([t.reshape(-1) for _, t in parts]) if len(parts) > 1 else parts[0][1].reshape(-1)
    return ShardedPiece(flat, torch.Size(shape), parts[0][0][0], parts[-1][0][1]), None


def pieces_from_sharded_tensors(values: dict, where: str = "") -> tuple[dict, Optional[str]]:
    """``values`` with each ShardedTensor replaced by its ShardedPiece (a new dict), and the first problem."""
    out, problem = dict(values), None
    for key, value in values.items():
        if isinstance(value, ShardedTensor):
            out[key], bad = piece_of(value, f"{where}{key}")
            problem = problem or bad
    return out, problem
