"""The units under a module: the modules that host them, their names, and a public read-only view.

A front end marks each module that carries a unit as a ``UnitHost`` (the FSDP1 wrapper is one).
Everything below the front ends (state dicts, checkpoints, summon, recorders) finds units through
``unit_hosts`` and ``units_under`` here, never through a front-end class.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.grad_state import local
from flatshard.runtime.unit import Unit

WRAPPED = "_fsdp_wrapped_module"  # the FSDP1 wrapper's child: its name adds nothing to parameter names
CHECKPOINT_WRAPPED = "_checkpoint_wrapped_module"  # torch's checkpoint_wrapper, stripped as PyTorch FSDP does
HOPS = (WRAPPED, CHECKPOINT_WRAPPED)


def clean_name(name: str) -> str:
    """A parameter, buffer or module name as in the unwrapped model."""
    return ".".join(part for part in name.split(".") if part not in HOPS)


if TYPE_CHECKING:  # every host is an nn.Module; the mixin's base says so to the type checker only
    _HostBase = nn.Module
else:
    _HostBase = object


class UnitHost(_HostBase):
    """The ``nn.Module`` that carries one unit (a mixin of the front end's module class).

    Besides ``_unit``, hosts declare what the layers above keep per model, so nothing is stashed in a
    module's ``__dict__`` under a string key: the state-dict settings (state/settings.py), the
    asynchronous save in flight and its process group (checkpoint/save.py), and the bookkeeping of a
    load through a plain parent ([Note: loading through a plain parent], state/module.py)."""

    _unit: Unit
    state_dict_settings: Optional[Any] = None
    pending_save: Optional[Any] = None
    checkpoint_group: Optional[Any] = None
    load_prefix: Optional[str] = None
    loaded_by_outer: bool = False
    applying: bool = False

    def named_parameters(self, *args, **kwargs):
        """The shard views, also right after a forward or backward that raised: a step left interrupted is
        put back first ([Note: a step that raised], schedule.py), so ``model.parameters()`` (torch's
        clip_grad_norm_, ``model.zero_grad()``) never sees a module still holding its compute views."""
        unit = self.__dict__.get("_unit")
        if unit is not None:
            unit.ctx.recover()
        return super().named_parameters(*args, **kwargs)


def unit_hosts(module: nn.Module, root_only: bool = False) -> list[UnitHost]:
    """The hosts at or under ``module``, in ``modules()`` order; with ``root_only``, the outermost ones."""
    hosts = [m for m in module.modules() if isinstance(m, UnitHost)]
    if root_only:
        inner = {id(m) for h in hosts for m in h.modules() if m is not h}
        hosts = [h for h in hosts if id(h) not in inner]
    return hosts


def units_under(module: nn.Module) -> list[Unit]:
    """The units at or under ``module``, each once (the modules of a fully_shard group host one unit)."""
    return list({id(h._unit): h._unit for h in unit_hosts(module)}.values())


# ---- the public view ----------------------------------------------------------------------------
@dataclass(frozen=True)
class FlatGroupInfo:
    """One flat group of a unit (``UnitInfo.flat_groups``): the parameters of one (mesh, dtype), stored as
    one flat shard and gathered by one all-gather over ``shard_group_ranks``. Element counts as in
    ``UnitInfo``, for this group alone."""

    param_names: tuple[str, ...]  # its parameters, relative to the unit's module, in flat order
    numel: int
    padded_numel: int
    shard_numel: int
    shard_sizes: tuple[int, ...]
    local_numel: int
    dtype: torch.dtype  # the master dtype: its parameters' own
    compute_dtype: torch.dtype  # the gathered parameters' dtype
    requires_grad: bool  # whether any of its parameters is trainable: only then is it reduced in backward
    shard_group_ranks: tuple[int, ...] = ()  # global ranks it is sharded over ([Note: a flat group per mesh])

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


@dataclass(frozen=True)
class UnitInfo:
    """One unit as this rank sees it (``flatshard.units(model)``). Element counts are per unit:
    ``numel`` parameter elements T, padded to ``padded_numel`` = F·S, of which this rank's flat
    shard holds ``shard_numel`` = S (``local_numel`` of them real parameter elements, the rest padding).
    With ``shard_boundaries`` "rows" or "params" shards differ in size: ``shard_sizes`` has them all.

    A unit holds one flat group, except a ``fully_shard`` call whose frozen parameters are of another
    dtype than its trainable ones: it holds one flat group per dtype, the trainable dtype's first
    ([Note: a flat group per dtype], runtime/build/grouping.py). ``flat_groups`` describes each; the unit's
    element counts (and ``shard_sizes``, rank by rank) are then the sums over its groups, elements of
    different sizes in bytes, ``param_names`` the groups' names one group after the other, and ``dtype``
    and ``compute_dtype`` the first group's. Parameters placed on a mesh of their own ([Note: a flat group
    per mesh]) are groups of their own too, over their mesh's ranks: ``shard_size``, ``shard_group_ranks``
    and ``shard_sizes`` are the first group's mesh's (its groups' sizes summed); each group's
    ``shard_group_ranks`` and ``shard_sizes`` are its own. For a unit of one group every figure is that group's."""

    name: str  # the unit's module path in the unwrapped model ("<root>" for the root)
    param_names: tuple[str, ...]  # its parameters, relative to its module, in flat order
    numel: int
    padded_numel: int
    shard_numel: int
    shard_sizes: tuple[int, ...]  # every shard rank's flat shard, in rank order
    shard_boundaries: str  # "flat", "rows", "params" ([Note: shard boundaries]) or fully_shard's "chunks"
    local_numel: int
    dtype: torch.dtype  # the master dtype (flat shard, grad shard, optimizer state)
    compute_dtype: torch.dtype  # the gathered parameters' dtype
    shard_size: int  # F
    replicate_size: int  # R = W / F
    shard_rank: int  # this rank's position in its shard group
    replicate_rank: int  # which replica this rank belongs to
    shard_group_ranks: tuple[int, ...]  # global ranks of this rank's shard group, in group order
    is_root: bool
    reshard_after_forward: bool
    flat_groups: tuple[FlatGroupInfo, ...]  # one per flat group: one all-gather each per pass

    @property
    def padding(self) -> int:
        return self.padded_numel - self.numel


def _group_info(group: FlatGroup) -> FlatGroupInfo:
    layout, shard_rank = group.layout, group.groups.shard_rank
    local = sum(hi - lo for lo, hi in group.owner_layout.local_slices(group.owner_rank))  # what the shard views hold
    return FlatGroupInfo(
        param_names=tuple(i.name for i in layout.infos),
        numel=layout.total,
        padded_numel=layout.padded,
        shard_numel=layout.shard_numel_of(shard_rank),
        shard_sizes=tuple(layout.shard_sizes),
        local_numel=local,
        dtype=group.precision.master,
        compute_dtype=group.precision.compute,
        requires_grad=group.requires_grad,
        shard_group_ranks=_ranks(group.groups.shard_group),
    )


def unit_info(unit: Unit) -> UnitInfo:
    infos = tuple(_group_info(g) for g in unit.flat_groups)
    first = unit.flat_groups[0]
    groups = first.groups
    return UnitInfo(
        name=unit.name,
        param_names=tuple(n for g in infos for n in g.param_names),
        numel=sum(g.numel for g in infos),
        padded_numel=sum(g.padded_numel for g in infos),
        shard_numel=sum(g.shard_numel for g in infos),
        shard_sizes=tuple(
            map(sum, zip(*(g.shard_sizes for g in infos if g.shard_group_ranks == infos[0].shard_group_ranks)))
        ),
        shard_boundaries=first.layout.boundaries,
        local_numel=sum(g.local_numel for g in infos),
        dtype=infos[0].dtype,
        compute_dtype=infos[0].compute_dtype,
        shard_size=groups.shard_size,
        replicate_size=groups.replicate_size,
        shard_rank=groups.shard_rank,
        replicate_rank=groups.replicate_rank,
        shard_group_ranks=_ranks(groups.shard_group),
        is_root=unit.is_root,
        reshard_after_forward=unit.settings.reshard_after_forward,
        flat_groups=infos,
    )


def is_whole(p: torch.Tensor) -> bool:
    """Whether a parameter is whole on this rank: a plain parameter, or a shard view of all of it."""
    shape = getattr(p, "orig_shape", None)
    if shape is None:
        return True
    return tuple(p.shape) == tuple(shape) or (len(shape) == 0 and p.numel() == 1)


def owned_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """Under ``shard_boundaries="params"``: this rank's ``(name, parameter)`` pairs, each whole and in its
    full shape (parameters no unit manages, held whole by every rank, included), for optimizers that
    step whole tensors locally: ``Muon([p for _, p in owned if p.ndim == 2])`` and ``AdamW`` for the rest.
    Each parameter is owned by exactly one rank of its shard group (every replica has its owner)."""
    units = units_under(module)
    other = sorted({g.layout.boundaries for u in units for g in u.flat_groups} - {"params"})
    if other:
        names = [u.name for u in units if any(g.layout.boundaries != "params" for g in u.flat_groups)][:5]
        raise ValueError(
            f'owned_named_parameters needs every unit built with shard_boundaries="params"; units {names} use '
            f'{other}. Wrap with FullyShardedDataParallel(..., shard_boundaries="params") or fully_shard(..., '
            'shard_boundaries="params"): each parameter then lives whole on one rank.'
        )
    for name, p in module.named_parameters():  # fully_shard's DTensors: empty on every rank but the owner
        if local(p).numel() and is_whole(p):
            yield clean_name(name), p


def _ranks(group) -> tuple[int, ...]:
    if group is None:
        return (torch.distributed.get_rank(),) if torch.distributed.is_initialized() else (0,)
    return tuple(torch.distributed.get_process_group_ranks(group))


def units(module: nn.Module) -> list[UnitInfo]:
    """Every unit at or under ``module`` (root first, in module order), as read-only ``UnitInfo``."""
    return [unit_info(u) for u in units_under(module)]
