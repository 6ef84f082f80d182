"""``fully_shard``: front end 2, PyTorch FSDP2's API on flatshard's engine.

    from flatshard import fully_shard, MixedPrecisionPolicy      # was: from torch.distributed.fsdp import ...
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)

Each call makes the module's parameters not already under an inner ``fully_shard`` one unit (the engine's,
runtime/build/units.py) in FSDP2's layout ([Note: chunked layout], runtime/chunked.py), registers them on the
module as DTensors (``Shard(0)`` over the shard mesh dim, ``Replicate()`` over the replicate dim), swaps
the module's class for one that also is an ``FSDPModule`` (module.py; as FSDP2 does) and hooks its forward. The
outermost call is the root: it hands one run context to every unit under it. DTensor parameters are
what PyTorch's own tools read: ``torch.nn.utils.clip_grad_norm_``, ``p.full_tensor()`` and
``torch.distributed.checkpoint``'s ``get_model_state_dict`` / ``get_optimizer_state_dict`` / ``set_*``.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass
from typing import Any, Optional, TypeVar, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard

from flatshard import interop
from flatshard.api import MixedPrecision, NotBuiltError, ShardingStrategy
from flatshard.fsdp2 import checks, extensions, meshes, spmd, tensor_parallel, whole
from flatshard.fsdp2.module import FSDPModule
from flatshard.runtime import build, hooks, precision
from flatshard.runtime.build import deferred
from flatshard.runtime.comm.mesh import group_timeout
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.layout import set_views_on_modules
from flatshard.runtime.post_forward import PostForwardGroup
from flatshard.runtime.tree import units_under
from flatshard.runtime.unit import Unit


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """FSDP2's names and defaults: gathered parameters in ``param_dtype``, gradients reduced in
    ``reduce_dtype`` (default ``param_dtype``), outputs cast to ``output_dtype``, floating inputs cast to
    ``param_dtype`` when ``cast_forward_inputs``."""

    param_dtype: Optional[torch.dtype] = None
    reduce_dtype: Optional[torch.dtype] = None
    output_dtype: Optional[torch.dtype] = None
    cast_forward_inputs: bool = True


@dataclass(frozen=True)
class OffloadPolicy:
    """No offloading (FSDP2's default)."""


@dataclass(frozen=True)
class CPUOffloadPolicy(OffloadPolicy):
    """Parameters, gradients and optimizer state in (pinned) CPU memory; needs an accelerator."""

    pin_memory: bool = True


_CLASSES: dict[type, type] = {}
M = TypeVar("M", bound=Union[nn.Module, list[nn.Module]])  # fully_shard returns the module (or list) it was given


def _fsdp_class(cls: type) -> type:
    if cls not in _CLASSES:
        attrs = {"__module__": cls.__module__, "_orig_cls": cls}
        _CLASSES[cls] = type(f"FSDP{cls.__name__}", (FSDPModule, cls), attrs)
    return _CLASSES[cls]


def fully_shard(
    module: M,
    *,
    mesh=None,
    reshard_after_forward: Union[bool, int, None] = None,
    shard_placement_fn=None,
    mp_policy: Any = MixedPrecisionPolicy(),
    offload_policy: Any = OffloadPolicy(),
    ignored_params: Optional[set[nn.Parameter]] = None,
    dp_mesh_dims=None,
    shard_boundaries: Optional[str] = None,
    shard_optimizer_across_replicas: bool = False,
    compress_inter_node: Optional[str] = None,
) -> M:
    """Shard ``module``'s parameters (those not under an inner ``fully_shard``) as one unit, FSDP2's way.

    ``mesh``: a 1-D DeviceMesh (shard) or a 2-D one (replicate, shard) for HSDP; default a 1-D mesh over
    the world. ``reshard_after_forward``: free the gathered parameters after forward (True, FSDP2's
    default; the root is kept anyway) or not (False), or an int g dividing the shard dim's size: keep 1/g
    after forward and gather within groups of g ranks in backward (FSDP2's meaning; g = the size is True,
    1 is False). ``shard_boundaries``: unset (FSDP2's dim-0 chunks) or ``"params"``, flatshard's: every
    parameter whole on one rank, for optimizers that read whole matrices ([Note: whole parameters on
    fully_shard], whole.py). Two more of
    flatshard's keywords, as the FSDP1 wrapper's, on a 2-D mesh only ([Note: optimizer state
    across replicas on fully_shard]): ``shard_optimizer_across_replicas=True`` keeps the parameters sharded
    over the shard dim but splits gradients and optimizer state over every rank; ``compress_inter_node="int8"``
    sends the reduction across replicas as int8 ([Note: inter-node compression], runtime/comm/int8.py).
    ``dp_mesh_dims``: FSDP2's; ``mesh`` is then the whole SPMD mesh the parameters are DTensors on
    (``Replicate()`` on the named dims), and FSDP shards over the dim named ``shard`` and replicates over
    the one named ``replicate`` ([Note: parameters on the whole SPMD mesh], spmd.py).
    Returns ``module``, whose class now also is ``FSDPModule``."""
    modules = list(module) if isinstance(module, (list, tuple)) else [module]
    if not modules:
        raise ValueError("fully_shard got an empty list of modules: pass a module, or a list of them (one group)")
    for m in modules:
        checks.check_module(m)
    on_mesh = None  # [Note: parameters on the whole SPMD mesh] (spmd.py)
    if dp_mesh_dims is not None:
        on_mesh = spmd.resolve(mesh, dp_mesh_dims, reshard_after_forward)
        mesh = on_mesh.dp_mesh
    # [Note: a group of modules]
    # fully_shard([a, b]) makes one unit of the parameters of a and b (FSDP2's
    # group: one all-gather, one reduce-scatter). It is built over a container holding them; each module
    # then hosts the same unit and runs its hooks, so the unit is gathered for whichever runs, and a
    # module run alone (a loss head called chunk by chunk) works as a module run twice in one forward.
    # Tied parameters must be in one group; the root adopts the unit once (runtime/tree.py, units_under).
    target = modules[0] if len(modules) == 1 else nn.ModuleList(modules)
    replicated = checks.replicated_params(target)  # [Note: composing with torch's replicate] (checks.py)
    if replicated:
        ignored_params = set(ignored_params or ()) | replicated
    checks.check_not_flattened(target)
    mesh, placements = _mesh(mesh, target)
    # [Note: parameters that gather themselves] (extensions.py): kept out of the flat shard
    self_gathered = [(n, p) for n, p in checks.call_parameters(target, ignored_params) if extensions.gathers_itself(p)]
    tp_specs = tensor_parallel.tensor_parallel_params(target, ignored_params, mesh, on_mesh)
    placed = meshes.Placed({}, {}, {})
    if shard_placement_fn is not None:  # one exchange over the call's ranks ([Note: a flat group per mesh])
        placed = meshes.placements(lambda: checks.shard_dims(target, shard_placement_fn, ignored_params), mesh)
    shard_size = mesh.size(mesh.ndim - 1)
    reshard, post_forward_size = _reshard_after_forward(reshard_after_forward, shard_size)
    params_whole = whole.wanted(shard_boundaries)  # [Note: whole parameters on fully_shard] (whole.py)
    if params_whole:
        beside = {
            "shard_placement_fn": shard_placement_fn is not None,
            "an int reshard_after_forward": bool(post_forward_size),
        }
        beside.update(
            {"tensor-parallel parameters": bool(tp_specs), "parameters that gather themselves": bool(self_gathered)}
        )
        beside["CPUOffloadPolicy on an accelerator"] = _offload(offload_policy) and mesh.device_type != "cpu"
        whole.check(mesh, target, **beside)
    if placed.param_groups:
        _check_other_meshes(self_gathered, post_forward_size)
    # [Note: FSDP over tensor-parallel parameters] (tensor_parallel.py): the unit is built on their local tensors
    tp_uses, dims = tensor_parallel.localize(
        target, tp_specs, placed.dims if shard_placement_fn else None, placed.param_groups
    )
    mp, output_dtype = _precision(mp_policy)
    across = shard_optimizer_across_replicas
    if across or compress_inter_node is not None:
        _check_across_replicas(
            target, mesh, across, compress_inter_node, placed, tp_specs, self_gathered, post_forward_size
        )
    options = build.BuildOptions(
        strategy=ShardingStrategy.NO_SHARD if on_mesh is not None and not on_mesh.sharded else _strategy(mesh, reshard),
        process_group=mesh.get_group() if mesh.ndim == 1 else None,
        device_mesh=mesh if mesh.ndim == 2 else None,
        ignored_states=checks.ignored_here(target, ignored_params, [p for _, p in self_gathered]),
        mixed_precision=mp,
        # CPUOffloadPolicy on a CPU mesh: the parameters already live in CPU memory, as FSDP2 leaves them
        offload_params=_offload(offload_policy) and mesh.device_type != "cpu",
        shard_boundaries="params" if params_whole else "chunks",
        loads=whole.loads_of(mesh) if params_whole else None,
        keep_meta=True,  # [Note: meta parameters left to the user] (runtime/build/deferred.py)
        shard_dims=dims,  # [Note: sharded along another dim] (runtime/chunked.py)
        param_groups=placed.param_groups or None,  # [Note: a flat group per mesh] (runtime/build/grouping.py)
        shard_optimizer_across_replicas=across,  # [Note: optimizer state across replicas on fully_shard]
        compress_inter_node=compress_inter_node,
    )
    built = build.build_units(target, options, _no_nested)
    unit = built.root
    checks.remember_flattened(unit)
    if params_whole:
        whole.remember(mesh, unit)
    unit.settings.unsynced_in_reduce_dtype = True  # FSDP2 accumulates unsynced gradients in the reduce dtype
    for group in unit.flat_groups:  # one per (mesh, dtype) ([Note: a flat group per dtype], runtime/build/grouping.py)
        if post_forward_size:
            group.gather.post_forward = _post_forward_group(mesh, post_forward_size, group.layout.padded)
        on = placed.mesh_of(group.groups, mesh)
        if params_whole:
            whole.as_dtensors(group, mesh)
            continue
        if group.pieces is not None:  # [Note: pieces in the chunked layout] (runtime/across_replicas.py)
            on = _flat_mesh(mesh)
        _as_dtensors(group, on, placements if on is mesh else (Replicate(),) * (on.ndim - 1) + (Shard(0),), tp_uses)
    extensions.attach(unit, target, self_gathered, mesh, placements, mp_policy, mp, dims)
    if any(group.flat_shard.is_meta for group in unit.flat_groups):
        _ON_META.add(unit)
    for m in modules:
        m.__class__ = _fsdp_class(type(m))
        assert isinstance(m, FSDPModule)  # its class derives from FSDPModule now
        m._unit = unit
        checks.mark_fully_shard(m)
        m.fsdp_output_dtype = output_dtype
        m.register_forward_pre_hook(functools.partial(hooks.forward_pre_hook, unit), prepend=True, with_kwargs=True)
        m.register_forward_pre_hook(_adopt_materialized, prepend=True)  # runs before the one above
        if mp is not None and mp.param_dtype is not None and mp.cast_forward_inputs and not unit.precision.mixed:
            m.register_forward_pre_hook(functools.partial(_cast_inputs, mp.param_dtype), with_kwargs=True)
        m.register_forward_hook(functools.partial(hooks.forward_post_hook, unit, output_dtype), always_call=True)
    config = build.schedule_config(unit.flat_groups[0].compute_device)
    root = modules[0]
    assert isinstance(root, FSDPModule)
    build.become_root(root, config, mp)
    return module


def _check_other_meshes(self_gathered: list, post_forward_size: int) -> None:
    """Parameters on a mesh of their own ([Note: a flat group per mesh]), plain or DTensors of another
    mesh (experts on an ep mesh), are built beside plain and tensor-parallel parameters with a bool
    ``reshard_after_forward``. The ranks agreed on them, so every rank raises here alike. Each
    kind present is named with what does run instead (a call of its own on another mesh under the same
    root is refused too, so the remedies are layouts ``fully_shard`` builds)."""
    kinds = (
        (
            "parameters that gather themselves",
            bool(self_gathered),
            "Give the module of the parameters that gather themselves a fully_shard call of its own on this "
            "call's mesh, without a ShardPlacementResult.",
        ),
        ("an int reshard_after_forward", bool(post_forward_size), "Pass reshard_after_forward as a bool."),
    )
    present = [(what, remedy) for what, on, remedy in kinds if on]
    if present:
        raise NotBuiltError(
            "fully_shard(shard_placement_fn=...) placed parameters on a mesh of their own (ShardPlacementResult) in a "
            f"call with {' and '.join(what for what, _ in present)}: not built together. "
            + " ".join(remedy for _, remedy in present)
        )


# [Note: optimizer state across replicas on fully_shard]
# The wrapper's two keywords, with the wrapper's names and meanings, as keywords of ``fully_shard``: a
# property of the unit as its mesh is, set where the mesh is given, so a script moving between the front
# ends keeps its words. Set it alike on every call under one root: ``clip_grad_norm_`` stacks the
# parameters' norms, which must live on one mesh (the pieces' DTensors are on the 2-D mesh flattened).
# Both need a 2-D mesh with replicas, refused otherwise; the pieces are not built with what gives a unit
# a second layout (parameters on a mesh of their own, tensor parallelism, parameters that gather
# themselves, an int ``reshard_after_forward``) nor with parameters on meta, and (as in the wrapper)
# not with compression. Every input here is the same on every rank, so every rank raises alike.
def _check_across_replicas(target, mesh, across, compress, placed, tp_specs, self_gathered, post_forward_size) -> None:
    """The checks of the keywords (see the Note above)."""
    if mesh.ndim != 2 or mesh.size(0) == 1 or mesh.size(1) == 1:
        what = "shard_optimizer_across_replicas=True" if across else f"compress_inter_node={compress!r}"
        raise ValueError(
            f"fully_shard({what}) acts across the replicas of a 2-D (replicate, shard) mesh with both dims > 1; "
            f"got a mesh of shape {tuple(mesh.shape)}. Pass mesh=init_device_mesh(device, (replicas, shard)), or "
            "leave the keyword out"
        )
    if not across:
        return
    unbuilt = [
        what
        for what, on in (
            ("compress_inter_node", compress is not None),
            ("shard_placement_fn placing parameters on a mesh of their own", bool(placed.param_groups)),
            ("tensor-parallel parameters", bool(tp_specs)),
            ("parameters that gather themselves", bool(self_gathered)),
            ("an int reshard_after_forward", bool(post_forward_size)),
            ("parameters on the meta device", any(p.is_meta for p in target.parameters())),
        )
        if on
    ]
    if unbuilt:
        raise NotBuiltError(
            f"fully_shard(shard_optimizer_across_replicas=True) is not built with {' and '.join(unbuilt)}: "
            "leave one of them out (materialise the model before fully_shard, pass reshard_after_forward as a bool)"
        )


_FLAT_MESHES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # 2-D mesh -> its ranks as one dim


def _flat_mesh(mesh):
    """The 2-D mesh flattened (replicate-major, v = r·F + p), made once per mesh (``_flatten`` is collective)."""
    if mesh not in _FLAT_MESHES:
        named = mesh.mesh_dim_names is not None  # _flatten needs names; an unnamed mesh is built over its ranks
        _FLAT_MESHES[mesh] = mesh._flatten() if named else DeviceMesh(mesh.device_type, mesh.mesh.flatten())
    return _FLAT_MESHES[mesh]


def _cast_inputs(dtype: torch.dtype, _module: nn.Module, args: tuple, kwargs: dict) -> tuple:
    """FSDP2 casts floating inputs to ``param_dtype`` even when it is the parameters' own dtype (the engine
    casts only when it computes in another dtype): a bf16 activation reaching an fp32 module is cast."""
    return precision.cast_floating((args, kwargs), dtype)


def register_fsdp_forward_method(module: nn.Module, method_name: str) -> None:
    """Run ``module.<method_name>`` as fully_shard runs ``forward``: parameters gathered before it,
    resharded after, gradients reduced in backward (FSDP2's function, for a method other than forward
    called from outside the module, such as ``vit.forward_features`` or ``generate``). A module that
    fully_shard was not applied to is left alone, as FSDP2 does."""
    if not isinstance(module, FSDPModule):
        return
    if not callable(getattr(module, method_name, None)):
        raise ValueError(f"{type(module).__name__} has no method {method_name!r} to register")
    orig = getattr(module, method_name)
    unit, output_dtype = module._unit, module.fsdp_output_dtype

    @functools.wraps(orig)
    def method(*args, **kwargs):
        args, kwargs = hooks.forward_pre_hook(unit, module, args, kwargs)
        try:
            out = orig(*args, **kwargs)
        except BaseException:
            hooks.forward_post_hook(unit, output_dtype, module, args, None)  # reshards, as after a forward that raised
            raise
        return hooks.forward_post_hook(unit, output_dtype, module, args, out)

    setattr(module, method_name, method)


_ON_META: weakref.WeakSet = weakref.WeakSet()  # units built on meta, not yet given their parameters back
_ROOTS_CHECKED: weakref.WeakSet = weakref.WeakSet()  # roots whose first forward looked for all-gather extensions


def _adopt_materialized(module: FSDPModule, _args) -> None:
    """Before the hooks of a forward: wait for the optimizer's ``set_post_optim_event``; at the first forward
    after the user materialised a meta model ([Note: meta parameters left to the user], runtime/build/deferred.py),
    every unit under ``module`` built on meta takes its parameters back."""
    event = module.post_optim_event
    if event is not None:  # set_post_optim_event: the optimizer step's work is done before any gather
        event.synchronize()
        module.post_optim_event = None
    if not _ON_META and not module._unit.is_root:
        return
    if module._unit.is_root and module not in _ROOTS_CHECKED:  # a local tensor given an extension after the call
        own = {i for u in units_under(module) if u.self_gathered is not None for i in u.self_gathered.params}
        named = [(n, p) for n, p in module.named_parameters() if isinstance(p, DTensor) and id(p) not in own]
        checks.check_no_all_gather_extension([(n, p._local_tensor) for n, p in named])
        _ROOTS_CHECKED.add(module)
    # built on meta, or moved: ``model.to(...)`` swapped a flat group's DTensor parameters for copies
    pending = [u for u in units_under(module) if u in _ON_META or any(g.views_replaced for g in u.flat_groups)]
    if pending:
        fqns = {id(p): n for n, p in module.named_parameters(remove_duplicate=False)}
        for unit in pending:
            deferred.adopt_materialized(unit, fqns)
            _ON_META.discard(unit)


def _no_nested(module: nn.Module, unit: Unit) -> nn.Module:  # noqa: ARG001 - build's host factory
    raise AssertionError("fully_shard builds one unit per call; there is no auto-wrap policy to nest units")


def _mesh(mesh, module: nn.Module):
    if mesh is None:
        device = next((p.device.type for p in module.parameters() if not p.is_meta), "cpu")
        mesh = init_device_mesh(device, (dist.get_world_size(),))
    if mesh.ndim == 1:
        return mesh, (Shard(0),)
    if mesh.ndim == 2:
        return mesh, (Replicate(), Shard(0))
    raise ValueError(
        f"fully_shard expects a 1D or 2D DeviceMesh but got {mesh}: pass a 1-D (shard) mesh, or a 2-D (replicate, "
        "shard) one, e.g. a slice of a larger mesh (mesh['dp_replicate', 'dp_shard'])"
    )


def _reshard_after_forward(value, shard_size: int) -> tuple[bool, int]:
    """(free after forward, the post-forward group's size: 0 for none)."""
    if value is None or isinstance(value, bool):
        return value is not False, 0
    if isinstance(value, int) and value in (1, shard_size):
        return value == shard_size, 0
    if isinstance(value, int) and 1 < value < shard_size and shard_size % value == 0:
        return True, value
    raise ValueError(
        f"reshard_after_forward={value!r}: an int must divide the shard dim's size {shard_size} (1 keeps the "
        f"parameters gathered, {shard_size} frees them, a size between reshards to groups of that many ranks)"
    )


# (mesh, g) -> (this rank's post-forward group, its position in it): every fully_shard call with the same
# mesh and reshard_after_forward=g shares the groups, made once; one per call would leave a model of L
# blocks with L·W/g gloo groups, each with its threads and sockets, each slowing every collective a little
_POST_FORWARD_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _post_forward_group(mesh, size: int, total: int) -> PostForwardGroup:
    """[Note: reshard after forward to a smaller group] (post_forward.py): groups of ``size`` consecutive ranks of
    every shard group, made by every rank in the same order (``new_group`` is collective), once per mesh
    and size."""
    made = _POST_FORWARD_GROUPS.setdefault(mesh, {})
    if size not in made:
        rows = mesh.mesh.reshape(-1, mesh.size(mesh.ndim - 1)).tolist()
        me = dist.get_rank()
        timeout = group_timeout(mesh.get_group(mesh.ndim - 1))
        for row in rows:
            for start in range(0, len(row), size):
                ranks = row[start : start + size]
                group = dist.new_group(ranks, timeout=timeout)
                if me in ranks:
                    made[size] = (group, ranks.index(me))
    group, rank = made[size]
    return PostForwardGroup.of(group, size, rank, total)


def _strategy(mesh, reshard: bool) -> ShardingStrategy:
    if mesh.ndim == 2:
        return ShardingStrategy.HYBRID_SHARD if reshard else ShardingStrategy._HYBRID_SHARD_ZERO2
    return ShardingStrategy.FULL_SHARD if reshard else ShardingStrategy.SHARD_GRAD_OP


def _precision(policy) -> tuple[Optional[MixedPrecision], Optional[torch.dtype]]:
    if isinstance(policy, interop.TORCH_MIXED_PRECISION_POLICY):
        policy = MixedPrecisionPolicy(
            policy.param_dtype, policy.reduce_dtype, policy.output_dtype, policy.cast_forward_inputs
        )
    if not isinstance(policy, MixedPrecisionPolicy):
        raise TypeError(f"mp_policy must be a MixedPrecisionPolicy, got {policy!r}")
    if policy.param_dtype is None and policy.reduce_dtype is None:
        return None, policy.output_dtype
    mp = MixedPrecision(
        param_dtype=policy.param_dtype,
        reduce_dtype=policy.reduce_dtype,
        cast_forward_inputs=policy.cast_forward_inputs,
        cast_root_forward_inputs=policy.cast_forward_inputs,
    )
    return mp, policy.output_dtype


def _offload(policy) -> bool:
    if isinstance(policy, interop.TORCH_OFFLOAD_POLICIES):
        policy = (
            CPUOffloadPolicy(policy.pin_memory)
            if isinstance(policy, interop.TORCH_CPU_OFFLOAD_POLICY)
            else OffloadPolicy()
        )
    if not isinstance(policy, OffloadPolicy):
        raise TypeError(f"offload_policy must be an OffloadPolicy or CPUOffloadPolicy, got {policy!r}")
    return isinstance(policy, CPUOffloadPolicy)


def _as_dtensors(group: FlatGroup, mesh, placements, tp_uses: dict) -> None:
    """A flat group's shard views become DTensor parameters over the same storage (no copy); its reduced
    gradients become DTensor gradients alike. Tensor-parallel parameters ([Note: FSDP over
    tensor-parallel parameters], tensor_parallel.py) are placed over both meshes, and their compute views are
    made DTensors of the TP mesh again."""
    layout = group.layout
    assert layout.rank_major  # fully_shard builds chunked layouts (runtime/chunked.py)
    infos = layout.infos
    specs = [tensor_parallel.spec_of(info, tp_uses) for info in infos]

    def placed(i: int) -> tuple:
        dim, spec = layout.dims[i], specs[i]  # [Note: sharded along another dim]
        if spec is None:
            return mesh, (*placements[:-1], Shard(dim)), infos[i].shape
        return tensor_parallel.sharded_placement(spec, dim, mesh)

    per_param = [placed(i) for i in range(len(infos))]

    def dtensor(i: int, local: torch.Tensor) -> DTensor:
        on, where, shape = per_param[i]
        return DTensor.from_local(
            local, on, where, run_check=False, shape=shape, stride=extensions.contiguous_stride(shape)
        )

    if any(specs):
        group.wrap_compute = [tensor_parallel.compute_wrapper(s) if s is not None else None for s in specs]

    group.shard_views = [
        nn.Parameter(dtensor(i, v.data), requires_grad=v.requires_grad) for i, v in enumerate(group.shard_views)
    ]
    group.wrap_grad = dtensor
    set_views_on_modules(group.layout, group.shard_views, as_params=True)
