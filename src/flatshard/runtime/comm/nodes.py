"""The node boundary: which ranks share a node, and which peers of a unit's groups are on another one.

``Nodes`` says which ranks share a node (``ranks_per_node``, torchrun's ``LOCAL_WORLD_SIZE`` by
default, ranks numbered node after node as torchrun numbers them); ``InterNode`` is what one flat
group's collectives send across it, and whether that goes as int8 ([Note: inter-node compression], int8.py).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup


@dataclass(frozen=True)
class Nodes:
    """Ranks ``k·size`` … ``(k+1)·size - 1`` (global ranks) share node k."""

    size: int
    source: str  # where ``size`` came from, for messages

    @classmethod
    def resolve(cls, ranks_per_node: Optional[int]) -> Nodes:
        world = dist.get_world_size()
        if ranks_per_node is None:
            local = os.environ.get("LOCAL_WORLD_SIZE")
            if local is None:
                return cls(world, "one node: not started by torchrun and no ranks_per_node given")
            ranks_per_node, source = int(local), f"LOCAL_WORLD_SIZE={local}"
        else:
            source = f"ranks_per_node={ranks_per_node}"
        if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
            raise TypeError(f"ranks_per_node must be a positive int (ranks on one node); got {ranks_per_node!r}")
        if world % ranks_per_node:
            raise ValueError(
                f"{source} does not divide the world size {world}: nodes must hold the same number of ranks "
                "(pass ranks_per_node=<ranks on one node>)"
            )
        return cls(ranks_per_node, source)

    def remote(self, group: Optional[ProcessGroup]) -> tuple[bool, ...]:
        """For each rank of ``group`` (group-rank order): whether it is on another node than this rank."""
        if group is None:
            return ()
        mine = dist.get_rank() // self.size
        return tuple(r // self.size != mine for r in dist.get_process_group_ranks(group))


@dataclass(frozen=True)
class InterNode:
    """What one unit's collectives send across the node boundary, and whether that goes compressed."""

    shard_remote: tuple[bool, ...]  # per shard-group rank: on another node (empty when F == 1)
    replicate_remote: tuple[bool, ...]  # per replicate-group rank (empty when R == 1)
    compress: bool  # compress_inter_node="int8"

    @property
    def shard_spans(self) -> bool:
        return any(self.shard_remote)

    @property
    def replicate_spans(self) -> bool:
        return any(self.replicate_remote)

    @property
    def crosses(self) -> bool:
        return self.shard_spans or self.replicate_spans

    def gather_remote(self) -> Optional[tuple[bool, ...]]:
        """The shard group's peers an all-gather or reduce-scatter sends int8 to (None: send every one exactly)."""
        return self.shard_remote if self.compress and self.shard_spans else None

    @property
    def compress_replicate(self) -> bool:
        return self.compress and self.replicate_spans


LOCAL = InterNode((), (), False)  # a unit whose groups stay on one node (or that has no groups)


def inter_node(shard_group, replicate_group, nodes: Nodes, compress: Optional[str]) -> InterNode:
    return InterNode(nodes.remote(shard_group), nodes.remote(replicate_group), compress is not None)
