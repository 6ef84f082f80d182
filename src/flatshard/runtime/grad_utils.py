"""Gradient utilities across shards: ``clip_grad_norm_`` and ``no_sync``."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from flatshard.runtime import consistency
from flatshard.runtime.comm import collectives
from flatshard.runtime.consistency import Phase
from flatshard.runtime.instrument import label
from flatshard.runtime.schedule import RunContext


def clip_grad_norm_(
    ctx: RunContext,
    unmanaged: list[torch.nn.Parameter],
    max_norm: float,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
) -> torch.Tensor:
    """The global gradient norm, computed from this rank's gradient shards with one all-reduce over the
    shard group (replicas hold identical shards, so each element is counted once; when the optimizer state
    is split over the replicas, across_replicas.py, a second over the replicate group), then every gradient
    scaled by ``min(1, max_norm / (norm + 1e-6))``. Parameters flatshard does not manage (ignored
    modules) are left whole with gradients it does not reduce: their share is its mean over the ranks,
    added once (one more all-reduce, only when there are such parameters).

    A NaN or inf in any rank's gradients makes the norm non-finite on every rank, for every norm type
    (for the inf-norm the all-reduce carries a NaN flag beside the maximum: a MAX reduction may drop a
    NaN); with ``error_if_nonfinite`` every rank then raises, as ``torch.nn.utils.clip_grad_norm_`` does.
    Every rank returns the same norm, so ``if not torch.isfinite(norm): skip the step`` decides alike."""
    with label("clip_grad_norm_"):
        total = _clip(ctx, unmanaged, max_norm, float(norm_type), error_if_nonfinite)
    return total


def _clip(ctx: RunContext, unmanaged, max_norm: float, norm_type: float, error_if_nonfinite: bool) -> torch.Tensor:
    ctx.recover()  # [Note: a step that raised] (schedule.py)
    open_window = [u.name for u in ctx.units if any(g.grads.marks and g.window_open for g in u.flat_groups)]
    if open_window:  # every rank runs the same loop, so every rank raises here alike
        raise RuntimeError(
            f"clip_grad_norm_ inside an open gradient accumulation window (units {', '.join(open_window)}): "
            "their gradients are still unreduced inside the units ([Note: an open accumulation window]), "
            "so there is nothing right to clip yet. Clip after the synchronised backward (the last "
            "micro-batch, outside no_sync / with set_requires_gradient_sync(True)), before optimizer.step()."
        )
    sharded = [v.grad for unit in ctx.units for g in unit.flat_groups for v in g.shard_views if v.grad is not None]
    local = [p.grad for p in unmanaged if p.grad is not None]
    device = ctx.root.flat_group.compute_device  # where collectives run (gradient shards are on CPU under CPUOffload)
    total = _partial_norm(sharded, norm_type, device)
    groups = ctx.root.flat_group.groups
    across = [(groups.shard_group, "shard")]
    if ctx.root.flat_group.pieces is not None:
        across.append((groups.replicate_group, "replicate"))
    for group, name in across:
        if group is not None:
            total = _reduce(ctx, total, group, name, norm_type)
    if unmanaged:
        # Ignored parameters are left whole and their gradients are not reduced, so each rank's may differ:
        # their share is their mean over the ranks (each rank's own when they agree, as after a DDP
        # all-reduce), one more all-reduce, so every rank gets the same norm and raises alike on a NaN.
        rest = _partial_norm(local, norm_type, device)
        world = groups.process_group
        if world is not None and dist.get_world_size(world) > 1:
            rest = _reduce(
                ctx, rest if math.isinf(norm_type) else rest / dist.get_world_size(world), world, "world", norm_type
            )
        total = torch.maximum(total, rest) if math.isinf(norm_type) else total + rest
    if not math.isinf(norm_type):
        total = total ** (1.0 / norm_type)
    if error_if_nonfinite and not bool(torch.isfinite(total)):
        raise RuntimeError(
            f"The total norm of order {norm_type} for gradients from `parameters` is non-finite, so it cannot be "
            "clipped. To disable this error and scale the gradients by the non-finite norm anyway, set "
            "`error_if_nonfinite=False` (then skip the step when the returned norm is not finite: every rank "
            "gets the same norm)."
        )
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in sharded + local:
        g.mul_(coefficient.to(g.device, g.dtype))
    return total


def _reduce(ctx: RunContext, value: torch.Tensor, group, name: str, norm_type: float) -> torch.Tensor:
    """``value`` (max |g|, or sum |g|^p) combined over ``group``: one all-reduce."""
    # a timeout names the rank and the phase
    errors = consistency.collective_errors(ctx.root.name, str(ctx.phase), "clip_grad_norm_ all_reduce")
    if math.isinf(norm_type):  # [max, NaN seen]: MAX of both; a NaN never rides the maximum itself
        pair = torch.stack([torch.nan_to_num(value, nan=0.0), torch.isnan(value).float()])
        with errors:
            result = collectives.all_reduce(pair, group, op=ReduceOp.MAX)
        value = torch.where(pair[1] > 0, torch.full_like(pair[0], float("nan")), pair[0])
    else:  # a sum carries a NaN or an inf by itself
        with errors:
            result = collectives.all_reduce(value, group, op=ReduceOp.SUM)
    ctx.record(result, name, "clip_grad_norm_", phase=Phase.OPTIMIZER)
    return value


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
    ctx.recover()  # [Note: a step that raised] (schedule.py)
    if ctx.phase in (Phase.FORWARD, Phase.BACKWARD):
        raise RuntimeError("no_sync() must be entered outside forward and backward, around both")
    previous = ctx.sync_gradients
    ctx.sync_gradients = False
    try:
        yield
    finally:
        ctx.sync_gradients = previous
