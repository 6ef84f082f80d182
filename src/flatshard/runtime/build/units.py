"""Construction: from a module and the options of one wrap call to built units.

``build_units`` runs the pipeline every front end shares: the ignored states, the devices, which
modules become units (the wrap policy), which unit owns which parameter (build/placement.py), the sharding
factor (``"auto"``: build/autoshard.py), the groups (comm/mesh.py), then one ``Unit`` per chosen module, eagerly
or interleaved with deferred initialisation (build/deferred.py). Each nested unit gets a host from the
front end's ``make_host`` and takes its module's place in its parents. ``become_root`` then hands one
run context to every unit under the front end's root host (including units wrapped earlier by hand)
and names them by their path. Nothing here imports a front end.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Optional, Union

import torch
from torch import nn

from flatshard.api import MixedPrecision, NotBuiltError, ShardingStrategy
from flatshard.runtime import hooks, precision
from flatshard.runtime.across_replicas import Pieces, ReplicaChunkedLayout
from flatshard.runtime.build import deferred, fingerprint, optim_check
from flatshard.runtime.build.autoshard import auto_sharding_factor
from flatshard.runtime.build.grouping import dtype_groups, mesh_groups, one_dtype
from flatshard.runtime.build.placement import Placement, check_no_tie_into_wrapped
from flatshard.runtime.chunked import ChunkedLayout
from flatshard.runtime.comm import agree, collectives, int8, nodes
from flatshard.runtime.comm.mesh import ShardGroups, device_of, require_initialized, resolve_groups
from flatshard.runtime.context import Link, UnitSettings
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.layout import BOUNDARIES, FlatLayout, ParamInfo
from flatshard.runtime.schedule import RunContext, ScheduleConfig
from flatshard.runtime.tree import UnitHost, clean_name, unit_hosts, units_under
from flatshard.runtime.unit import Unit
from flatshard.wrap import select_units

MakeHost = Callable[[nn.Module, Unit], nn.Module]


@dataclass(frozen=True)
class BuildOptions:
    """What one wrap call asks for, in engine terms (the front ends translate their keywords)."""

    strategy: ShardingStrategy = ShardingStrategy.FULL_SHARD
    process_group: Any = None  # a group, or (shard_group, replicate_group) for hybrid strategies
    device_mesh: Any = None
    sharding_factor: Union[int, str, None] = None
    memory_budget: Optional[int] = None
    auto_wrap_policy: Optional[Callable] = None
    ignored_modules: Any = None
    ignored_states: Any = None
    mixed_precision: Optional[MixedPrecision] = None
    offload_params: bool = False
    param_init_fn: Optional[Callable[[nn.Module], None]] = None
    device_id: Any = None
    sync_module_states: bool = False
    # "flat" | "rows" | "params" ([Note: shard boundaries], layout.py); "chunks" ([Note: chunked layout])
    shard_boundaries: str = "flat"
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    ranks_per_node: Optional[int] = None  # which ranks share a node (None: LOCAL_WORLD_SIZE; comm/nodes.py, Nodes)
    compress_inter_node: Optional[str] = None  # "int8": [Note: inter-node compression] (comm/int8.py)
    link_figures: Any = None  # sharding_factor="auto" by time: a flatshard.planner.Links (build/autoshard.py)
    shard_optimizer_across_replicas: bool = False  # [Note: optimizer state across replicas] (across_replicas.py)
    keep_meta: bool = False  # fully_shard: [Note: meta parameters left to the user] (build/deferred.py)
    shard_dims: Optional[dict] = None  # "chunks": id(param) -> the dim it is cut along (default 0; chunked.py)
    # "chunks": id(param) -> the ShardGroups of a mesh of its own (default the call's; [Note: a flat group per mesh])
    param_groups: Optional[dict] = None
    # "params": elements each shard rank holds of units built by earlier calls (fully_shard's, one unit per call)
    loads: Optional[list[int]] = None


@dataclass
class Built:
    """The result of ``build_units``: the root unit, and what the front end keeps."""

    root: Unit
    ignored_params: set[nn.Parameter]
    sharding_decision: Optional[tuple[int, str]]  # sharding_factor="auto": (F, why)


def build_units(module: nn.Module, options: BuildOptions, make_host: MakeHost) -> Built:
    deferred.check_init_fn(options.param_init_fn)
    if options.shard_boundaries not in (*BOUNDARIES, "chunks"):
        raise ValueError(
            f'shard_boundaries must be one of {BOUNDARIES}, got {options.shard_boundaries!r}: "flat" cuts anywhere '
            '(1-D pieces), "rows" only between rows, "params" keeps every parameter whole on one rank'
        )
    optim_check.install()  # [Note: optimizers on shard views]
    if isinstance(module, UnitHost):
        raise ValueError("this module is already wrapped in FullyShardedDataParallel; wrap it once")
    ignored, ignored_params = ignored_states(module, options.ignored_modules, options.ignored_states)
    ignored_params |= {p for m in ignored for p in m.parameters()}
    device_id = options.device_id
    if options.offload_params:
        device_id = offload_compute_device(module, device_id)
    place_on_device(module, device_id, ignored_params)
    wrapped_earlier = unit_hosts(module)
    skip = set(ignored) | set(wrapped_earlier)
    chosen = select_units(module, options.auto_wrap_policy, skip, ignored_params)
    placement = Placement(module, chosen, skip, ignored_params)
    check_no_tie_into_wrapped(placement, wrapped_earlier)
    by_unit = placement.infos_by_unit()
    _check_same_model(options, module, chosen, by_unit, placement.path)
    factor, decision = options.sharding_factor, None
    if factor == "auto":
        factor, why = _auto_factor(options, module, chosen, by_unit)
        decision = (factor, why)
    elif options.memory_budget is not None:
        raise ValueError('memory_budget is read only with sharding_factor="auto"')
    groups = resolve_groups(options.strategy, options.process_group, options.device_mesh, factor)
    owners = owner_ranks(options, groups) if options.shard_optimizer_across_replicas else None
    root = _build_each(module, chosen, by_unit, placement.path, skip, device_id, groups, options, make_host, owners)
    if options.sync_module_states:
        _broadcast_buffers(module, groups, ignored)
    return Built(root, ignored_params, decision)


def _build_each(module, chosen, by_unit, paths, skip, device_id, groups, options, make_host, owners=None) -> Unit:
    """One unit per chosen module (each replaced in its parents by its host), and the root's own."""
    parents = _parents(module)
    if not options.keep_meta and deferred.has_meta_states(module, skip):  # [Note: deferred initialisation]
        device = deferred.materialization_device(device_id)
        units = deferred.units_in_init_order(module, [*chosen, module], by_unit, skip, options.param_init_fn, device)
    else:  # children first (any order would do: parents are looked up before any unit is built)
        units = ((m, by_unit.get(m, [])) for m in [*chosen, module])
    root = None
    loads = (
        options.loads if options.loads is not None else [0] * groups.shard_size
    )  # elements per shard rank so far ([Note: shard boundaries], "params")
    for unit_module, params in units:
        name = "" if unit_module is module else paths[unit_module]
        unit = build_unit(name, params, groups, options, loads, owners)
        if unit_module is module:
            root = unit
        else:
            host = make_host(unit_module, unit)
            for parent, attr in parents.get(unit_module, []):
                parent._modules[attr] = host
        del params  # the unit keeps its shard; the full-size parameters go before the next unit is initialised
    assert root is not None  # ``module`` is among the units built
    return root


def build_unit(
    name: str,
    params: list[tuple[ParamInfo, nn.Parameter]],
    groups: ShardGroups,
    options: BuildOptions,
    loads: Optional[list[int]] = None,
    owners: Optional[tuple[int, ...]] = None,
) -> Unit:
    """Flatten ``params`` (layout info, original parameter) into one unit on this rank: one flat group, or
    under fully_shard's chunked layout one per (mesh, dtype) (build/grouping.py). ``owners``: the
    global rank of every owner rank, when the optimizer state is split over the replicas (across_replicas.py)."""
    name = name or "<root>"
    if options.shard_boundaries == "chunks":
        parts = [(g, d) for g, part in mesh_groups(params, groups, options.param_groups) for d in dtype_groups(part)]
    else:
        parts = [(groups, one_dtype(name, params))]
    device = params[0][1].device if params else torch.device("cpu")
    on_nodes = nodes.Nodes.resolve(options.ranks_per_node)
    inter = nodes.inter_node(groups.shard_group, groups.replicate_group, on_nodes, options.compress_inter_node)
    int8.check(options.compress_inter_node, inter, on_nodes, groups.replicate_size, device)
    link = Link(name)
    settings = UnitSettings(
        reshard_after_forward=options.strategy.reshard_after_forward,
        strategy=options.strategy,
        mixed_precision=options.mixed_precision,
    )
    flat_groups = [
        _flat_group(part, link, settings, on, options, loads, owners, _inter(on, groups, inter, on_nodes, options))
        for on, part in parts
    ]
    several = len({id(g.groups) for g in flat_groups}) > 1
    for position, group in enumerate(flat_groups):
        group.position, group.several_meshes = position, several
    unit = Unit(link, settings, flat_groups)
    RunContext([unit], unit, ScheduleConfig())  # the unit's own, until a root adopts it (become_root)
    for group in flat_groups:
        hooks.register_post_backward(unit, group)
    return unit


def _flat_group(params, link, settings, groups: ShardGroups, options: BuildOptions, loads, owners, inter) -> FlatGroup:
    """One flat group of ``params`` (all of one dtype): its layout, its flat shard, its precision."""
    infos = [info for info, _ in params]
    originals = [p for _, p in params]
    dtype = originals[0].dtype if originals else torch.float32
    device = originals[0].device if originals else torch.device("cpu")
    layout, pieces = _layout(infos, originals, groups, options, loads, owners)
    flat = layout.flatten({info.name: p for info, p in params}, dtype=dtype, device=device)
    if options.sync_module_states and torch.distributed.get_world_size(groups.process_group) > 1:
        collectives.broadcast(flat, 0, groups.process_group)
    group = FlatGroup(
        link,
        settings,
        layout,
        flat,
        groups,
        precision=precision.resolve(options.mixed_precision, dtype),
        offload=options.offload_params,
        pieces=pieces,
        inter_node=inter,
    )
    group.originals = {id(p): weakref.ref(p) for p in originals}
    return group


def _inter(on: ShardGroups, groups: ShardGroups, inter, on_nodes, options: BuildOptions):
    """The inter-node spans of a flat group on ``on`` (the unit's, ``inter``, when on the call's groups)."""
    if on is groups:
        return inter
    return nodes.inter_node(on.shard_group, on.replicate_group, on_nodes, options.compress_inter_node)


def _layout(infos, originals, groups: ShardGroups, options: BuildOptions, loads, owners) -> tuple:
    """The flat layout of one unit's parameters on these groups, and its pieces across replicas (or None)."""
    pieces = None
    layout: FlatLayout | ChunkedLayout | ReplicaChunkedLayout
    if options.shard_boundaries == "chunks":  # fully_shard: FSDP2's dim-0 chunks ([Note: chunked layout])
        dims = options.shard_dims or {}
        f, r = groups.shard_size, groups.replicate_size
        layout = ChunkedLayout(infos, f * (r if owners else 1), [dims.get(id(p), 0) for p in originals])
        if owners is not None:  # [Note: pieces in the chunked layout] (across_replicas.py)
            v = groups.replicate_rank * f + groups.shard_rank
            pieces = Pieces(layout, v, groups.replicate_rank, r, groups.replicate_group, list(owners))
            layout = ReplicaChunkedLayout(layout, f, r)
    elif owners is not None:  # [Note: optimizer state across replicas] (across_replicas.py)
        layout = FlatLayout(infos, groups.shard_size, "flat", replicas=groups.replicate_size)
        owner = FlatLayout(layout.infos, groups.shard_size * groups.replicate_size, "flat")
        v = groups.shard_rank * groups.replicate_size + groups.replicate_rank
        pieces = Pieces(owner, v, groups.replicate_rank, groups.replicate_size, groups.replicate_group, list(owners))
    else:
        layout = FlatLayout(infos, groups.shard_size, options.shard_boundaries, loads)
    return layout, pieces


def become_root(host: UnitHost, config: ScheduleConfig, mixed_precision: Optional[MixedPrecision]) -> RunContext:
    """``host`` (a front end's root, already holding its unit and module) becomes the root of every unit
    under it: one run context, shared, and each unit named by its path in the unwrapped model."""
    hosts = unit_hosts(host)
    if len({id(g.groups.process_group) for h in hosts for g in h._unit.flat_groups}) > 1:
        raise NotBuiltError(
            "units under one root use different process groups; flatshard needs one process group per "
            "root for now. FullyShardedDataParallel: pass the same process_group to every wrapper. fully_shard: "
            "pass the same mesh= to every call, and put parameters that live on another mesh (experts) there "
            "from the enclosing call's shard_placement_fn, returning ShardPlacementResult(placement, "
            "FSDPMeshInfo(mesh=..., shard_mesh_dim=0))."
        )
    for path, m in host.named_modules():  # named before the context is made: its order checks name them
        if isinstance(m, UnitHost):
            m._unit.name = clean_name(path) or "<root>"
    ctx = RunContext(units_under(host), host._unit, config)  # binds every unit under the root to it
    if mixed_precision is not None and mixed_precision.buffer_dtype is not None:
        ctx.buffer_cast = (host, mixed_precision.buffer_dtype)
    return ctx


def schedule_config(device: torch.device, **kw) -> ScheduleConfig:
    """The prefetch keywords, and [Note: reductions in flight] for the compute device."""
    overlap = kw.get("backward_prefetch") is not None and device.type != "cpu"
    return ScheduleConfig(**kw, overlap_reductions=overlap)


# ---- the pipeline's steps -----------------------------------------------------------------------
def ignored_states(module: nn.Module, ignored_modules, states) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The modules (with their submodules) and the parameters flatshard leaves alone: not flattened, not
    sharded, and their gradients not reduced (as in PyTorch FSDP)."""
    states = list(states or [])
    if ignored_modules is not None and states:
        raise ValueError("pass ignored_modules or ignored_states, not both")
    all_params = all(isinstance(s, nn.Parameter) for s in states)
    if states and not (all_params or all(isinstance(s, nn.Module) for s in states)):
        raise ValueError("ignored_states must hold only nn.Parameter objects or only nn.Module objects, not a mix")
    given = list(ignored_modules or []) + [s for s in states if isinstance(s, nn.Module)]
    params = {s for s in states if isinstance(s, nn.Parameter)}
    ignored: set[nn.Module] = set()
    for m in given:
        if isinstance(m, UnitHost):
            raise ValueError("ignored_modules must not contain FullyShardedDataParallel instances")
        ignored.update(m.modules())
    if module in ignored:
        raise ValueError("the module being wrapped cannot itself be ignored")
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for p in params):
        raise ValueError("ignored_states holds a parameter that is not in the module being wrapped")
    return ignored, params


def offload_compute_device(module: nn.Module, device_id) -> torch.device:
    """CPUOffload(offload_params=True): the device units compute on (``device_id``; else the device of
    the module's parameters; else the current CUDA device), which must be an accelerator. Tests on
    machines without one patch this function (``flatshard.testing.offload_on_cpu``): the offload path
    then runs with CPU as the compute device, the flat shards separate CPU tensors copied before every
    gather, as on an accelerator (but not pinned)."""
    device = _offload_device(module, device_id)
    if device.type == "cpu":
        raise ValueError(
            "CPUOffload(offload_params=True): offload needs an accelerator compute device, and this run has "
            "none: the parameters already live in CPU memory. Pass cpu_offload=None (or CPUOffload(False))."
        )
    return device


def _offload_device(module: nn.Module, device_id) -> torch.device:
    if device_id is not None:
        return device_of(device_id)
    device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
    if device.type == "cpu" and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def place_on_device(module: nn.Module, device_id, ignored_params: set) -> None:
    """Move real parameters and buffers to ``device_id``; meta ones are materialised there later (build/deferred.py)."""
    if device_id is None:
        return
    device = device_of(device_id)
    for sub in module.modules():
        for p in sub._parameters.values():
            if p is not None and p not in ignored_params and not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for attr, b in sub._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                sub._buffers[attr] = b.to(device)


def _auto_factor(options: BuildOptions, module, chosen, by_unit) -> tuple[int, str]:
    if options.device_mesh is not None or isinstance(options.process_group, tuple):
        raise ValueError('sharding_factor="auto" picks the groups itself; do not pass device_mesh or a group pair')
    require_initialized()
    group = options.process_group if options.process_group is not None else torch.distributed.group.WORLD
    root_params = by_unit.get(module, [])
    return auto_sharding_factor(
        strategy=options.strategy,
        unit_sizes=[sum(i.numel for i, _ in by_unit.get(m, [])) for m in chosen],
        root_size=sum(i.numel for i, _ in root_params),
        param_tensors=sum(len(by_unit.get(m, [])) for m in [*chosen, module]),
        world_size=torch.distributed.get_world_size(group),
        memory_budget=options.memory_budget,
        device=next((p.device for _, p in root_params), torch.device("cpu")),
        link_figures=options.link_figures,
        ranks_per_node=options.ranks_per_node,
        group=group,
        inter_node_in_flight=options.schedule.inter_node_in_flight,
        optimizer_across_replicas=bool(options.shard_optimizer_across_replicas),
    )


def _check_same_model(options: BuildOptions, module, chosen, by_unit, paths) -> None:
    """[Note: model fingerprint] (build/fingerprint.py), over the process group the model will train on."""
    require_initialized()
    group = options.process_group
    if isinstance(group, tuple) or group is None:
        group = torch.distributed.group.WORLD
    if options.device_mesh is not None:
        mesh = options.device_mesh
        group = mesh.get_group() if mesh.ndim == 1 else torch.distributed.group.WORLD
    world = torch.distributed.get_world_size(group)
    head = fingerprint.options_line(
        options.strategy,
        options.sharding_factor,
        options.mixed_precision,
        options.offload_params,
        world,
        options.shard_boundaries,
        _ranks_per_node(options.ranks_per_node),
        options.compress_inter_node,
        bool(options.shard_optimizer_across_replicas),
    )
    units = [(paths[m] if m is not module else "<root>", by_unit.get(m, [])) for m in [*chosen, module]]
    fingerprint.check_same_model(fingerprint.entries(head, units), group)


def owner_ranks(options: BuildOptions, groups: ShardGroups) -> tuple[int, ...]:
    """[Note: optimizer state across replicas] (across_replicas.py): check that the wrap call can split its
    optimizer state over the replicas, and return the global rank of every owner rank (one small
    all-gather over the model's group, at wrap time)."""
    if not options.strategy.is_hybrid or groups.shard_size == 1 or groups.replicate_size == 1:
        raise ValueError(
            "shard_optimizer_across_replicas=True splits a hybrid model's gradients and optimizer state over its "
            f"replicas; this wrap has {options.strategy.name} with F={groups.shard_size} ranks per shard group and "
            f"R={groups.replicate_size} replicas. Use HYBRID_SHARD or _HYBRID_SHARD_ZERO2 with 1 < F < W "
            "(sharding_factor=<ranks per node>), or FULL_SHARD, which shards everything over all ranks."
        )
    unbuilt = [
        name
        for name, on in (
            (f"shard_boundaries={options.shard_boundaries!r}", options.shard_boundaries not in ("flat", "chunks")),
            ("cpu_offload", options.offload_params),
            ("compress_inter_node", options.compress_inter_node is not None),
        )
        if on
    ]
    if unbuilt:
        raise NotBuiltError(
            f"shard_optimizer_across_replicas=True is not built with {', '.join(unbuilt)}; drop one of the two "
            '(shard_boundaries="flat", cpu_offload=None, compress_inter_node=None).'
        )
    v = groups.shard_rank * groups.replicate_size + groups.replicate_rank
    if options.shard_boundaries == "chunks":  # [Note: pieces in the chunked layout] (across_replicas.py)
        v = groups.replicate_rank * groups.shard_size + groups.shard_rank
    pairs = agree.gather_json([v, torch.distributed.get_rank()], groups.process_group)
    return tuple(rank for _, rank in sorted(pairs))


def _ranks_per_node(given: Optional[int]) -> object:
    """What nodes.Nodes.resolve will use, without raising (its errors come after the fingerprint)."""
    if given is not None:
        return given
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        return torch.distributed.get_world_size()
    return int(local) if local.isdigit() else local


def _parents(root: nn.Module) -> dict[nn.Module, list[tuple[nn.Module, str]]]:
    out: dict[nn.Module, list[tuple[nn.Module, str]]] = {}
    for parent in root.modules():
        for attr, child in parent._modules.items():
            if child is not None:
                out.setdefault(child, []).append((parent, attr))
    return out


def _broadcast_buffers(module: nn.Module, groups: ShardGroups, ignored: set[nn.Module]) -> None:
    if torch.distributed.get_world_size(groups.process_group) == 1:
        return
    for sub in module.modules():
        if sub in ignored:
            continue
        for buf in sub._buffers.values():
            if buf is not None:
                collectives.broadcast(buf, 0, groups.process_group)
