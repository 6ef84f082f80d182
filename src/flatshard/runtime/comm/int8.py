"""The block-wise int8 codec of what crosses the node boundary (``compress_inter_node="int8"``):
``quantize`` / ``dequantize``, which the point-to-point exchanges (comm/gloo_exchange.py) apply to the messages
sent to a peer on another node (nodes.py says which), and ``check``, the keyword's validation.

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

from typing import Optional

import torch
import torch.distributed as dist

from flatshard.api import NotBuiltError
from flatshard.runtime.comm.nodes import InterNode, Nodes

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
