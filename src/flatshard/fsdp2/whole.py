"""``fully_shard(module, shard_boundaries="params")``: every parameter whole on one rank.

[Note: whole parameters on fully_shard]
Under ``shard_boundaries="params"`` a unit is built in the engine's ``"params"`` layout ([Note: shard
boundaries], runtime/layout.py): parameters dealt to the ranks of the shard dim largest first, each to
the rank holding fewest elements so far, counting the units of every earlier ``fully_shard`` call on
the same ranks that are still alive (``loads_of``; the blocks of a model are sharded before its root,
each call knowing nothing of the others), so the model's bytes per rank balance though one block's
cannot. Gathers and
reductions are the engine's, unchanged: one all-gather and one reduce-scatter per unit and pass, of
ragged shards.

What users and PyTorch's tools see is the choice made here. Each parameter is a DTensor on a one-rank
mesh of its owner, ``Replicate()``: its local tensor is the whole parameter (a view of the flat shard)
on the owner and an empty tensor on every other rank, which DTensor treats as a rank outside the
mesh. Two alternatives were weighed:

* a DTensor over the whole shard mesh whose local tensor is whole on the owner and empty elsewhere:
  no placement says so (``Shard(0)`` means ``torch.chunk``'s cut), so ``torch.distributed.checkpoint``
  would compute every rank's offsets wrong and ``full_tensor()`` would gather the wrong rows;
* plain tensors (empty on non-owners): DCP takes plain tensors as replicated and would save the
  owner's and a non-owner's alike under one key.

The one-rank mesh is what DTensor and DCP already understand: ``compute_local_shape_and_global_offset``
gives the owner the whole tensor at offset 0 and the others nothing, so ``dcp.save`` writes each
matrix once, from its owner, and ``dcp.load`` fills the owners of another layout (another W). The
meshes are made without process groups (``_init_backend=False``): a one-rank mesh with ``Replicate()``
never communicates, and no ``new_group`` call has to be made collectively. Optimizers: torch.optim's
ops on such a DTensor run on its local tensor, so an unmodified ``Muon``, ``Adafactor`` or
``AdamW`` steps the owner's matrices locally, its state DTensors on the same mesh (which DCP's
``get_optimizer_state_dict`` saves). Give it this rank's parameters (``flatshard.owned_named_parameters``);
parameters of other ranks are empty DTensors, whose ops do nothing. The cost: torch's
``clip_grad_norm_`` stacks per-parameter norms of different meshes, which DTensor refuses, and its
norm would be this rank's only; ``clip_grad_norm_`` below computes the global norm with one
all-reduce over the shard mesh. ``full_tensor()`` on a non-owner returns an empty tensor (no
collective reaches it); a full state dict needs each matrix broadcast from its owner, not built.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from flatshard.api import NotBuiltError
from flatshard.fsdp2 import extensions
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.grad_state import local
from flatshard.runtime.layout import FlatLayout, set_views_on_modules
from flatshard.runtime.unit import Unit

VALUES = ("chunks", "params")  # fully_shard's shard_boundaries: FSDP2's dim-0 chunks (default), or whole
# the mesh's ranks -> (unit, its shard sizes) of every "params" call on them (see the Note)
_BUILT: dict[tuple[int, ...], list[tuple[weakref.ref, list[int]]]] = {}
# mesh -> the one-rank mesh of each of its ranks, in rank order
_OWNER_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def wanted(shard_boundaries: Any) -> bool:
    """Whether ``fully_shard(shard_boundaries=...)`` asks for whole parameters; refuses what is not built."""
    if shard_boundaries is None or shard_boundaries == "chunks":
        return False
    if shard_boundaries == "params":
        return True
    if shard_boundaries in ("flat", "rows"):
        raise NotBuiltError(
            f"fully_shard(shard_boundaries={shard_boundaries!r}) is not built: a DTensor's Shard(0) cannot express "
            'shards cut elsewhere than torch.chunk does. Pass shard_boundaries="params" (each parameter whole '
            "on one rank), leave it unset (FSDP2's chunks), or use FullyShardedDataParallel"
        )
    raise ValueError(
        f'fully_shard(shard_boundaries={shard_boundaries!r}): pass "params" (each parameter whole on one rank) '
        'or leave it unset ("chunks", FSDP2\'s dim-0 chunks)'
    )


def check(mesh, module: nn.Module, **beside: bool) -> None:
    """Refuse, before anything is built, what ``"params"`` is not built with (every rank raises alike:
    these depend on arguments and the model, the same on every rank)."""
    if mesh.ndim != 1:
        raise NotBuiltError(
            'fully_shard(shard_boundaries="params") is built on a 1-D mesh; HSDP (a 2-D mesh) with whole '
            "parameters is not built. Pass a 1-D mesh, or use FullyShardedDataParallel(..., "
            'sharding_strategy=HYBRID_SHARD, shard_boundaries="params")'
        )
    if any(p.is_meta for p in module.parameters()):
        raise NotBuiltError(
            'fully_shard(shard_boundaries="params") on a module with meta parameters is not built: materialise '
            "the model (to_empty and init) before calling fully_shard"
        )
    on = [what for what, is_on in beside.items() if is_on]
    if on:
        raise NotBuiltError(
            f'fully_shard(shard_boundaries="params") is not built with {", ".join(on)}: leave '
            f"{' and '.join(on)} unset, or leave shard_boundaries unset"
        )


def loads_of(mesh) -> list[int]:
    """The elements each rank of ``mesh`` owns in the units of earlier calls still alive (a new list: the
    build adds this call's shards to it)."""
    built = _BUILT.setdefault(tuple(mesh.mesh.reshape(-1).tolist()), [])
    built[:] = [(unit, sizes) for unit, sizes in built if unit() is not None]
    return [sum(col) for col in zip(*(sizes for _, sizes in built))] if built else [0] * mesh.size()


def remember(mesh, unit: Unit) -> None:
    """Count ``unit``'s shards in the deals of later calls on the same ranks."""
    sizes = [sum(col) for col in zip(*(g.layout.shard_sizes for g in unit.flat_groups))]
    _BUILT.setdefault(tuple(mesh.mesh.reshape(-1).tolist()), []).append((weakref.ref(unit), sizes))


def owner_meshes(mesh) -> list[DeviceMesh]:
    """One one-rank mesh per rank of the 1-D ``mesh``, made once, without process groups (see the Note)."""
    if mesh not in _OWNER_MESHES:
        ranks = mesh.mesh.reshape(-1).tolist()
        _OWNER_MESHES[mesh] = [DeviceMesh(mesh.device_type, torch.tensor([r]), _init_backend=False) for r in ranks]
    return _OWNER_MESHES[mesh]


def as_dtensors(group: FlatGroup, mesh) -> None:
    """A ``"params"`` flat group's shard views become DTensor parameters on their owner's one-rank mesh,
    over the same storage; its reduced gradients alike (see the Note)."""
    layout = group.layout
    assert isinstance(layout, FlatLayout)  # built with shard_boundaries="params"
    meshes = owner_meshes(mesh)
    owners = []
    for info in layout.infos:  # the rank whose [bounds[k], bounds[k+1]) holds the parameter
        k = next(k for k in range(layout.shard_size) if layout.bounds[k] <= info.offset < layout.bounds[k + 1])
        owners.append(k if info.numel else 0)

    def dtensor(i: int, local: torch.Tensor) -> DTensor:
        shape = layout.infos[i].shape
        return DTensor.from_local(
            local.view(shape) if local.numel() else local,
            meshes[owners[i]],
            (Replicate(),),
            run_check=False,
            shape=shape,
            stride=extensions.contiguous_stride(shape),
        )

    group.shard_views = [
        nn.Parameter(dtensor(i, v.data), requires_grad=v.requires_grad) for i, v in enumerate(group.shard_views)
    ]
    group.wrap_grad = dtensor
    set_views_on_modules(layout, group.shard_views, as_params=True)


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0, *, group=None
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for whole parameters on their owners: the norm of every rank's
    gradients, with one all-reduce over ``group`` (default the world), then every gradient scaled as
    torch's does. Pass every rank its own parameters (or all: the empty ones add nothing). Returns the
    total norm, a plain tensor, equal on every rank."""
    grads = [local(p.grad) for p in parameters if p.grad is not None]
    grads = [g for g in grads if g.numel()]
    norm_type = float(norm_type)
    device = grads[0].device if grads else torch.device("cpu")
    if math.isinf(norm_type):
        total = torch.stack([g.abs().max().float() for g in grads]).max() if grads else torch.zeros((), device=device)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=group)
    else:
        total = sum((g.float().norm(norm_type) ** norm_type for g in grads), torch.zeros((), device=device))
        dist.all_reduce(total, group=group)
        total = total ** (1.0 / norm_type)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in grads:
        g.mul_(coef.to(g.dtype))
    return total
