"""Gradients and optimizer state over every rank of a hybrid model, parameters over the node.

[Note: optimizer state across replicas]
``shard_optimizer_across_replicas=True`` with HYBRID_SHARD or _HYBRID_SHARD_ZERO2 (shard groups of F
ranks, a node; R = W / F replicas): parameters are sharded and gathered inside the shard group as the
hybrid strategy does, while gradient shards and optimizer state are split over all W ranks, so a rank
holds T/F parameter elements but only T/W gradient and optimizer elements (AdamW: 4·T/F + 12·T/W bytes,
against HYBRID_SHARD's 16·T/F and FULL_SHARD's 16·T/W).
* Two layouts of the same flat. The *owner layout* is the ``"flat"`` layout over all W ranks: S_w =
  ceil(T / W) elements each, owner rank v = shard_rank·R + replicate_rank. The shard group's layout
  (``FlatLayout(..., replicas=R)``) gives shard rank p the elements [p·R·S_w, (p+1)·R·S_w): the owner
  shards pR, ..., pR+R-1 one after another. So this rank's *owned piece* is the slice
  [r·S_w, (r+1)·S_w) of its flat shard (r its replicate rank), and ranks of one replicate group (the
  same shard rank on every replica) own the R pieces of the same flat shard.
* The shard views, and so ``named_parameters()``, the optimizer and its state, view the piece
  (``Unit.owned``, laid out by ``Unit.owner_layout`` at ``Unit.owner_rank``); the grad shard is
  piece-sized; state dicts and checkpoints read and write pieces, as they would a FULL_SHARD model's
  shards over W ranks.
* Backward: the reduce-scatter inside the shard group as for HYBRID_SHARD (the full-size gradient to
  S elements), then a reduce-scatter across the replicas (S to the S_w piece) where HYBRID_SHARD
  all-reduces: (R-1)·S_w elements sent per rank, half the all-reduce's, left in flight as the
  all-reduce would be ([Note: reductions in flight], schedule.py). The R contributions are summed by
  the same exchange as any reduce-scatter; the piece is divided by W.
* After the optimizer writes the pieces, the rest of each flat shard is out of date: when the root's
  forward begins, every unit whose pieces may have changed issues an all-gather of the pieces across
  the replicas into its flat shard (the other (R-1)·S_w elements), and a unit's gather inside the shard
  group waits for its own first. Which units: every unit after a backward that synchronised its
  gradients (``dirty``: the optimizer steps next), and otherwise every unit whose owned piece differs on
  any rank from what it was at the last sync, by a fingerprint of its bits (two 64-bit sums, plain and
  position-weighted) and one small all-reduce of a flag per unit over the model's ranks, so every rank
  decides alike. That catches what no version counter sees: fused optimizers (``AdamW(fused=True)``)
  and writes through ``p.data`` leave the flat shard's version unchanged, and a version-based check
  silently trained on stale pieces. With nothing changed (evaluation, ``generate``) only the flags cross.
* Bytes across the replicas per step: the same as HYBRID_SHARD's all-reduce, half of them moved into
  the next forward, where they overlap the first units' compute.
* ``fully_shard`` (its keyword ``shard_optimizer_across_replicas=True`` on a 2-D mesh): the same pieces in
  FSDP2's chunked layout ([Note: chunked layout], chunked.py), see ``ReplicaChunkedLayout``.
Not built with it: ``"rows"``/``"params"`` boundaries, CPU offload and ``compress_inter_node`` (each raises
NotBuiltError); F = 1 or R = 1 is refused (nothing to split).

[Note: pieces in the chunked layout]
Under ``fully_shard`` the optimizer must see DTensors that PyTorch's tools read (``clip_grad_norm_``,
``full_tensor()``, DCP). A piece of the chunked layout over F ranks would cut parameters anywhere, so the
owner layout is instead the chunked layout over all W ranks (each parameter in W dim-0 chunks of
ceil(d0 / W) rows, ``torch.chunk``'s cut), and owner rank v = r·F + p (r the replicate rank, p the shard
rank): the order of the 2-D mesh flattened, so a parameter is a DTensor ``Shard(dim)`` on ``mesh._flatten()``,
a mesh PyTorch builds itself. Shard rank p's flat shard holds the owner shards p, F+p, ..., (R-1)·F+p one
after another, so piece r is again the slice [r·S_w, (r+1)·S_w). The rank-major buffers of the shard
group's all-gather and reduce-scatter (F blocks of R·S_w) are the owner layout's (W blocks of S_w) with the
two block indices swapped: one more copy each way than the chunked layout makes. Why not v = p·R + r, the
wrapper's order, which needs no swap: its DTensor mesh would be a permutation of the flattened mesh, which
``DeviceMesh`` cannot build over the whole world (it takes the default group, whose rank order differs).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch

from flatshard.runtime.chunked import ChunkedLayout, EqualShards
from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.streams import Lane, Streams
from flatshard.runtime.layout import FlatLayout, ParamInfo


@dataclass
class Pieces:
    """A unit's owned piece of its flat shard, and the all-gather that brings the other replicas' pieces."""

    layout: FlatLayout | ChunkedLayout  # the owner layout over all W ranks
    rank: int  # this rank's owner rank v = shard_rank * R + replicate_rank
    replicate_rank: int  # r: which piece of the flat shard this rank owns
    replicate_size: int  # R
    group: Any  # the replicate group: the ranks owning the pieces of this flat shard
    global_ranks: list[int]  # the global rank of every owner rank, in owner order
    dirty: bool = False  # gradients were exposed: the optimizer may have stepped the piece since the last sync
    synced: Optional[tuple[int, int]] = None  # the owned piece's fingerprint at the last sync
    pending: Optional[tuple] = field(default=None, repr=False)  # (work, source, event) in flight

    @property
    def numel(self) -> int:
        """S_w, the elements of every piece."""
        return self.layout.shard_numel

    def piece(self, flat_shard: torch.Tensor) -> torch.Tensor:
        return flat_shard[self.replicate_rank * self.numel : (self.replicate_rank + 1) * self.numel]

    def changed(self, flat_shard: torch.Tensor) -> bool:
        """Whether this rank's piece differs from what it was at the last sync (by its fingerprint)."""
        return self.synced != fingerprint(self.piece(flat_shard))

    def start_sync(self, flat_shard: torch.Tensor, tag: int, record: Callable, errors, streams: Streams) -> None:
        """Issue the all-gather of the pieces into ``flat_shard``, on the gather stream after compute's event
        ([Note: stream discipline], comm/streams.py). Written through ``.data``, so no autograd view of the flat
        shard is disturbed; the piece's fingerprint is taken while the pieces travel."""
        target = flat_shard.data
        source = self.piece(target)
        sizes = [self.numel] * self.replicate_size
        streams.order(Lane.COMPUTE, Lane.GATHER)
        with streams.on(Lane.GATHER), torch.profiler.record_function("flatshard::all_gather_pieces"):
            streams.use(Lane.GATHER, flat_shard, "write", "flat shard (the replicas' pieces)")
            with errors("all_gather"):
                async_op = streams.host_ordered
                result = collectives.all_gather(target, source, self.group, async_op=async_op, tag=tag, sizes=sizes)
        record(result, "replicate")
        self.pending = (result.work, source, streams.record(Lane.GATHER))
        self.dirty = False
        self.synced = fingerprint(source)

    def finish_sync(self, errors, streams: Streams) -> None:
        """Compute waits for the pieces' all-gather in flight, if one is."""
        if self.pending is not None:
            work, _source, event = self.pending
            if work is not None:
                with errors("all_gather"):
                    work.wait()
            streams.wait(Lane.COMPUTE, event)
            self.pending = None

    def gather(self, owned: torch.Tensor, tag: int, record: Callable, errors) -> torch.Tensor:
        """The replicas' ``owned``-shaped tensors (a piece each: parameters, gradients or optimizer state)
        side by side: one tensor laid out like the flat shard."""
        out = torch.empty(self.numel * self.replicate_size, dtype=owned.dtype, device=owned.device)
        sizes = [self.numel] * self.replicate_size
        with errors("all_gather"):
            result = collectives.all_gather(out, owned.contiguous(), self.group, tag=tag, sizes=sizes)
        record(result, "replicate")
        return out


class ReplicaChunkedLayout(EqualShards):
    """The shard group's layout under fully_shard with pieces ([Note: pieces in the chunked layout]): shard
    rank p's flat shard is the owner shards r·F + p of ``owner`` (the chunked layout over W), r = 0..R-1.
    The same interface as ``ChunkedLayout``, whose arithmetic it reuses."""

    boundaries = "chunks"
    rank_major: Literal[True] = True

    def __init__(self, owner: ChunkedLayout, shard_size: int, replicas: int):
        self.owner = owner
        self.shard_size, self.replicas = shard_size, replicas  # F, R
        self.infos, self.total, self.padded = owner.infos, owner.total, owner.padded
        self.split_sizes, self.dims = owner.split_sizes, owner.dims
        self.seg_numel = replicas * owner.seg_numel  # R·S_w

    @property
    def signature(self) -> str:
        return f"{self.owner.signature} R={self.replicas}"

    def local_slices(self, rank: int) -> list[tuple[int, int]]:
        """Piece 0's slices (a parameter has R runs in a flat shard; the shard views use the owner layout's)."""
        return self.owner.local_slices(rank)

    def param_ranges(self, rank: int) -> list[tuple[int, int]]:  # noqa: ARG002 - refused
        raise ValueError(
            "a fully_shard flat shard with pieces across replicas holds R runs of each parameter: read the "
            "parameters as DTensors (state_dict(), full_tensor())"
        )

    def local_shape(self, info: ParamInfo, lo: int, hi: int) -> tuple[int, ...]:
        return self.owner.local_shape(info, lo, hi)

    def flatten(self, tensors: dict[str, torch.Tensor], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return self.owner.flatten(tensors, dtype=dtype, device=device)

    def segment(self, full: torch.Tensor, rank: int) -> torch.Tensor:
        """Shard rank ``rank``'s flat shard (R owner shards) cut from the param-major ``full``."""
        f = self.shard_size
        return torch.cat([self.owner.segment(full, r * f + rank) for r in range(self.replicas)])

    def _swap(self, blocks: torch.Tensor, outer: int, inner: int) -> torch.Tensor:
        """(outer, inner, S_w) blocks as (inner, outer, S_w), contiguous, flattened."""
        return blocks.view(outer, inner, self.owner.seg_numel).transpose(0, 1).reshape(-1)

    def to_rank_major(
        self, full: torch.Tensor, dtype: Optional[torch.dtype] = None, out: Optional[torch.Tensor] = None
    ) -> torch.Tensor:
        """The owner layout's W blocks (v = r·F + p) as F blocks of R (p after p); into ``out`` when given (a
        custom reduce-scatter's buffer: [Note: custom collectives], reduce.py)."""
        swapped = self._swap(self.owner.to_rank_major(full, dtype), self.replicas, self.shard_size)
        if out is None:
            return swapped
        return out.view(-1).copy_(swapped.view(-1))

    def from_rank_major(self, staging: torch.Tensor, out: torch.Tensor) -> None:
        self.owner.from_rank_major(self._swap(staging, self.shard_size, self.replicas), out)


_CHUNK = 1 << 20  # elements fingerprinted at a time (bounds the int64 copies to 8 MiB each)
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def fingerprint(piece: torch.Tensor) -> tuple[int, int]:
    """Two 64-bit sums of ``piece``'s bits: plain, and weighted by position. A changed value, or a value
    moved, changes them (barring a collision of both sums, mod 2^64); the same bits give the same pair on
    every device. Exact integers, so the order of summation does not matter."""
    bits = piece.detach().reshape(-1).view(_BITS[piece.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=piece.device)
    weighted = torch.zeros((), dtype=torch.int64, device=piece.device)
    for lo in range(0, bits.numel(), _CHUNK):
        chunk = bits[lo : lo + _CHUNK].to(torch.int64)
        total += chunk.sum()
        weighted += (chunk * torch.arange(lo + 1, lo + 1 + chunk.numel(), device=piece.device)).sum()
    return int(total), int(weighted)
