"""The node boundary: which peers of a group are on another node, and int8 compression of what crosses.

``Nodes`` says which ranks share a node (``ranks_per_node``, torchrun's ``LOCAL_WORLD_SIZE`` by
default, ranks numbered node after node as torchrun numbers them); ``InterNode`` is what one unit's
groups send across it. ``quantize`` / ``dequantize`` are the block-wise int8 codec the point-to-point
exchanges (gloo_exchange.py) apply to the messages that cross, when ``compress_inter_node="int8"``.

[Note: inter-node compression]
ZeRO++'s idea (qwZ for weights, qgZ for gradients) on flatshard's point-to-point exchanges: a tensor
sent to a rank on another node goes as int8 with one fp32 scale per block of ``BLOCK`` elements
(symmetric: scale = max |x| of the block / 127, values rounded to the nearest step), and the receiver
dequantises it before adding or storing it; a message to a rank on the same node is sent as it is.
* Weight all-gathers of a shard group that spans nodes: each rank sends its flat shard as int8 to the
  peers on other nodes. A rank then computes with the exact shards of its own node and the
  dequantised shards of the others (the flat shards, the master weights, are never rounded); forward
  and backward gather the same values, so the gradient is that of the weights the forward used.
  summon_full_params, state dicts and checkpoints gather exactly.
* Gradient reduce-scatters of a shard group that spans nodes: each chunk sent to another node goes as
  int8; the owner dequantises and adds in the same order as the exact exchange.
* The replicate all-reduce across nodes: every rank of the replicate group sends its reduced shard,
  quantised, to every other (an all-gather of int8), and each rank sums the dequantised
  contributions, its own included, in group-rank order: every replica ends with the same bits, so
  the replicas' parameters never drift apart. It sends (R - 1)·(S + 4·S/BLOCK) bytes per rank against
  the ring's 2·(R - 1)/R·4·S: fewer bytes for R < 8 replicas (the keyword refuses more).
Each contribution is rounded once, by at most half a step of its block; a block holding an inf or a
NaN dequantises to NaN (non-finite gradients stay visible to clip_grad_norm_ and loss scalers).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flatshard.api import NotBuiltError

BLOCK = 256  # elements per scale: 4 bytes of scale per 256 of int8, 1.6% over the payload
MODES = ("int8",)
MAX_REPLICAS = 7  # from 8 replicas on, the int8 all-gather sends more bytes than the fp32 ring all-reduce


def packed_nbytes(numel: int) -> int:
    """Bytes of ``numel`` elements quantised: one fp32 scale per block, one int8 per element."""
    return 4 * -(-numel // BLOCK) + numel


def quantize(x: torch.Tensor) -> torch.Tensor:
    """``x`` (1-D, any floating dtype) as one uint8 message: the blocks' fp32 scales, then the int8 values."""
    n = x.numel()
    blocks = -(-n // BLOCK)
    packed = torch.empty(4 * blocks + n, dtype=torch.uint8, device=x.device)
    if n == 0:
        return packed
    scales = packed[: 4 * blocks].view(torch.float32)
    padded = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n].copy_(x)
    rows = padded.view(blocks, BLOCK)
    torch.div(rows.abs().amax(dim=1), 127.0, out=scales)
    steps = torch.where(scales > 0, scales, torch.ones_like(scales))
    rows.div_(steps[:, None]).round_().clamp_(-127, 127)
    packed[4 * blocks :].view(torch.int8).copy_(padded[:n])
    return packed


def dequantize(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The fp32 values of a message ``quantize`` made from ``numel`` elements."""
    blocks = -(-numel // BLOCK)
    scales = packed[: 4 * blocks].view(torch.float32)
    out = torch.zeros(blocks * BLOCK, dtype=torch.float32, device=packed.device)
    out[:numel].copy_(packed[4 * blocks :].view(torch.int8))
    out.view(blocks, BLOCK).mul_(scales[:, None])
    return out[:numel]


# ---- which ranks share a node -------------------------------------------------------------------------
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


def check(mode: Optional[str], inter: InterNode, nodes: Nodes, replicate_size: int, device: torch.device) -> None:
    """``compress_inter_node``: a mode flatshard has, on a path that can apply it, with traffic to compress."""
    if mode is None:
        return
    if mode not in MODES:
        raise ValueError(f"compress_inter_node must be one of {MODES} or None; got {mode!r}")
    if device.type != "cpu" or "gloo" not in str(dist.get_backend()):
        raise NotBuiltError(
            f'compress_inter_node="{mode}" is built for gloo\'s point-to-point exchanges (CPU tensors); on '
            f"{dist.get_backend()} with {device.type} tensors it is not built. Drop the keyword, or use "
            "MixedPrecision(reduce_dtype=torch.bfloat16) to halve the reduction's bytes."
        )
    if not inter.crosses:
        raise ValueError(
            f'compress_inter_node="{mode}" compresses traffic between nodes, and this model\'s groups have none: '
            f"every rank it exchanges with is on its own node ({nodes.size} ranks per node, from {nodes.source}). "
            "Pass ranks_per_node=<ranks on one node> if the nodes are smaller, or drop the keyword."
        )
    if inter.replicate_spans and replicate_size > MAX_REPLICAS:
        raise NotBuiltError(
            f'compress_inter_node="{mode}" reduces across replicas by an all-gather of int8, which sends more '
            f"than the fp32 ring all-reduce from 8 replicas on; this model has {replicate_size}. Use fewer "
            "replicas (a larger sharding_factor) or drop the keyword."
        )
