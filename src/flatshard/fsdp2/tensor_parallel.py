"""``fully_shard`` over parameters that are already DTensors: FSDP + tensor parallelism (FSDP2's 2-D use).

[Note: FSDP over tensor-parallel parameters]
After ``parallelize_module(model, tp_mesh, plan)`` a parameter is a DTensor on the 1-D TP mesh whose
local tensor is this rank's TP piece. ``fully_shard(model, mesh=dp_mesh)`` then shards that local tensor
over the data-parallel mesh exactly as it shards a plain parameter (runtime/chunked.py: its chunk along
``Shard(d)``'s dim, default 0): before building, each such parameter is swapped for a plain one holding
its local tensor (``localize``), and the unit is built on those. What changes is what the module sees:

- the sharded parameter (what the optimizer steps and state dicts hold) is a DTensor on the DP and TP
  meshes concatenated, placed ``(Shard(d), *tp_placements)``, or ``_StridedShard(d, split_factor=k)``
  when TP already cuts dim d into k pieces (so the global tensor reads back in order), as FSDP2 places it;
- the compute view, a split of the gathered flat as for any parameter, is wrapped back into a DTensor on
  the TP mesh with the original placements (``DTensor.from_local``, differentiable), so the module's TP
  forward runs as before and the gradient reaching the flat is the local one (``from_local``'s backward
  redistributes a partial TP gradient to the parameter's placements first).

Built: 1-D TP meshes under a 1-D data-parallel mesh or a 2-D HSDP one (the sharded parameter is then
placed over three mesh dims, ``Replicate()`` first), Shard and Replicate TP placements. DTensors that
``shard_placement_fn`` places on a mesh of their own (MoE experts on an ``ep`` mesh, placed on the
expert-FSDP mesh: [Note: a flat group per mesh]) are the same, over that mesh instead of the call's: the
swap keeps their place in ``BuildOptions.param_groups`` (tests/test_moe.py); and tensor-parallel parameters
on the call's mesh beside parameters placed on another train too (tests/test_mesh_groups.py). Not built
(NotBuiltError at the call): TP over more than one mesh dim, ``Partial`` parameters.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.placement_types import Partial

from flatshard.api import NotBuiltError
from flatshard.fsdp2 import spmd
from flatshard.fsdp2.checks import call_parameters


@dataclass
class TPSpec:
    """What a tensor-parallel parameter was before ``localize``: its TP mesh, placements, global shape."""

    mesh: DeviceMesh
    placements: tuple
    shape: torch.Size
    stride: tuple[int, ...]
    spmd: Optional[spmd.SpmdMesh] = None  # a dp_mesh_dims call: the mesh holds the data-parallel dims too


def tensor_parallel_params(
    module: nn.Module, ignored_params, dp_mesh: DeviceMesh, on_mesh: Optional[spmd.SpmdMesh] = None
) -> dict[int, TPSpec]:
    """id(parameter) -> TPSpec for this call's DTensor parameters (inner calls' and ignored ones are not
    this call's); each one checked to be what is built, on every rank alike (the model is the same).
    ``on_mesh``: a dp_mesh_dims call's whole mesh ([Note: parameters on the whole SPMD mesh], spmd.py)."""
    specs: dict[int, TPSpec] = {}
    named = list(call_parameters(module, ignored_params))
    if on_mesh is not None:
        spmd.check_params(named, on_mesh)
        for _, param in named:
            assert isinstance(param, DTensor)  # check_params refused any other
            specs[id(param)] = TPSpec(
                param.device_mesh, tuple(param.placements), param.shape, tuple(param.stride()), on_mesh
            )
        return specs
    for name, param in named:
        if not isinstance(param, DTensor):
            continue
        tp_mesh = param.device_mesh
        if tp_mesh.ndim != 1 or any(isinstance(p, Partial) for p in param.placements):
            raise NotBuiltError(
                f"fully_shard got {name}, a DTensor placed {param.placements} over a {tp_mesh.ndim}-D mesh: "
                "flatshard shards DTensor parameters of a 1-D tensor-parallel mesh with Shard or Replicate "
                "placements only. Use torch.distributed.fsdp.fully_shard (PyTorch's FSDP2) for this model"
            )
        if tp_mesh == dp_mesh:
            raise ValueError(
                f"fully_shard got {name}, a DTensor on the mesh it was asked to shard over ({dp_mesh}): pass "
                "the data-parallel mesh (e.g. mesh['dp']) to fully_shard and the tensor-parallel one to "
                "parallelize_module"
            )
        specs[id(param)] = TPSpec(tp_mesh, tuple(param.placements), param.shape, tuple(param.stride()))
    return specs


def localize(
    module: nn.Module, specs: dict[int, TPSpec], dims: Optional[dict[int, int]], groups: Optional[dict] = None
) -> tuple[dict[tuple[int, str], TPSpec], Optional[dict[int, int]]]:
    """Swap each tensor-parallel parameter for a plain one holding its local tensor (tied uses get the
    same new parameter). Returns (id(module), attr) -> its TPSpec for every use swapped, and ``dims``
    (id(parameter) -> shard dim, checks.shard_dims) keyed by the new parameters. ``groups`` (id(parameter)
    -> the ShardGroups of its own mesh, meshes.Placed.param_groups) is rekeyed in place alike."""
    old: dict[int, nn.Parameter] = {}  # held until the ids are remapped (a freed id may be reused)
    swapped: dict[int, nn.Parameter] = {}
    uses: dict[tuple[int, str], TPSpec] = {}
    for m in module.modules():
        for attr, param in list(m._parameters.items()):
            if param is None or id(param) not in specs:
                continue
            if id(param) not in swapped:
                assert isinstance(param, DTensor)  # ``specs`` holds the DTensor parameters (tensor_parallel_params)
                old[id(param)] = param
                local = nn.Parameter(param._local_tensor.detach(), requires_grad=param.requires_grad)
                # the model fingerprint compares the full shape: TP pieces of an uneven split differ per rank
                local.flatshard_full_shape = param.shape  # type: ignore[attr-defined]  # flatshard's own attribute
                swapped[id(param)] = local
            m._parameters[attr] = swapped[id(param)]
            uses[(id(m), attr)] = specs[id(param)]
    if dims is not None:
        dims = {id(swapped[k]) if k in swapped else k: d for k, d in dims.items()}
    if groups:
        for k in [k for k in groups if k in swapped]:
            groups[id(swapped[k])] = groups.pop(k)
    del old
    return uses, dims


def spec_of(info: Any, uses: dict[tuple[int, str], TPSpec]) -> Optional[TPSpec]:
    """The TPSpec of a unit's parameter (a runtime ParamInfo), or None for a plain one."""
    return next((uses[(id(m), a)] for m, a in info.uses if (id(m), a) in uses), None)


def sharded_placement(spec: TPSpec, dim: int, dp_mesh: DeviceMesh) -> tuple[DeviceMesh, tuple, torch.Size]:
    """(mesh, placements, global shape) of the sharded DTensor parameter: the DP and TP meshes
    concatenated, the DP chunk along ``dim`` strided when TP already cuts that dim (FSDP2's placement),
    replicated first over an HSDP mesh's replicate dim; a dp_mesh_dims call's whole mesh (spmd.py)."""
    if spec.spmd is not None:
        return (*spmd.sharded_placement(spec.spmd, spec.placements, dim), spec.shape)
    dp = spmd.data_parallel_shard(dim, list(spec.placements), list(spec.mesh.shape))
    replicate = (Replicate(),) * (dp_mesh.ndim - 1)  # HSDP: (replicate, shard)
    return DeviceMesh._concatenate([dp_mesh, spec.mesh]), (*replicate, dp, *spec.placements), spec.shape


def compute_wrapper(spec: TPSpec) -> Callable[[torch.Tensor], DTensor]:
    """The gathered local tensor as the DTensor the module's TP forward expects (differentiable)."""
    if spec.spmd is not None:
        return spmd.compute_wrapper(spec.spmd, spec.placements, spec.shape, spec.stride)

    def wrap(view: torch.Tensor) -> DTensor:
        return DTensor.from_local(
            view, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride
        )

    return wrap
