"""State dicts of flatshard models: FULL, LOCAL and SHARDED, as PyTorch FSDP names and means them.

``FullyShardedDataParallel``'s state-dict methods delegate here; the optimizer's live in
``checkpoint_optim.py`` and the files on disk in ``checkpoint.py``.

* FULL     keys exactly those of the unwrapped model, full tensors, gathered one unit at a time
           (never the whole model gathered at once); ``rank0_only`` keeps them on rank 0 only.
* LOCAL    each unit's flat shard as it is (``<unit>._flat_param``) with a layout fingerprint
           (``<unit>._flat_param_layout``); cheap, and loads only into the same layout.
* SHARDED  for each original parameter a ``ShardedTensor`` of its full shape whose local shards are
           boxes covering exactly the elements this rank holds ([Note: flat ranges as boxes]), views
           of the flat shard; ``torch.distributed.checkpoint`` saves and loads it (resharding), and
           it loads into any world size, sharding factor or strategy on the same processes.
           ``ShardedPiece`` (a flat range) is the internal form the load path reduces them to
           (sharded_tensors.py makes and reads them).

Names never contain wrapper prefixes. Buffers, ignored parameters and extra state appear as full
tensors (every rank holds them whole) in every type. Load errors are raised on every rank alike
([Note: equal errors], checkpoint_sync.py).
"""
from __future__ import annotations

import contextlib
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.nn.modules.module import _IncompatibleKeys

from flatshard.api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from flatshard.checkpoint_sync import agree, all_gather_single, collective_device, gather_json, world_of
from flatshard.sharded_tensors import ShardedPiece, flat_range_boxes, pieces_from_sharded_tensors, sharded_tensor

_HOPS = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module")  # wrapper attributes that add no name
_SETTINGS = "_flatshard_state_dict_settings"
_CONFIGS = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}
DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(), FullOptimStateDictConfig())
LOCAL_SUFFIX, LAYOUT_SUFFIX = "_flat_param", "_flat_param_layout"


# ---- what a model holds, in state-dict order ---------------------------------------------------
@dataclass
class Slot:
    """One original parameter of a unit, seen from this rank."""

    fqn: str  # canonical name (its first name in state-dict order)
    names: list[str]
    unit: Any
    info: Any
    view: nn.Parameter
    start: int  # elements [start, end) of the flattened parameter that this rank holds
    end: int
    lo: int  # where they sit in the flat shard
    hi: int


@dataclass
class ModelView:
    """Every state-dict entry of a module tree (kind, name, object), with wrapper hops removed."""

    entries: list[tuple[str, str, Any]] = field(default_factory=list)  # ("param", name, Slot) | ("plain"|"buffer", name, tensor) | ("extra", name, module)
    slots: list[Slot] = field(default_factory=list)
    wrappers: list[tuple[str, Any]] = field(default_factory=list)  # (clean prefix, wrapper)
    group: Any = None

    @property
    def units(self) -> list:
        seen, out = set(), []
        for s in self.slots:
            if id(s.unit) not in seen:
                seen.add(id(s.unit))
                out.append(s.unit)
        return out

    def slots_of(self, unit) -> list[Slot]:
        if not hasattr(self, "_by_unit"):
            self._by_unit: dict[int, list[Slot]] = {}
            for s in self.slots:
                self._by_unit.setdefault(id(s.unit), []).append(s)
        return self._by_unit.get(id(unit), [])

    def names(self) -> list[str]:
        return [name for _, name, _ in self.entries]


def model_view(module: nn.Module, prefix: str = "") -> ModelView:
    from flatshard.fsdp import FullyShardedDataParallel as FSDP

    wrappers = FSDP.fsdp_modules(module)
    owners = {}
    for w in wrappers:
        unit = w._unit
        rank = unit.groups.shard_rank
        for info, view, rng, loc in zip(unit.layout.infos, unit.shard_views, unit.layout.param_ranges(rank), unit.layout.local_slices(rank)):
            owners[id(view)] = (unit, info, view, rng, loc)
    out = ModelView(group=wrappers[0]._unit.groups.process_group if wrappers else None)
    slots: dict[int, Slot] = {}
    _walk(module, prefix, out, owners, slots, FSDP)
    return out


def _walk(module: nn.Module, prefix: str, out: ModelView, owners: dict, slots: dict, fsdp_cls) -> None:
    if isinstance(module, fsdp_cls):
        out.wrappers.append((prefix, module))
    for name, p in module._parameters.items():
        if p is None:
            continue
        if id(p) in owners:
            if id(p) not in slots:
                unit, info, view, (a, b), (lo, hi) = owners[id(p)]
                slots[id(p)] = Slot(prefix + name, [], unit, info, view, a, b, lo, hi)
                out.slots.append(slots[id(p)])
            slots[id(p)].names.append(prefix + name)
            out.entries.append(("param", prefix + name, slots[id(p)]))
        else:
            out.entries.append(("plain", prefix + name, p))
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            out.entries.append(("buffer", prefix + name, b))
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        out.entries.append(("extra", prefix + "_extra_state", module))
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, prefix if name in _HOPS else f"{prefix}{name}.", out, owners, slots, fsdp_cls)


def rank_in(group) -> int:
    return dist.get_rank(group) if world_of(group) > 1 else 0


def gather_flat(unit, flat: torch.Tensor) -> torch.Tensor:
    """The shard group's ``flat`` tensors (S elements each) concatenated: F·S elements, on every rank."""
    groups = unit.groups
    if groups.shard_size == 1:
        return flat
    home = flat.device  # CPU under CPUOffload; the collective runs on the compute device
    flat = flat.to(unit.compute_device)
    full = torch.empty(unit.layout.padded, dtype=flat.dtype, device=flat.device)
    all_gather_single(full, flat.contiguous(), group=groups.shard_group)
    return full.to(home)


def layout_fingerprint(unit) -> torch.Tensor:
    """What must match for a LOCAL state dict to load: F, shard rank, sizes and every name and shape."""
    text = ";".join(f"{i.name}:{tuple(i.shape)}" for i in unit.layout.infos)
    return torch.tensor([unit.groups.shard_size, unit.groups.shard_rank, unit.layout.total,
                         unit.layout.shard_numel, zlib.crc32(text.encode())], dtype=torch.int64)


# ---- settings ---------------------------------------------------------------------------------
def settings_of(module: nn.Module) -> StateDictSettings:
    from flatshard.fsdp import FullyShardedDataParallel as FSDP

    wrappers = FSDP.fsdp_modules(module)
    return wrappers[0].__dict__.get(_SETTINGS, DEFAULT_SETTINGS) if wrappers else DEFAULT_SETTINGS


def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> StateDictSettings:
    from flatshard.fsdp import FullyShardedDataParallel as FSDP

    if not isinstance(state_dict_type, StateDictType):
        raise TypeError(f"state_dict_type must be a flatshard.StateDictType, got {state_dict_type!r}")
    config_cls, optim_cls = _CONFIGS[state_dict_type]
    config = state_dict_config if state_dict_config is not None else config_cls()
    optim_config = optim_state_dict_config if optim_state_dict_config is not None else optim_cls()
    if not isinstance(config, config_cls) or not isinstance(optim_config, optim_cls):
        raise TypeError(
            f"{state_dict_type.name} takes a {config_cls.__name__} and a {optim_cls.__name__}; got "
            f"{type(config).__name__} and {type(optim_config).__name__}"
        )
    if getattr(config, "_use_dtensor", False) or getattr(optim_config, "_use_dtensor", False):
        raise ValueError("_use_dtensor=True is not supported: flatshard's SHARDED values are ShardedTensors (as FSDP's "
                         "default); leave _use_dtensor False")
    wrappers = FSDP.fsdp_modules(module)
    if not wrappers:
        raise ValueError("set_state_dict_type needs a module that contains a FullyShardedDataParallel")
    previous = settings_of(module)
    new = StateDictSettings(state_dict_type, config, optim_config)
    for w in wrappers:
        w.__dict__[_SETTINGS] = new
    return previous


@contextlib.contextmanager
def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None) -> Iterator[None]:
    from flatshard.fsdp import FullyShardedDataParallel as FSDP

    before = [(w, w.__dict__.get(_SETTINGS)) for w in FSDP.fsdp_modules(module)]
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for w, old in before:
            if old is None:
                w.__dict__.pop(_SETTINGS, None)
            else:
                w.__dict__[_SETTINGS] = old


# ---- module state dicts -----------------------------------------------------------------------
def module_state_dict(module, base_state_dict, *args, destination=None, prefix: str = "", keep_vars: bool = False):
    """The module's state dict of the type set by ``state_dict_type``; called by ``nn.Module.state_dict``'s
    recursion too (a plain parent passes ``destination`` and ``prefix``). ``keep_vars`` has no effect:
    FULL values are copies, SHARDED and LOCAL values detached views."""
    if args:  # nn.Module.state_dict's deprecated positional form: (destination, prefix, keep_vars)
        destination = args[0]
        prefix = args[1] if len(args) > 1 else prefix
    if destination is None:
        destination = OrderedDict()
    settings = settings_of(module)
    view = model_view(module, prefix)
    kind = settings.state_dict_type
    if kind is StateDictType.FULL_STATE_DICT:
        _full(view, destination, settings.state_dict_config)
    elif kind is StateDictType.LOCAL_STATE_DICT:
        _local(view, destination, settings.state_dict_config)
    else:
        _sharded(view, destination, settings.state_dict_config)
    return destination


def _to(t: torch.Tensor, config: StateDictConfig) -> torch.Tensor:
    return t.detach().cpu() if config.offload_to_cpu else t.detach()


def _full(view: ModelView, destination: dict, config: FullStateDictConfig) -> None:
    keep = not config.rank0_only or rank_in(view.group) == 0
    values: dict[int, torch.Tensor] = {}
    for unit in view.units:  # one unit gathered at a time
        full = gather_flat(unit, unit.flat_shard.detach())
        if keep:
            for slot in view.slots_of(unit):
                i = slot.info
                piece = full[i.offset : i.offset + i.numel].view(i.shape)
                values[id(slot)] = piece.to("cpu", copy=True) if config.offload_to_cpu else piece.clone()
        del full
    if not keep:
        return
    for kind, name, obj in view.entries:
        destination[name] = _plain_value(kind, obj, config) if kind != "param" else values[id(obj)]


def _plain_value(kind: str, obj, config: StateDictConfig):
    return obj.get_extra_state() if kind == "extra" else _to(obj, config)


def _local(view: ModelView, destination: dict, config: LocalStateDictConfig) -> None:
    for prefix, wrapper in view.wrappers:
        destination[prefix + LOCAL_SUFFIX] = _to(wrapper._unit.flat_shard, config)
        destination[prefix + LAYOUT_SUFFIX] = layout_fingerprint(wrapper._unit)
    for kind, name, obj in view.entries:
        if kind != "param":
            destination[name] = _plain_value(kind, obj, config)


def _sharded(view: ModelView, destination: dict, config: ShardedStateDictConfig) -> None:
    values: dict[int, ShardedTensor] = {}  # tied names share one ShardedTensor
    for kind, name, obj in view.entries:
        if kind == "param":
            if id(obj) not in values:
                values[id(obj)] = sharded_tensor(obj, _to(obj.view, config))
            destination[name] = values[id(obj)]
        else:
            destination[name] = _plain_value(kind, obj, config)


# ---- loading --------------------------------------------------------------------------------
def load_module_state_dict(module, base_load_state_dict, state_dict, *, strict: bool = True, assign: bool = False):
    view = model_view(module)
    settings = settings_of(module)
    kind = settings.state_dict_type
    if assign:
        agree("load_state_dict(assign=True) is not supported by flatshard: parameters live in flat shards; "
              "call it with assign=False (values are copied in place)", view.group, RuntimeError)
    state_dict, problem = pieces_from_sharded_tensors(state_dict)
    expected = view.names() if kind is not StateDictType.LOCAL_STATE_DICT else _local_names(view)
    missing = [n for n in expected if n not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if problem is None and strict:
        problem = _key_problem(type(module).__name__, missing, unexpected)
    if problem is None:
        problem = _check_values(view, state_dict, kind)
    agree(problem, view.group, RuntimeError)
    if kind is StateDictType.LOCAL_STATE_DICT:
        staged = _stage_local(view, state_dict)
    else:
        staged = stage_pieces(view, state_dict, view.group)
    copy_into_model(view, staged, state_dict)
    return _IncompatibleKeys(missing, unexpected)


def _local_names(view: ModelView) -> list[str]:
    names = [p + s for p, _ in view.wrappers for s in (LOCAL_SUFFIX, LAYOUT_SUFFIX)]
    return names + [name for kind, name, _ in view.entries if kind != "param"]


def _key_problem(owner: str, missing: list[str], unexpected: list[str]) -> Optional[str]:
    parts = []
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    if not parts:
        return None
    return f"Error(s) in loading state_dict for {owner}:\n\t" + "\n\t".join(parts) + (
        "\n\tSave and load with the same state_dict_type, or pass strict=False to skip these keys."
    )


def _check_values(view: ModelView, sd: dict, kind: StateDictType) -> Optional[str]:
    if kind is StateDictType.LOCAL_STATE_DICT:
        for prefix, wrapper in view.wrappers:
            got = sd.get(prefix + LAYOUT_SUFFIX)
            want = layout_fingerprint(wrapper._unit)
            if got is not None and not torch.equal(torch.as_tensor(got).cpu(), want):
                g = torch.as_tensor(got).tolist()
                return (
                    f"LOCAL state dict for unit {wrapper._unit.name!r} was saved with a different layout (F={g[0]}, shard "
                    f"rank {g[1]}, {g[2]} elements) than this model has (F={int(want[0])}, shard rank {int(want[1])}, "
                    f"{int(want[2])} elements); a LOCAL state dict loads only into the same layout. Use a SHARDED or "
                    "FULL state dict (or flatshard.checkpoint) to change world size, sharding factor or strategy."
                )
        return None
    for kind_, name, obj in view.entries:
        if kind_ == "extra" or name not in sd:
            continue
        value = sd[name]
        want = obj.info.shape if kind_ == "param" else obj.shape
        got = value.shape if isinstance(value, ShardedPiece) else getattr(value, "shape", None)
        if got is None:
            return f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor; it cannot load into {name}"
        if tuple(got) != tuple(want):
            return (f"size mismatch for {name}: copying a param with shape {tuple(got)} from checkpoint, the shape in "
                    f"current model is {tuple(want)}. Load a state dict of the same model.")
    return None


def _stage_local(view: ModelView, sd: dict) -> dict[int, torch.Tensor]:
    staged = {}
    for prefix, wrapper in view.wrappers:
        flat = sd.get(prefix + LOCAL_SUFFIX)
        if flat is None:
            continue
        for slot in view.slots_of(wrapper._unit):
            staged[id(slot)] = flat.reshape(-1)[slot.lo : slot.hi]
    return staged


def stage_pieces(view: ModelView, sd: dict, group) -> dict[int, torch.Tensor]:
    """For each slot, its [start, end) elements from FULL tensors or SHARDED pieces; pieces that do not
    cover what this rank needs are exchanged with the other ranks (one all-gather per such parameter)."""
    staged, need = {}, []
    for slot in view.slots:
        value = next((sd[n] for n in slot.names if n in sd), None)
        if value is None:
            continue
        if isinstance(value, ShardedPiece):
            if value.start <= slot.start and slot.end <= value.end:
                staged[id(slot)] = value.tensor.reshape(-1)[slot.start - value.start : slot.end - value.start]
            else:
                need.append(slot.fqn)
        else:
            staged[id(slot)] = value.reshape(-1)[slot.start : slot.end]
    if any(gather_json(bool(need), group)):
        pieces = {s.fqn: next((sd[n] for n in s.names if n in sd), None) for s in view.slots}
        wanted = {s.fqn: (s.start, s.end) for s in view.slots}
        got = exchange(pieces, wanted, group)
        staged.update({id(s): got[s.fqn] for s in view.slots if s.fqn in got})
    return staged


def exchange(pieces: dict[str, Any], wanted: dict[str, tuple[int, int]], group) -> dict[str, torch.Tensor]:
    """Redistribute flat pieces: ``pieces[key]`` is this rank's ShardedPiece (or full tensor, or None);
    every rank gets elements ``wanted[key]``. The keys must be the same, in the same order, on every rank."""
    meta = {k: _piece_range(v) for k, v in pieces.items()}
    everyone = gather_json(meta, group)
    device = collective_device(group)
    out = {}
    for key, piece in pieces.items():
        ranges = [m[key] for m in everyone]
        if all(r is None for r in ranges):
            continue
        longest = max(r[1] - r[0] for r in ranges if r is not None)
        dtype = _piece_tensor(piece).dtype if piece is not None else _dtype_of(ranges)
        local = torch.zeros(longest, dtype=dtype, device=device)
        if piece is not None:
            t = _piece_tensor(piece).reshape(-1)
            local[: t.numel()] = t.to(dtype)
        everything = torch.empty(len(ranges) * longest, dtype=dtype, device=device)
        all_gather_single(everything, local, group=group)
        a, b = wanted[key]
        dest = torch.zeros(b - a, dtype=dtype, device=device)
        for r, rng in enumerate(ranges):
            if rng is None:
                continue
            lo, hi = max(a, rng[0]), min(b, rng[1])
            if hi > lo:
                dest[lo - a : hi - a] = everything[r * longest + lo - rng[0] : r * longest + hi - rng[0]]
        out[key] = dest
    return out


def _piece_range(v) -> Optional[list]:
    if v is None:
        return None
    if isinstance(v, ShardedPiece):
        return [v.start, v.end, str(v.dtype)]
    return [0, v.numel(), str(v.dtype)]


def _piece_tensor(v) -> torch.Tensor:
    return v.tensor if isinstance(v, ShardedPiece) else v


def _dtype_of(ranges: list) -> torch.dtype:
    name = next(r[2] for r in ranges if r is not None)
    return getattr(torch, name.replace("torch.", ""))


@torch.no_grad()
def copy_into_model(view: ModelView, staged: dict[int, torch.Tensor], sd: dict) -> None:
    """Write staged slot values into the flat shards (in place: units re-gather on the next forward,
    their flat shard's version having changed), and buffers, ignored parameters and extra state."""
    for slot in view.slots:
        value = staged.get(id(slot))
        if value is not None:
            slot.unit.flat_shard[slot.lo : slot.hi].copy_(value.reshape(-1))
    for kind, name, obj in view.entries:
        if kind == "param" or name not in sd:
            continue
        if kind == "extra":
            obj.set_extra_state(sd[name])
        else:
            value = sd[name]
            obj.copy_(value.tensor if isinstance(value, ShardedPiece) else value)


# ---- optimizer state dicts (checkpoint_optim.py) --------------------------------------------------
def optim_state_dict(model, optim, optim_state_dict=None, group=None):
    from flatshard import checkpoint_optim

    return checkpoint_optim.optim_state_dict(model, optim, optim_state_dict, group)


def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None):
    from flatshard import checkpoint_optim

    osd = checkpoint_optim.optim_state_dict_to_load(model, optim, optim_state_dict, group)
    if load_directly:
        optim.load_state_dict(osd)
    return osd


__all__ = [
    "ShardedPiece", "flat_range_boxes", "sharded_tensor", "module_state_dict", "load_module_state_dict",
    "state_dict_type", "set_state_dict_type", "optim_state_dict", "optim_state_dict_to_load", "OptimStateDictConfig",
]
