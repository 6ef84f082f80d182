"""What a ``fully_shard`` unit keeps after forward when it reshards to a smaller group.

[Note: reshard after forward to a smaller group]
FSDP2's ``reshard_after_forward=g`` (1 < g < F): after forward a unit keeps 1/g of its unsharded flat
instead of nothing, and backward gathers it within a group of g consecutive ranks of the shard group
(a node, say) instead of the whole shard group. The unsharded flat is the same on every rank, so rank
r keeps piece r mod g of it (pieces of ceil(T / g) elements, the last shorter); the gather is a
ragged all-gather of those pieces straight into the unsharded flat. If the flat shard changed in
between (the parameters were written), the piece is stale and the unit gathers from the flat shards.
The groups of g ranks are made once per mesh and g, and shared by every unit of that mesh and g
(fsdp2/frontend.py): one set per ``fully_shard`` call would leave a model of L blocks with L·W/g groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class PostForwardGroup:
    group: Any  # the process group of this rank's g consecutive shard ranks
    size: int  # g
    rank: int  # this rank's position in it
    sizes: list[int]  # every piece's length

    @classmethod
    def of(cls, group, size: int, rank: int, total: int) -> PostForwardGroup:
        piece = -(-total // size)
        sizes = [max(0, min(piece, total - k * piece)) for k in range(size)]
        return cls(group, size, rank, sizes)

    def piece(self, unsharded: torch.Tensor) -> torch.Tensor:
        start = sum(self.sizes[: self.rank])
        return unsharded[start : start + self.sizes[self.rank]]
