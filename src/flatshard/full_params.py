"""``summon_full_params``: every unit gathered, modules holding full-shape parameters, for reading or editing.

Inside the block each module's parameters are ``nn.Parameter`` views of the unit's unsharded flat,
so in-place edits land there; on exit with ``writeback=True`` each rank copies its slice back into
its flat shard. The units are then resharded and the shard views put back.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from flatshard.api import NotBuiltError
from flatshard.flat_param import make_compute_views, set_views_on_modules


@contextlib.contextmanager
def summon(wrappers: list, *, writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool) -> Iterator[None]:
    if rank0_only or with_grads:
        raise NotBuiltError(
            "summon_full_params(rank0_only=True / with_grads=True) is not built yet in flatshard; call it with "
            "the defaults (every rank gets the full parameters)."
        )
    units = [w._unit for w in wrappers]
    if offload_to_cpu and any(u.compute_device.type != "cpu" for u in units):
        raise NotBuiltError("summon_full_params(offload_to_cpu=True) is not built yet for accelerator devices.")
    for unit in units:
        if unit.ctx is not None and unit.ctx.phase in ("forward", "backward"):
            raise RuntimeError("summon_full_params cannot be used during forward or backward; call it between steps")
    phase = units[0].ctx.phase_scope("other") if units and units[0].ctx is not None else contextlib.nullcontext()
    with phase:
        for unit in units:
            unit.unshard()
            full = [nn.Parameter(v, requires_grad=i.requires_grad)
                    for v, i in zip(make_compute_views(unit.layout, unit.unsharded.detach()), unit.layout.infos)]
            set_views_on_modules(unit.layout, full, as_params=True)
    try:
        yield
    finally:
        for unit in units:
            if writeback and unit.groups.shard_size > 1:
                S, rank = unit.layout.shard_numel, unit.groups.shard_rank
                with torch.no_grad():
                    unit.flat_shard.copy_(unit.unsharded.detach()[rank * S : (rank + 1) * S])
            set_views_on_modules(unit.layout, unit.shard_views, as_params=True)
            unit.reshard()
