"""The layout of ``fully_shard``: every parameter cut along dim 0 into F chunks, FSDP2's sharding.

[Note: chunked layout]
FSDP2's parameters are DTensors with ``Shard(0)``: rank k of the shard group holds rows
[k·c, min((k+1)·c, d0)) of each parameter, c = ceil(d0 / F) (``torch.chunk``'s cut; a trailing rank may
hold none). So rank k's *flat shard* is its chunk of every parameter in layout order, each padded to c
rows: S = Σ c·row elements on every rank, equal shards, and each chunk a contiguous run of its
parameter's flattening, so the state-dict and checkpoint code (flat ranges per parameter) serve this
layout unchanged. The unsharded flat stays the parameters concatenated (param-major), so compute views
are zero-copy splits and backward makes one flat gradient, as for ``FlatLayout``; the price is two
copies per unit and step, as in FSDP2: after each all-gather the rank-major buffer (F·S, rank after
rank) is copied into the unsharded flat (``from_rank_major``), and before each reduce-scatter the flat
gradient into a rank-major buffer (``to_rank_major``). 0-D parameters have no dim 0: refused, as FSDP2 does.

[Note: sharded along another dim]
``shard_placement_fn`` may shard a parameter along dim d > 0 (``Shard(d)``, FSDP2's keyword: a row-wise
optimizer, or a dim that divides evenly). Its "rows" are then the slices along d: rank k holds
``torch.chunk(p, F, dim=d)[k]``, stored contiguously in its flat shard in that chunk's own shape (padded
to c slices), so the DTensor's local tensor is a plain view, as for dim 0. The copies between the
param-major flat and the rank-major buffers already exist for every parameter; for such a parameter
they move the F chunks along d (one strided copy when d divides evenly). The one thing that changes is
that a rank's piece is no longer a contiguous run of the parameter's flattening, so ``param_ranges``
(used by the FSDP1 wrapper's state dicts, which never hold this layout) refuses such a parameter.
Unlike FSDP2, which refuses it, an uneven split along d > 0 is accepted: the copies are the same.
"""

from __future__ import annotations

import math
from typing import Literal, Optional

import torch

from flatshard.planner import boundaries as cuts
from flatshard.runtime.layout import ParamInfo


class EqualShards:
    """The sizes of a layout whose F shards all hold ``seg_numel`` elements (the chunked layouts)."""

    seg_numel: int
    shard_size: int
    uniform = True

    @property
    def shard_sizes(self) -> list[int]:
        return [self.seg_numel] * self.shard_size

    @property
    def shard_numel(self) -> int:
        return self.seg_numel

    def shard_numel_of(self, rank: int) -> int:  # noqa: ARG002 - every shard has seg_numel elements
        return self.seg_numel


class ChunkedLayout(EqualShards):
    """Per-rank dim-0 chunks of every parameter (see the Note); the same interface as ``FlatLayout``."""

    boundaries = "chunks"
    rank_major: Literal[True] = True

    def __init__(self, infos: list[ParamInfo], shard_size: int, dims: Optional[list[int]] = None):
        scalars = [i.name for i in infos if len(i.shape) == 0]
        if scalars:  # refused as FSDP2 refuses them, in FSDP2's words
            changes = " ".join(f"Change {name} to a 1D tensor with numel equal to 1." for name in scalars)
            raise ValueError(
                f"fully_shard shards parameters along dim 0, and {scalars} are 0-D. {changes} Or pass them in "
                "ignored_params."
            )
        self.infos = infos
        self.shard_size = shard_size  # F
        self.total = sum(i.numel for i in infos)  # T
        self.padded = self.total  # the unsharded flat: the parameters, param-major, no padding
        self.split_sizes = [i.numel for i in infos] + [0]
        # the dim each parameter is cut along ([Note: sharded along another dim]); its "rows" are slices along it
        self.dims = list(dims) if dims is not None else [0] * len(infos)
        self._index = {id(info): i for i, info in enumerate(infos)}
        self.rows = [i.shape[d] for i, d in zip(infos, self.dims)]
        self.row_numel = [math.prod(i.shape[:d]) * math.prod(i.shape[d + 1 :]) for i, d in zip(infos, self.dims)]
        self.chunk_rows = [cuts.chunk_rows((d0,), shard_size) for d0 in self.rows]  # the planner's cut
        self.seg_offsets, offset = [], 0  # where each parameter's chunk starts in a flat shard
        for c, r in zip(self.chunk_rows, self.row_numel):
            self.seg_offsets.append(offset)
            offset += c * r
        self.seg_numel = offset  # S

    # ---- sizes: EqualShards ----------------------------------------------------------------------------

    @property
    def signature(self) -> str:
        dims = "" if not any(self.dims) else " dims=" + ",".join(map(str, self.dims))
        return f"chunks F={self.shard_size} S={self.seg_numel}{dims}"

    def _rows_of(self, i: int, rank: int) -> int:
        return max(0, min(self.chunk_rows[i], self.rows[i] - rank * self.chunk_rows[i]))

    # ---- where each rank's pieces are ------------------------------------------------------------------
    def local_slices(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its piece (its chunk, unpadded) in rank ``rank``'s flat shard."""
        out = []
        for i in range(len(self.infos)):
            n = self._rows_of(i, rank) * self.row_numel[i]
            out.append((self.seg_offsets[i], self.seg_offsets[i] + n) if n else (0, 0))
        return out

    def param_ranges(self, rank: int) -> list[tuple[int, int]]:
        """For each parameter, the [start, end) of its flattened elements that rank ``rank`` holds."""
        out = []
        for i in range(len(self.infos)):
            if self.dims[i]:
                raise ValueError(
                    f"{self.infos[i].name} is sharded along dim {self.dims[i]}: its piece is not a run of its "
                    "flattened elements. Read fully_shard parameters as DTensors (state_dict(), full_tensor())"
                )
            n = self._rows_of(i, rank) * self.row_numel[i]
            start = rank * self.chunk_rows[i] * self.row_numel[i]
            out.append((start, start + n) if n else (0, 0))
        return out

    def local_shape(self, info: ParamInfo, lo: int, hi: int) -> tuple[int, ...]:
        i = self._index[id(info)]
        row = self.row_numel[i]
        return self._chunk_shape(i, (hi - lo) // row if row else 0)

    def _chunk_shape(self, i: int, rows: int) -> tuple[int, ...]:
        shape = list(self.infos[i].shape)
        shape[self.dims[i]] = rows
        return tuple(shape)

    def _chunks(self, param: torch.Tensor, i: int, rank: int, n_rows: int) -> torch.Tensor:
        """Rank ``rank``'s chunk (``n_rows`` slices along the parameter's dim) of the param-major ``param``."""
        d = self.dims[i]
        return param.view(self.infos[i].shape).narrow(d, rank * self.chunk_rows[i], n_rows)

    def _even_chunks(self, param: torch.Tensor, i: int) -> torch.Tensor:
        """All F chunks of an evenly split parameter along its dim, as an (F, *chunk shape) strided view."""
        d, c = self.dims[i], self.chunk_rows[i]
        return param.view(self.infos[i].shape).unflatten(d, (self.shard_size, c)).movedim(d, 0)

    # ---- moving between the param-major flat and rank-major shards -------------------------------------
    def flatten(self, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The parameters concatenated in layout order (param-major), as the unsharded flat holds them."""
        flat = torch.empty(self.padded, dtype=dtype, device=device)
        for info in self.infos:
            flat[info.offset : info.offset + info.numel].copy_(tensors[info.name].detach().reshape(-1))
        return flat

    def segment(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s flat shard (S elements, padding zero) cut from the param-major ``full``."""
        out = torch.zeros(self.seg_numel, dtype=full.dtype, device=full.device)
        for i, (info, (lo, hi)) in enumerate(zip(self.infos, self.local_slices(rank))):
            if hi > lo:
                param = full[info.offset : info.offset + info.numel]
                n_rows = (hi - lo) // self.row_numel[i]
                out[lo:hi].view(self._chunk_shape(i, n_rows)).copy_(self._chunks(param, i, rank, n_rows))
        return out

    def to_rank_major(
        self, full: torch.Tensor, dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """``full`` (param-major, e.g. the flat gradient) as F·S elements, rank after rank, padding zero, in
        ``dtype`` (the reduce dtype: the copy casts, so no cast of its own follows); into ``out`` (F·S
        elements of that dtype) when given."""
        if out is None:
            out = torch.zeros(self.shard_size, self.seg_numel, dtype=dtype or full.dtype, device=full.device)
        else:
            out = out.view(self.shard_size, self.seg_numel).zero_()
        for i, info in enumerate(self.infos):
            self._move(out, full[info.offset : info.offset + info.numel], i, to_rank_major=True)
        return out.view(-1)

    def from_rank_major(self, staging: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the F·S gathered ``staging`` (rank after rank) into the param-major ``out``."""
        rows = staging.view(self.shard_size, self.seg_numel)
        for i, info in enumerate(self.infos):
            self._move(rows, out[info.offset : info.offset + info.numel], i, to_rank_major=False)

    def _move(self, rank_major: torch.Tensor, param: torch.Tensor, i: int, *, to_rank_major: bool) -> None:
        """Copy parameter ``i`` between its param-major run ``param`` and its F chunks in the (F, S)
        ``rank_major``, either way: one strided copy when its dim splits evenly, else a copy per rank."""
        c, r = self.chunk_rows[i] * self.row_numel[i], self.row_numel[i]
        block = rank_major[:, self.seg_offsets[i] : self.seg_offsets[i] + c]
        if self.chunk_rows[i] * self.shard_size == self.rows[i]:  # even
            chunks = self._even_chunks(param, i)
            block = block.view(chunks.shape)
            (block.copy_(chunks) if to_rank_major else chunks.copy_(block))
            return
        for rank in range(self.shard_size):
            n_rows = self._rows_of(i, rank)
            if n_rows:
                piece = block[rank, : n_rows * r].view(self._chunk_shape(i, n_rows))
                chunk = self._chunks(param, i, rank, n_rows)
                (piece.copy_(chunk) if to_rank_major else chunk.copy_(piece))
