"""What ``fully_shard`` (fsdp2/frontend.py) checks before it builds anything: the modules it is given, the
placements ``shard_placement_fn`` returns, parameters an earlier call flattened, and which ignored
parameters are this call's. Each refusal says what was wrong and how to fix it."""

from __future__ import annotations

import weakref
from typing import Optional

from torch import nn
from torch.distributed.tensor import Shard

from flatshard.api import NotBuiltError
from flatshard.runtime.tree import UnitHost, unit_hosts


class FullyShardUsageError(ValueError, AssertionError):
    """A misuse of ``fully_shard`` that FSDP2 reports with an AssertionError: a ValueError, and an
    AssertionError too, so code written against FSDP2 catches it as it would FSDP2's."""


def call_parameters(module: nn.Module, ignored_params) -> list[tuple[str, nn.Parameter]]:
    """(name, parameter) for each parameter this ``fully_shard`` call shards, once: not an inner call's
    (those are already its DTensors), not an ignored one."""
    ignored = {id(p) for p in ignored_params or ()}
    inner = {id(p) for h in unit_hosts(module) if h is not module for p in h.parameters()}
    return [(n, p) for n, p in module.named_parameters() if id(p) not in ignored and id(p) not in inner]


def shard_dims(module: nn.Module, shard_placement_fn, ignored_params) -> tuple[dict[int, int], list]:
    """The dim ``shard_placement_fn`` shards each of this call's parameters along, by ``id`` (FSDP2's
    keyword: None is ``Shard(0)``, a negative dim counts from the end; [Note: sharded along another dim],
    runtime/chunked.py), and (name, parameter, mesh) for each placed on a mesh of its own by a
    ``ShardPlacementResult`` ([Note: a flat group per mesh], runtime/build/grouping.py; fsdp2/meshes.py
    checks that the ranks agree). A dim the parameter does not have is refused in FSDP2's words."""
    dims: dict[int, int] = {}
    others = []
    for name, param in call_parameters(module, ignored_params):
        placement = shard_placement_fn(param)
        if placement is None:
            continue
        if type(placement).__name__ == "ShardPlacementResult":  # FSDP2's placement with a mesh of its own
            others.append((name, param, mesh_of(name, placement)))
            placement = placement.placement
            if placement is None:
                continue
        if not isinstance(placement, Shard):
            raise ValueError(f"Invalid shard_placement_fn result: {placement!r} for {name}; return Shard(dim) or None")
        dim = placement.dim + param.ndim if placement.dim < 0 else placement.dim
        if not 0 <= dim < param.ndim:
            raise FullyShardUsageError(
                f"Shard dim {placement.dim} is invalid for {param.ndim}D tensor: {name} has shape "
                f"{tuple(param.shape)}; return Shard(d) with -{param.ndim} <= d < {param.ndim} from shard_placement_fn"
            )
        dims[id(param)] = dim
    return dims, others


def mesh_of(name: str, result):
    """The mesh a ``ShardPlacementResult`` shards ``name`` over: an ``FSDPMeshInfo`` over a 1-D mesh (a
    slice of a larger one, ``mesh["efsdp"]``), or an ``HSDPMeshInfo`` over a 2-D (replicate, shard) mesh
    (``mesh["dp_replicate", "efsdp"]``, torchtitan's experts under HSDP); other layouts are not built."""
    info = result.mesh_info
    kinds = {c.__name__ for c in type(info).__mro__}
    if "FSDPMeshInfo" not in kinds:
        raise ValueError(
            f"Invalid shard_placement_fn result: {result!r} for {name}; a ShardPlacementResult needs "
            "mesh_info=FSDPMeshInfo(mesh=<a 1-D DeviceMesh>, shard_mesh_dim=0)"
        )
    if "HSDPMeshInfo" in kinds or info.replicate_mesh_dim is not None:
        if info.mesh.ndim != 2 or (info.replicate_mesh_dim, info.shard_mesh_dim) != (0, 1):
            raise NotBuiltError(
                f"fully_shard(shard_placement_fn=...) returned {result!r} for {name}: an HSDPMeshInfo other than "
                "over a 2-D mesh with replicate_mesh_dim=0 and shard_mesh_dim=1 is not built. Pass "
                "HSDPMeshInfo(mesh=mesh['<replicate dim>', '<shard dim>'], shard_mesh_dim=1, replicate_mesh_dim=0)"
            )
        return info.mesh
    if info.mesh.ndim != 1:
        names = info.mesh.mesh_dim_names
        dim = repr(names[info.shard_mesh_dim]) if names else "<its dim name>"
        raise NotBuiltError(
            f"fully_shard(shard_placement_fn=...) returned {result!r} for {name}: an FSDPMeshInfo over a "
            f"{info.mesh.ndim}-D mesh is not built. Pass the dim it shards over as a 1-D slice: "
            f"FSDPMeshInfo(mesh=mesh[{dim}], shard_mesh_dim=0)"
        )
    return info.mesh


def check_no_all_gather_extension(named: list) -> None:
    """An all-gather extension (``fsdp_pre_all_gather``) set on the local tensor of a plain parameter after
    ``fully_shard``: that parameter lives in the unit's flat shard, gathered as one buffer, and flatshard
    would never call it. A parameter whose class defines it, or any tensor subclass, gathers itself
    ([Note: parameters that gather themselves], fsdp2/extensions.py). ``named``: (name, local tensor) pairs."""
    for name, tensor in named:
        if hasattr(tensor, "fsdp_pre_all_gather"):
            raise NotBuiltError(
                f"{name} was given fsdp_pre_all_gather (FSDP2's all-gather extension) on its local tensor after "
                "fully_shard, but it is a plain parameter, gathered within its unit's flat shard, where flatshard "
                "does not call it. Make the parameter an instance of a tensor subclass (which flatshard gathers "
                "through the extension) before fully_shard, or define the extension on that subclass"
            )


# parameters an earlier fully_shard call flattened: one still registered on a module here was shared
# (tied) with that call's module, and would become a second, untied copy
_FLATTENED: dict[int, weakref.ref] = {}


def check_not_flattened(module: nn.Module) -> None:
    for dead in [k for k, ref in _FLATTENED.items() if ref() is None]:
        del _FLATTENED[dead]
    for name, param in module.named_parameters():
        ref = _FLATTENED.get(id(param))
        if ref is not None and ref() is param:
            raise ValueError(
                f"{name} is already managed by another fully_shard call: it is shared (tied) with a module sharded "
                "before, and sharding it again would untie it. Shard the modules that share it in one group, "
                "fully_shard([a, b]), or in a common ancestor's call"
            )


# [Note: composing with torch's replicate]
# torch's composable ``replicate`` (DDP as a function) and FSDP2's ``fully_shard`` mark the modules they
# are applied to in one registry (``torch.distributed._composable.contract``'s, a dict on the module
# keyed by API name), and each reads it: ``replicate`` leaves out the parameters of modules marked
# "fully_shard" (and refuses a module so marked), ``fully_shard`` leaves out modules marked "replicate"
# and everything under them. flatshard's ``fully_shard`` does both alike (``mark_fully_shard`` after a
# call; ``replicated_params`` before it), so a model can mix the two as PyTorch's tests do, in either
# order. The registry is private to PyTorch; reading and writing it is the only way ``replicate`` knows.
def mark_fully_shard(module: nn.Module) -> None:
    """Mark ``module`` as ``fully_shard``'s in the registry torch's ``replicate`` reads (see the Note)."""
    from collections import OrderedDict

    from torch.distributed._composable.contract import REGISTRY_KEY, RegistryItem

    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict())["fully_shard"] = RegistryItem()


def replicated_params(module: nn.Module) -> set[nn.Parameter]:
    """The parameters of modules under ``module`` that torch's ``replicate`` was applied to (see the Note):
    DDP reduces their gradients, so ``fully_shard`` leaves them out, as FSDP2 does."""
    from torch.distributed._composable.contract import _get_registry

    out: set[nn.Parameter] = set()
    for m in module.modules():
        if m is not module and "replicate" in (_get_registry(m) or {}):
            out.update(m.parameters())
    return out


def ignored_here(module: nn.Module, ignored_params, kept_out=()) -> Optional[list[nn.Parameter]]:
    """The ignored parameters that are ``module``'s: FSDP2 takes one set for a whole model (a parameter of
    another module in it is no error), where the engine refuses a parameter it cannot find. ``kept_out``:
    parameters the flat shard leaves to the front end (those that gather themselves)."""
    ignored = {id(p) for p in (*(ignored_params or ()), *kept_out)}
    if not ignored:
        return None
    return [p for p in module.parameters() if id(p) in ignored] or None


def check_module(module: nn.Module) -> None:
    if isinstance(module, UnitHost):
        raise FullyShardUsageError(
            "Each distinct composable distributed API can only be applied to a module once. fully_shard was "
            f"already applied to this {type(module).__name__}: apply it once"
        )
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):  # FSDP2's check
        raise ValueError(
            f"fully_shard does not support containers that do not implement forward: {type(module).__name__}. "
            "Apply it to each module inside, or to the module that runs them"
        )


def remember_flattened(unit) -> None:
    """The parameters ``unit`` flattened (id -> weakref, as the unit keeps them), for ``check_not_flattened``."""
    for group in unit.flat_groups:
        _FLATTENED.update(group.originals)
