"""Gradient utilities across shards: ``clip_grad_norm_`` and ``no_sync``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
from torch.distributed import ReduceOp

from flatshard.runtime import collectives
from flatshard.runtime.hooks import traced
from flatshard.runtime.schedule import Phase, RunContext


def clip_grad_norm_(
    ctx: RunContext, unmanaged: list[torch.nn.Parameter], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """The global gradient norm, computed from this rank's gradient shards with one all-reduce over the
    shard group (replicas hold identical shards, so each element is counted once), then every gradient
    scaled by ``min(1, max_norm / (norm + 1e-6))``. Parameters flatshard does not manage (ignored
    modules) are replicated: their share is added after the reduction, once."""
    with traced("clip_grad_norm_"):
        return _clip(ctx, unmanaged, max_norm, float(norm_type))


def _clip(ctx: RunContext, unmanaged: list[torch.nn.Parameter], max_norm: float, norm_type: float) -> torch.Tensor:
    sharded = [v.grad for unit in ctx.units for v in unit.shard_views if v.grad is not None]
    local = [p.grad for p in unmanaged if p.grad is not None]
    device = ctx.root.compute_device  # where collectives run (gradient shards are on CPU under CPUOffload)
    total = _partial_norm(sharded, norm_type, device)
    shard_group = ctx.root.groups.shard_group
    if shard_group is not None:
        op = ReduceOp.MAX if math.isinf(norm_type) else ReduceOp.SUM
        with ctx.phase_scope(Phase.OPTIMIZER):
            ctx.record(collectives.all_reduce(total, shard_group, op=op), "shard", "clip_grad_norm_")
    rest = _partial_norm(local, norm_type, device)
    total = torch.maximum(total, rest) if math.isinf(norm_type) else total + rest
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + local:
        g.mul_(coefficient.to(g.device, g.dtype))
    return total


def _partial_norm(grads: list[torch.Tensor], norm_type: float, device: torch.device) -> torch.Tensor:
    """max |g| for the inf-norm, else sum |g|^p, over ``grads``, in fp32."""
    out = torch.zeros((), dtype=torch.float32, device=device)
    for g in grads:
        if g.numel() == 0:
            continue
        g = g.detach().float()
        if math.isinf(norm_type):
            out = torch.maximum(out, g.abs().max().to(device))
        else:
            out = out + (torch.linalg.vector_norm(g, norm_type) ** norm_type).to(device)
    return out


@contextlib.contextmanager
def no_sync(ctx: RunContext) -> Iterator[None]:
    if ctx.phase in (Phase.FORWARD, Phase.BACKWARD):
        raise RuntimeError("no_sync() must be entered outside forward and backward, around both")
    previous = ctx.sync_gradients
    ctx.sync_gradients = False
    try:
        yield
    finally:
        ctx.sync_gradients = previous
