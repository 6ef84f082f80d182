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
Not built with it: ``"rows"``/``"params"`` boundaries, CPU offload, ``compress_inter_node`` and the
``fully_shard`` front end (each raises NotBuiltError); F = 1 or R = 1 is refused (nothing to split).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from flatshard.runtime.comm import collectives
from flatshard.runtime.comm.streams import Lane, Streams
from flatshard.runtime.layout import FlatLayout


@dataclass
class Pieces:
    """A unit's owned piece of its flat shard, and the all-gather that brings the other replicas' pieces."""

    layout: FlatLayout  # the owner layout over all W ranks
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
