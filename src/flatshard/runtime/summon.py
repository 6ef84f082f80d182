"""``summon_full_params``: every unit's full parameters on its modules, for reading or editing.

Each unit's flat shards are gathered in the *master* dtype (fp32 under bf16 mixed precision: what the
optimizer steps, never the compute copy) into a buffer of their own; the unit's unsharded flat is not
touched, so the unit stays resharded throughout. Inside the block each module's parameters are
``nn.Parameter`` views of that buffer, so in-place edits land there; on exit with ``writeback=True``
each rank copies its slice back into its flat shard. With F = 1 (and no offload) the buffer is the
flat shard itself: edits land in place, with or without writeback, as in PyTorch FSDP.

``rank0_only``: every rank takes part in the gathers, only global rank 0 keeps the full parameters; the
others keep their shard views. ``offload_to_cpu``: the full parameters are copied to CPU memory (one
unit at a time) and the gathered buffer on the compute device is freed. ``with_grads``: the gradient
shards are gathered the same way and set as the full parameters' ``.grad`` (a parameter whose shard
view has no gradient gets none: ranks agree, since reductions give every trainable view one); gradients
are for reading, never written back.

[Note: forward inside summon_full_params]
A forward that runs inside the block (Hugging Face's ``generate`` on the wrapped model, the
"generate, then sync the weights" pattern) computes with the summoned parameters as they are: a unit
whose modules hold them neither gathers nor puts shard views back, so they stay in place for reading
and editing after the forward, and no collective runs (``rank0_only``: only rank 0 may run it). The
summoned parameters are the fp32 masters, and under mixed precision the forward computes in fp32 with
them: the policy's cast is per unit, and a forward that enters through the wrapped module (``generate``
calls the inner model) would meet fp32 activations from units that never cast. Gradients of such a
forward land on the summoned parameters and are not reduced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from flatshard.runtime.consistency import Phase
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.grad_state import local
from flatshard.runtime.instrument import label
from flatshard.runtime.layout import make_compute_views, set_views_on_modules
from flatshard.runtime.schedule import run_context
from flatshard.runtime.unit import Unit


@contextlib.contextmanager
def summon(
    units: list[Unit], *, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
) -> Iterator[None]:
    if rank0_only and writeback:
        raise ValueError(
            "summon_full_params(rank0_only=True, writeback=True): only rank 0 would hold the full "
            "parameters, so the other ranks' shards could not be written back. Pass writeback=False."
        )
    for unit in units:
        unit.ctx.start()
        unit.ctx.recover()  # [Note: a step that raised] (schedule.py)
        if unit.ctx.phase in (Phase.FORWARD, Phase.BACKWARD):
            raise RuntimeError("summon_full_params cannot be used during forward or backward; call it between steps")
    keep = not rank0_only or not dist.is_initialized() or dist.get_rank() == 0
    phase = run_context(units[0]).phase_scope(Phase.SUMMON) if units else contextlib.nullcontext()
    held: list[Optional[torch.Tensor]] = []
    with label("summon_full_params"), phase:
        for unit in units:
            group = unit.flat_group
            full = group.gather_owned(group.owned)
            grads = group.gather_owned(_grad_shard(group)) if with_grads else None
            if offload_to_cpu:
                full = full.cpu() if full.device.type != "cpu" else full
                grads = grads.cpu() if grads is not None and grads.device.type != "cpu" else grads
            if not keep:
                held.append(None)
                continue
            layout = group.layout
            params = [
                nn.Parameter(v, requires_grad=i.requires_grad)
                for v, i in zip(make_compute_views(layout, full), layout.infos)
            ]
            if grads is not None:
                for p, g, view in zip(params, make_compute_views(layout, grads), group.shard_views):
                    p.grad = g if view.grad is not None else None
            set_views_on_modules(layout, params, as_params=True)
            unit.summoned = True
            held.append(full)
    try:
        yield
    finally:
        for unit, gathered in zip(units, held):
            if gathered is None:
                continue
            unit.summoned = False
            group = unit.flat_group
            if writeback and gathered.untyped_storage().data_ptr() != group.flat_shard.untyped_storage().data_ptr():
                with torch.no_grad():
                    group.flat_shard.copy_(group.layout.segment(gathered, group.groups.shard_rank))
            set_views_on_modules(group.layout, group.shard_views, as_params=True)


def _grad_shard(group: FlatGroup) -> torch.Tensor:
    """This rank's gradient laid out like what its shard views own (zeros where a view has no gradient)."""
    out = torch.zeros_like(group.owned)
    for view, (lo, hi) in zip(group.shard_views, group.owner_layout.local_slices(group.owner_rank)):
        if view.grad is not None:
            out[lo:hi].copy_(local(view.grad).reshape(-1))
    return out
