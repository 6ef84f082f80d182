"""``fully_shard(model, mesh=spmd_mesh, dp_mesh_dims=DataParallelMeshDims(shard=..., replicate=...))``:
parameters that are already DTensors on the whole SPMD mesh, FSDP taking the named data-parallel dims.

[Note: parameters on the whole SPMD mesh]
With ``dp_mesh_dims`` (FSDP2's keyword) the model was distributed over one mesh that
holds every dim, the data-parallel ones included: each parameter is a DTensor on it, ``Replicate()`` on
the dims the keyword names, sharded or replicated by tensor parallelism on the others, and the model's
forward runs on DTensors of that mesh. flatshard builds the unit as it does for tensor-parallel
parameters ([Note: FSDP over tensor-parallel parameters], tensor_parallel.py): the engine shards each
parameter's local tensor over the data-parallel ranks, the named dims sliced out of the mesh (the shard
dim, or (replicate, shard) for HSDP). Three things differ, each as FSDP2 has them:

- the sharded parameter is a DTensor on the whole mesh, in the mesh's own dim order: the shard dim's
  ``Replicate()`` becomes ``Shard(d)``, or ``_StridedShard(d, split_factor=k)`` where the dims right of it
  already cut dim d into k pieces (so the global tensor reads back in order); the other dims keep theirs;
- the compute view is a DTensor on the whole mesh with the parameter's original placements;
- in backward, the gradient is brought to the original placements on the other dims only: what is
  partial over the data-parallel dims stays partial, and the reduce-scatter (and the all-reduce across
  replicas) sums it, where ``DTensor.from_local``'s backward would first all-reduce it over them.

Several dims named ``shard`` (or ``replicate``) are flattened into one data-parallel dim, as FSDP2 does,
and the sharded parameter is then placed on a mesh made of the flattened dim and the others.
``replicate`` alone is FSDP2's DDP over the SPMD mesh (its ``DDPMeshInfo``): the engine's NO_SHARD over the
replicate dim (several flattened), so nothing is sharded, each parameter stays a DTensor on the whole mesh
with the placements it was given, and its gradient is all-reduced (averaged) over the data-parallel ranks.

Tested (tests/test_dp_mesh_dims.py): the shard dim alone, beside one tensor-parallel dim, under one
replicate dim, each in both orders, two shard dims flattened; the replicate dim alone, beside a
tensor-parallel dim in both orders, and two replicate dims flattened. Refused as FSDP2 refuses (plain
parameters, a data-parallel dim not ``Replicate()``, a name not in the mesh, an int
``reshard_after_forward`` where a dim is sharded); an int ``reshard_after_forward`` with ``replicate``
alone, which FSDP2 takes and has nothing to reshard with, is refused too (nothing would be done with it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Partial, _StridedShard

from flatshard.api import NotBuiltError


@dataclass(frozen=True)
class SpmdMesh:
    """The whole mesh of a ``dp_mesh_dims`` call, its data-parallel dims' indices, and the mesh the engine
    shards over (1-D: shard; 2-D: (replicate, shard))."""

    mesh: DeviceMesh
    shard: tuple[int, ...]  # indices of the dims named ``shard`` (several: flattened into one)
    replicate: tuple[int, ...]
    dp_mesh: DeviceMesh

    @property
    def sharded(self) -> bool:
        """False for ``replicate`` alone: FSDP2's DDP over the SPMD mesh, no dim sharded."""
        return bool(self.shard)

    @property
    def dp_indices(self) -> frozenset[int]:
        return frozenset((*self.shard, *self.replicate))


def resolve(mesh: DeviceMesh | None, dims, reshard_after_forward) -> SpmdMesh:
    """Check a ``dp_mesh_dims`` call as FSDP2 does, on every rank alike (the inputs are the same on every
    rank), and slice the data-parallel mesh out of the whole one."""
    shard = _names(dims, "shard")
    replicate = _names(dims, "replicate")
    if not shard and not replicate:
        raise ValueError("fully_shard got a dp_mesh_dims that names no dim: set shard= (and replicate= for HSDP)")
    if mesh is None or mesh.mesh_dim_names is None:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...) needs mesh=, the whole SPMD mesh the parameters are DTensors on, with "
            f"named dims; got {mesh}. Make it with init_device_mesh(..., mesh_dim_names=(...))"
        )
    names = mesh.mesh_dim_names
    for name in (*shard, *replicate):
        if name not in names:
            raise ValueError(
                f"dp_mesh_dims: mesh dim name '{name}' not found in mesh.mesh_dim_names {names}; name one of those"
            )
    for group in (shard, replicate):
        if len(group) > 1 and [names.index(n) for n in group] != sorted({names.index(n) for n in group}):
            raise ValueError(
                f"dp_mesh_dims names {group} to flatten into one dim: name each dim once, in the mesh's own order "
                f"{names}"
            )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool) and not shard:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=DataParallelMeshDims(replicate=...)) got reshard_after_forward="
            f"{reshard_after_forward}: with replicate dims alone nothing is sharded, so there is no group to reshard "
            "to; pass True or False (FSDP2 takes the int and does nothing with it)"
        )
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=...): reshard_after_forward as int ({reshard_after_forward}) is not supported "
            "with an SPMD mesh, as in FSDP2; pass True or False"
        )
    if not shard:  # DDP over the SPMD mesh: the engine's NO_SHARD over the replicate dim
        dp_mesh = _one_dim(mesh, replicate)
    else:
        dp_mesh = _one_dim(mesh, shard)
        if replicate:  # (replicate, shard), whatever their order in the mesh, as FSDP2 concatenates them
            dp_mesh = DeviceMesh._concatenate([_one_dim(mesh, replicate), dp_mesh])
    index = names.index
    return SpmdMesh(mesh, tuple(map(index, shard)), tuple(map(index, replicate)), dp_mesh)


def _one_dim(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh:
    """The named dim as a 1-D mesh; several named dims flattened into one (``DeviceMesh._flatten``, made
    once per mesh and name: the mesh keeps it)."""
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def _names(dims, field: str) -> tuple[str, ...]:
    value = getattr(dims, field, None)
    if value is None:
        return ()
    return (value,) if isinstance(value, str) else tuple(value)


def check_params(named: list[tuple[str, torch.nn.Parameter]], spmd: SpmdMesh) -> None:
    """Every parameter of the call a DTensor on the whole mesh, ``Replicate()`` on the data-parallel dims and
    no ``Partial`` elsewhere (FSDP2's ValueErrors; the model is the same on every rank, so every rank
    raises alike)."""
    names = spmd.mesh.mesh_dim_names
    assert names is not None  # resolve() checked it
    for name, param in named:
        if not isinstance(param, DTensor):
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) got '{name}', a plain tensor: with dp_mesh_dims all parameters must be "
                "DTensors on the full SPMD mesh passed (distribute_module or distribute_tensor onto it, Replicate() "
                "on the data-parallel dims)"
            )
        if param.device_mesh is not spmd.mesh:  # FSDP2's test: an equal mesh made apart is refused too
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) got '{name}', a DTensor on {param.device_mesh}: expected the same mesh "
                f"object passed to fully_shard ({spmd.mesh}); distribute it onto that mesh"
            )
        for idx in sorted(spmd.dp_indices):
            if not isinstance(param.placements[idx], Replicate):
                what = "shard" if idx in spmd.shard else "replicate"
                raise ValueError(
                    f"fully_shard(dp_mesh_dims=...) got '{name}' placed {param.placements[idx]} on '{names[idx]}', "
                    f"the data-parallel {what} dim: Expected Replicate() there (fully_shard shards it)"
                )
        if any(isinstance(p, Partial) for p in param.placements):
            raise NotBuiltError(
                f"fully_shard got {name}, a DTensor placed {param.placements}: Partial parameters are not built in "
                "flatshard; use torch.distributed.fsdp.fully_shard for this model"
            )


def data_parallel_shard(dim: int, after: list, sizes: list[int]) -> Shard | _StridedShard:
    """The data-parallel dim's placement of a parameter sharded along ``dim``: ``Shard(dim)``, or FSDP2's
    ``_StridedShard`` when dims after it on the mesh (``after``, of ``sizes``) cut ``dim`` too, strided by
    the product of their sizes. One rule for the SPMD mesh here and tensor_parallel.py's concatenated one."""
    split = 1
    for placement, size in zip(after, sizes):
        if isinstance(placement, (Shard, _StridedShard)) and placement.dim == dim:
            split *= size
    return _StridedShard(dim, split_factor=split) if split > 1 else Shard(dim)


def sharded_placement(spmd: SpmdMesh, placements: tuple, dim: int) -> tuple[DeviceMesh, tuple]:
    """(mesh, placements) of the sharded parameter: on the whole mesh, the shard dim's ``Replicate()`` made
    ``Shard(dim)``, strided by what the dims right of it cut ``dim`` into (FSDP2's placement). Several shard
    dims, flattened: the first one's placement on the data-parallel mesh in their place (``Replicate()``
    before it under HSDP, the replicate dims then left out), the other dims as they are, as FSDP2 places it.
    ``replicate`` alone: nothing is sharded, the placements as given."""
    if not spmd.sharded:
        return spmd.mesh, tuple(placements)
    first = spmd.shard[0]
    right = range(first + 1, spmd.mesh.ndim)
    sharded = data_parallel_shard(dim, [placements[j] for j in right], [spmd.mesh.size(j) for j in right])
    if len(spmd.shard) == 1:
        new = list(placements)
        new[first] = sharded
        return spmd.mesh, tuple(new)
    names = spmd.mesh.mesh_dim_names
    assert names is not None  # resolve() checked it
    meshes: list[DeviceMesh] = []
    where: list = []
    for i, name in enumerate(names):
        if i == first:
            meshes.append(spmd.dp_mesh)
            where.extend((Replicate(), sharded) if spmd.replicate else (sharded,))
        elif i in spmd.shard or (spmd.replicate and i in spmd.replicate):
            continue
        else:
            meshes.append(spmd.mesh[name])
            where.append(placements[i])
    return DeviceMesh._concatenate(meshes), tuple(where)


class _ToMesh(torch.autograd.Function):
    """The gathered local tensor as a DTensor of the whole mesh; backward leaves the data-parallel dims'
    partial sums to the reduction (see the Note above)."""

    @staticmethod
    def forward(ctx, local, mesh, placements, shape, stride, dp_indices):
        ctx.placements, ctx.dp_indices = placements, dp_indices
        return DTensor.from_local(local, mesh, placements, run_check=False, shape=shape, stride=stride)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            target = tuple(grad.placements[i] if i in ctx.dp_indices else p for i, p in enumerate(ctx.placements))
            if target != tuple(grad.placements):
                grad = grad.redistribute(placements=target)
            grad = grad._local_tensor
            if hasattr(grad, "wait"):  # an AsyncCollectiveTensor
                grad = grad.wait()
        return grad, None, None, None, None, None


def compute_wrapper(spmd: SpmdMesh, placements: tuple, shape: torch.Size, stride: tuple) -> Callable:
    """The compute view's wrapper: the module's forward sees the parameter as it was given."""

    def wrap(view: torch.Tensor) -> DTensor:
        return _ToMesh.apply(view, spmd.mesh, placements, shape, stride, spmd.dp_indices)

    return wrap
