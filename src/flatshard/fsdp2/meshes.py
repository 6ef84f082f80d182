"""``shard_placement_fn`` returning FSDP2's ``ShardPlacementResult``: parameters sharded on a mesh of their
own beside the call's (an expert-FSDP mesh, as MoE models shard their experts), each mesh's parameters
its own flat groups ([Note: a flat group per mesh], runtime/build/grouping.py). This file checks at wrap, in
one exchange over the call's ranks, that every rank placed every parameter alike ([Note: equal errors],
runtime/comm/agree.py), refuses what is not built, and makes each mesh's ShardGroups."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from flatshard.api import NotBuiltError
from flatshard.fsdp2.checks import FullyShardUsageError
from flatshard.runtime.comm import agree
from flatshard.runtime.comm.collectives import default_group
from flatshard.runtime.comm.mesh import ShardGroups

Others = list[tuple[str, Any, DeviceMesh]]  # (name, parameter, its mesh) for those not on the call's mesh
_ERRORS: dict[str, type[Exception]] = {
    "NotBuiltError": NotBuiltError,
    "FullyShardUsageError": FullyShardUsageError,
    "ValueError": ValueError,
}


class Placed:
    """What ``placements`` resolved: each parameter's shard dim, and the groups of those on other meshes."""

    def __init__(self, dims: dict[int, int], param_groups: dict[int, ShardGroups], meshes: dict[int, DeviceMesh]):
        self.dims = dims
        self.param_groups = param_groups  # id(param) -> its mesh's ShardGroups (BuildOptions.param_groups)
        self.meshes = meshes  # id(ShardGroups) -> its mesh (the DTensors' mesh)

    def mesh_of(self, groups: ShardGroups, call_mesh: DeviceMesh) -> DeviceMesh:
        return self.meshes.get(id(groups), call_mesh)


def placements(read: Callable[[], tuple[dict[int, int], Others]], call_mesh: DeviceMesh) -> Placed:
    """Call ``read`` (checks.shard_dims) on every rank of the call's mesh and exchange what it found: an
    error, or the ranks of each parameter's mesh, raised alike on every rank when any rank failed or
    the ranks disagree. Collective over the call's ranks."""
    group = _call_group(call_mesh)
    error: Optional[Exception] = None
    dims: dict[int, int] = {}
    others: Others = []
    try:
        dims, found = read()
        others = [(n, p, m) for n, p, m in found if not _is_call_mesh(m, call_mesh, group)]
    except (ValueError, NotBuiltError) as exc:
        error = exc
    mine = {name: _ranks(m) for name, _, m in others}
    said = agree.gather_json(
        {"error": None if error is None else [type(error).__name__, str(error)], "meshes": mine}, group
    )
    failed = next(((r, s["error"]) for r, s in enumerate(said) if s["error"] is not None), None)
    if failed is not None:
        rank, (kind, message) = failed
        cls = type(error) if error is not None and type(error).__name__ == kind else _ERRORS.get(kind, ValueError)
        where = f" [rank {rank} of {len(said)}]" if len(said) > 1 else ""
        raise cls(f"{message}{where}") from error
    problem = _disagreement([s["meshes"] for s in said], dist.get_process_group_ranks(group))
    if problem is not None:
        raise ValueError(problem)
    return _grouped(dims, others, group)


def _is_call_mesh(mesh: DeviceMesh, call_mesh: DeviceMesh, group) -> bool:
    """Whether a result's mesh is the call's own again (then its parameters are the call's)."""
    if mesh.ndim == 1:
        return mesh.get_group() is group and call_mesh.ndim == 1
    return mesh.ndim == call_mesh.ndim and mesh.mesh.tolist() == call_mesh.mesh.tolist()


def _ranks(mesh: DeviceMesh) -> list[int]:
    """A result mesh's ranks, row-major (a 2-D (replicate, shard) mesh's too)."""
    if mesh.ndim == 1:
        return dist.get_process_group_ranks(mesh.get_group())
    return [int(r) for r in mesh.mesh.flatten().tolist()]


def _call_group(call_mesh: DeviceMesh):
    """The process group over all the call's ranks (as comm/mesh.py resolves it for a 2-D mesh)."""
    if call_mesh.ndim == 1:
        return call_mesh.get_group()
    return default_group() if call_mesh.size() == dist.get_world_size() else call_mesh._flatten().get_group()


def _grouped(dims: dict[int, int], others: Others, group) -> Placed:
    """One ShardGroups per process group (FSDP2 keys its parameter groups by process group): a 1-D mesh's
    group as the shard group, no replicate group; a 2-D (replicate, shard) mesh's dims as the shard and
    replicate groups (HSDP: reduce-scatter over the shard dim, all-reduce over the replicate dim); the
    call's group as the ranks that train the model."""
    by_pg: dict[tuple[int, ...], ShardGroups] = {}
    param_groups: dict[int, ShardGroups] = {}
    meshes: dict[int, DeviceMesh] = {}
    for _, param, mesh in others:
        pgs = (mesh.get_group(),) if mesh.ndim == 1 else (mesh.get_group(1), mesh.get_group(0))
        key = tuple(map(id, pgs))
        if key not in by_pg:
            shard_pg = pgs[0]
            size = dist.get_world_size(shard_pg)
            rep_pg = pgs[1] if len(pgs) == 2 else None
            replicas = dist.get_world_size(rep_pg) if rep_pg is not None else 1
            on = ShardGroups(
                shard_pg if size > 1 else None,
                rep_pg if replicas > 1 else None,
                size,
                dist.get_rank(shard_pg),
                replicas,
                group,
                dist.get_rank(rep_pg) if rep_pg is not None else 0,
            )
            by_pg[key], meshes[id(on)] = on, mesh
        param_groups[id(param)] = by_pg[key]
    return Placed(dims, param_groups, meshes)


def _disagreement(said: list[dict[str, list[int]]], call_ranks: list[int]) -> Optional[str]:
    """Why the ranks' meshes (position i: call rank i's {parameter: its mesh's ranks}) do not fit together,
    or None: each parameter on the same meshes' ranks, each mesh within the call's and holding its rank,
    and every rank of a mesh naming the same ranks for it."""

    def on(pos: int, name: str) -> str:
        ranks = said[pos].get(name)
        return "the call's mesh" if ranks is None else f"a mesh over ranks {ranks}"

    fix = (
        "Return the same placement from shard_placement_fn on every rank, each parameter's FSDPMeshInfo over the "
        "same slice of one mesh on every rank (init_device_mesh(...)['efsdp'])"
    )
    for pos, meshes in enumerate(said):
        name = next((n for n in [*said[0], *meshes] if (n in said[0]) != (n in meshes)), None)
        if name is not None:
            return (
                f"ranks place {name} on different meshes: rank {call_ranks[0]} shards it on {on(0, name)}, "
                f"rank {call_ranks[pos]} on {on(pos, name)}. {fix}"
            )
    for name in said[0]:
        for pos, meshes in enumerate(said):
            ranks, me = meshes[name], call_ranks[pos]
            if me not in ranks or any(r not in call_ranks for r in ranks):
                return (
                    f"rank {me} places {name} on a mesh over ranks {ranks}, which must hold rank {me} and only ranks "
                    f"of the call's mesh {call_ranks}. {fix}"
                )
            for r in ranks:
                theirs = said[call_ranks.index(r)][name]
                if theirs != ranks:
                    return (
                        f"ranks place {name} on meshes that disagree: rank {me} shards it over ranks {ranks}, rank "
                        f"{r} over ranks {theirs}. {fix}"
                    )
    return None
