"""Optimizer state dicts of flatshard models, keyed by original parameter names (FQNs).

The optimizer sees shard views, so its state is sharded already: for each parameter, tensors with
one element per element of this rank's view ("pieces") and scalars such as Adam's ``step``. The
three types follow the model's ``state_dict_type``:

* FULL     ``{"state": {fqn: {key: full-shape tensor | scalar}}, "param_groups": [{..., "params": [fqn]}]}``,
           pieces gathered one unit and one state key at a time (an all-gather of the unit's flat layout);
* SHARDED  the same with each piece a ``ShardedTensor`` of the parameter's full shape, made of boxes
           as the model's SHARDED values are (sharded_tensors.py, [Note: flat ranges as boxes]), so
           ``torch.distributed.checkpoint`` can save and load it;
* LOCAL    the same with each piece as this rank holds it, plus ``"layouts"``: each unit's fingerprint.

``optim_state_dict_to_load`` turns any of them back into what ``optimizer.load_state_dict`` takes for
this rank's layout.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from flatshard.api import CheckpointError, FullOptimStateDictConfig, StateDictType
from flatshard.runtime.comm import agree, collectives
from flatshard.runtime.consistency import Phase
from flatshard.runtime.instrument import label
from flatshard.state.model_view import (
    EntryKind,
    LocalParam,
    ModelView,
    dtype_from,
    dtype_name,
    exchange,
    gather_to,
    layout_fingerprint,
    model_view,
)
from flatshard.state.settings import settings_of
from flatshard.state.sharded_tensors import ShardedPiece, pieces_from_sharded_tensors, sharded_tensor

SCALAR_TYPES = (bool, int, float, str, type(None))


def param_names(optim, view: ModelView) -> tuple[list, list[str], dict[str, Optional[LocalParam]]]:
    """(optimizer's params in state-dict order, their FQNs, fqn -> LocalParam or None for an unsharded one)."""
    by_view = {id(s.view): s for s in view.params}
    plain = {id(obj): name for kind, name, obj in view.entries if kind is EntryKind.UNMANAGED}
    params: list = []
    names: list[str] = []
    slots: dict[str, Optional[LocalParam]] = {}
    for group in optim.param_groups:
        for p in group["params"]:
            if id(p) in by_view:
                slot = by_view[id(p)]
                names.append(slot.fqn)
                slots[slot.fqn] = slot
            elif id(p) in plain:
                names.append(plain[id(p)])
                slots[plain[id(p)]] = None
            else:
                raise ValueError(
                    "the optimizer holds a parameter that is not in this model; build the optimizer from "
                    "model.parameters() of the FullyShardedDataParallel model (after wrapping)"
                )
            params.append(p)
    return params, names, slots


def describe(value: Any, local_shape: Optional[torch.Size], name: str, key: str) -> dict:
    """How one optimizer state value travels: a piece of the flattened parameter (shaped like its shard
    view, ``local_shape``), a scalar tensor, or a value. ``local_shape`` None: a parameter no unit owns."""
    if torch.is_tensor(value):
        if value.dim() == 0:
            return {"kind": "scalar", "value": value.item(), "dtype": dtype_name(value.dtype)}
        if local_shape is not None and tuple(value.shape) == tuple(local_shape):
            return {"kind": "piece", "dtype": dtype_name(value.dtype)}
        if local_shape is None:
            return {"kind": "whole", "dtype": dtype_name(value.dtype), "shape": list(value.shape)}
        raise CheckpointError(
            f"optimizer state {key!r} of {name} has shape {tuple(value.shape)}, neither a scalar nor one value per "
            "element of the parameter; flatshard shards only element-wise optimizer state (SGD, Adam, AdamW, ...)."
        )
    if isinstance(value, SCALAR_TYPES):
        return {"kind": "value", "value": value}
    raise CheckpointError(
        f"optimizer state {key!r} of {name} is a {type(value).__name__}; only tensors and numbers are saved"
    )


def scalar_tensor(d: dict) -> torch.Tensor:
    return torch.tensor(d["value"], dtype=dtype_from(d["dtype"]))


def json_groups(optim, names: list[str]) -> list[dict]:
    """param_groups with FQNs for params and hyperparameters as JSON values (tuples become lists)."""
    out, i = [], 0
    for group in optim.param_groups:
        g = {}
        for k, v in group.items():
            if k == "params":
                continue
            if torch.is_tensor(v):
                v = v.item()
            if isinstance(v, tuple):
                v = list(v)
            if not isinstance(v, (list, *SCALAR_TYPES)):
                raise CheckpointError(
                    f"optimizer hyperparameter {k!r} is a {type(v).__name__}; only numbers, strings and lists are saved"
                )
            g[k] = v
        g["params"] = names[i : i + len(group["params"])]
        i += len(group["params"])
        out.append(g)
    return out


@dataclass
class LocalOptimState:
    """An optimizer's state on this rank, keyed by FQN."""

    groups: list[dict]  # param_groups with FQNs (JSON)
    meta: dict[str, dict[str, dict]]  # {fqn: {key: description}}
    values: dict[str, dict[str, Any]]  # {fqn: {key: local value}}
    params: dict[str, Optional[LocalParam]]  # fqn -> its LocalParam (None: a parameter no unit owns)


def local_state(optim, view: ModelView, osd=None) -> LocalOptimState:
    params, names, slots = param_names(optim, view)
    packed = (osd or optim.state_dict())["state"]
    meta, values = {}, {}
    for i, (p, name) in enumerate(zip(params, names)):
        state = packed.get(i)
        if not state:
            continue
        shape = p.shape if slots[name] is not None else None
        meta[name] = {k: describe(v, shape, name, k) for k, v in state.items()}
        values[name] = dict(state)
    return LocalOptimState(json_groups(optim, names), meta, values, slots)


def merged_meta(meta: dict, view: ModelView) -> dict:
    """The union over ranks of each parameter's state description (a rank may hold none for a parameter)."""
    merged: dict[str, dict] = {}
    for rank_meta in agree.gather_json(meta, view.group, view.record):
        for name, keys in rank_meta.items():
            for k, d in keys.items():
                merged.setdefault(name, {}).setdefault(k, d)
    return merged


def optim_state_dict(model, optim, osd=None, group=None) -> dict:  # noqa: ARG001 - PyTorch's signature
    """FullyShardedDataParallel.optim_state_dict: this optimizer's state of the type ``state_dict_type`` sets.
    ``group`` is accepted for PyTorch's signature; the model's own process group is the one used."""
    view = model_view(model)
    with label("optim_state_dict"), view.phase(Phase.STATE_DICT):
        return _optim_state_dict(model, optim, osd, view)


def _optim_state_dict(model, optim, osd, view: ModelView) -> dict:
    settings = settings_of(model)
    local = local_state(optim, view, osd)
    kind, config = settings.state_dict_type, settings.optim_state_dict_config
    move = (lambda t: t.detach().cpu()) if config.offload_to_cpu else (lambda t: t.detach())
    if kind is StateDictType.FULL_STATE_DICT:
        assert isinstance(config, FullOptimStateDictConfig)  # each type has a config of its own class (settings.py)
        keep = not config.rank0_only or agree.rank_in(view.group) == 0
        return _full(view, local, merged_meta(local.meta, view), keep, move)
    if kind is StateDictType.SHARDED_STATE_DICT:
        state = _sharded(merged_meta(local.meta, view), local, move, view)
        return {"state": state, "param_groups": local.groups}
    state = {
        name: {k: move(v) if torch.is_tensor(v) else v for k, v in keys.items()} for name, keys in local.values.items()
    }
    layouts = {u.name: layout_fingerprint(u).tolist() for u in view.units}
    return {"state": state, "param_groups": local.groups, "layouts": layouts}


def _sharded(meta: dict, local: LocalOptimState, move, view: ModelView) -> dict:
    """SHARDED state: pieces as ShardedTensors. Every rank lists the same parameters and keys, as DCP
    plans by key: a rank without state for a parameter (it holds none of its elements) gives
    ShardedTensors with only an empty box and the scalars the other ranks hold."""
    state = {}
    for name, keys in meta.items():
        slot, mine = local.params[name], local.values.get(name, {})
        out = {}
        for k, d in keys.items():
            if d["kind"] == "piece":
                assert slot is not None  # a piece is described only for a parameter a unit owns (describe)
                v = mine.get(k)
                if v is None:
                    device = slot.unit.flat_group.owned.device
                    v = torch.zeros(slot.end - slot.start, dtype=dtype_from(d["dtype"]), device=device)
                out[k] = sharded_tensor(slot, move(v), view.record)
            elif k in mine:
                out[k] = move(mine[k]) if torch.is_tensor(mine[k]) else mine[k]
            elif d["kind"] != "whole":
                out[k] = scalar_tensor(d) if d["kind"] == "scalar" else d["value"]
        state[name] = out
    return state


def _full(view: ModelView, local: LocalOptimState, meta: dict, keep: bool, move) -> dict:
    """FULL: pieces gathered one unit and one state key at a time; ``keep`` False (rank0_only, not rank
    0): this rank takes part in the gathers and returns an empty dict."""
    full_values: dict[tuple[str, str], torch.Tensor] = {}
    for unit in view.units:  # one unit and one state key gathered at a time
        unit_slots = [s for s in view.params_of(unit) if s.fqn in meta]
        keys = sorted({(k, d["dtype"]) for s in unit_slots for k, d in meta[s.fqn].items() if d["kind"] == "piece"})
        for key, dtype in keys:
            size = unit.flat_group.owner_layout.shard_numel_of(unit.flat_group.owner_rank)
            flat = torch.zeros(size, dtype=dtype_from(dtype), device=unit.flat_group.owned.device)
            for s in unit_slots:
                v = local.values.get(s.fqn, {}).get(key)
                if v is not None:
                    flat[s.lo : s.hi].copy_(v.reshape(-1))
            full = gather_to(unit, flat)
            if keep:
                for s in unit_slots:
                    if key in meta[s.fqn]:
                        i = s.info
                        full_values[(s.fqn, key)] = move(full[i.offset : i.offset + i.numel].view(i.shape).clone())
            del full, flat
    if not keep:
        return {}
    state = {}
    for name, keys in meta.items():
        out = {}
        for k, d in keys.items():
            if d["kind"] == "piece":
                out[k] = full_values[(name, k)]
            elif d["kind"] == "scalar":
                out[k] = scalar_tensor(d)
            else:
                out[k] = move(local.values[name][k]) if d["kind"] == "whole" else d["value"]
        state[name] = out
    return {"state": state, "param_groups": local.groups}


# ---- loading --------------------------------------------------------------------------------
def optim_state_dict_to_load(  # group: PyTorch's signature; the model's own group is used
    model,
    optim,
    osd: dict,
    load_directly: bool = False,
    group=None,  # noqa: ARG001
) -> dict:
    """What ``optim.load_state_dict`` takes on this rank, from a FULL, SHARDED or LOCAL optimizer state dict
    (loaded into ``optim`` too with ``load_directly``)."""
    view = model_view(model)
    with label("optim_state_dict_to_load"), view.phase(Phase.STATE_DICT):
        packed = _to_load(model, optim, osd, view)
    if load_directly:
        optim.load_state_dict(packed)
    return packed


def _to_load(model, optim, osd: dict, view: ModelView) -> dict:
    settings = settings_of(model)
    params, names, slots = param_names(optim, view)
    config = settings.optim_state_dict_config
    if settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        assert isinstance(config, FullOptimStateDictConfig)  # each type has a config of its own class (settings.py)
        if config.rank0_only:
            osd = _from_rank0(osd, view, {n: slots[n] for n in names})
    osd, problem = _pieces(osd)
    problem = problem or check(optim, osd, names, settings.state_dict_type, view)
    agree.agree(problem, view.group, CheckpointError, view.record)
    state = osd.get("state", {})
    sharded = [(n, k) for n in names if n in state for k, v in state[n].items() if isinstance(v, ShardedPiece)]
    uncovered = [(n, k) for n, k in sharded if not _covers(state[n][k], slots[n])]
    exchanged = {}
    if any(agree.gather_json(bool(uncovered), view.group, view.record)):
        everyone = agree.gather_json(sharded, view.group, view.record)
        keys = sorted({(n, k) for r in everyone for n, k in r})
        pieces = {(n, k): state.get(n, {}).get(k) for n, k in keys}
        wanted = {(n, k): _range(slots.get(n)) for n, k in keys}
        exchanged = exchange(pieces, wanted, view)
    packed = {}
    for i, (p, name) in enumerate(zip(params, names)):
        if name not in state:
            continue
        slot = slots[name]
        held = optim.state.get(p, {})
        kind = settings.state_dict_type
        packed[i] = {
            k: _local_value(v, slot, exchanged.get((name, k)), kind, k, held.get(k)) for k, v in state[name].items()
        }
    return {"state": packed, "param_groups": groups_to_load(optim, osd)}


def _pieces(osd) -> tuple[Any, Optional[str]]:
    """``osd`` with every ShardedTensor in its state turned into a ShardedPiece (a new dict), and the first problem."""
    if not isinstance(osd, dict) or not isinstance(osd.get("state"), dict):
        return osd, None
    state, problem = {}, None
    for name, keys in osd["state"].items():
        state[name], bad = (
            pieces_from_sharded_tensors(keys, f"state/{name}/") if isinstance(keys, dict) else (keys, None)
        )
        problem = problem or bad
    return {**osd, "state": state}, problem


def _from_rank0(osd: Optional[dict], view: ModelView, slots: dict) -> dict:
    """FULL with ``rank0_only``: rank 0 holds the state dict; the others receive its structure and, one
    tensor at a time (a broadcast each), the full tensors, keeping only their own range of each."""
    group = view.group
    rank0 = agree.rank_in(group) == 0
    if rank0 and osd is None:
        raise TypeError(
            "optim_state_dict_to_load with rank0_only=True: rank 0 passes the full optimizer state dict, and "
            "it passed None"
        )
    source = osd if osd is not None else {}  # read on rank 0 only
    shape = None
    if rank0:
        shape = {
            "param_groups": source["param_groups"],
            "state": {n: {k: _shape_of(v) for k, v in keys.items()} for n, keys in source["state"].items()},
        }
    shape = agree.gather_json(shape, group, view.record)[0]
    state = {}
    for name, keys in shape["state"].items():
        out = {}
        for k, d in keys.items():
            if d["kind"] != "tensor":
                out[k] = (
                    source["state"][name][k] if rank0 else (scalar_tensor(d) if d["kind"] == "scalar" else d["value"])
                )
                continue
            device = agree.collective_device(group)
            if rank0:
                full = source["state"][name][k].to(device).contiguous()
            else:
                full = torch.empty(d["shape"], dtype=dtype_from(d["dtype"]), device=device)
            if agree.world_of(group) > 1:
                view.record(collectives.broadcast(full, 0, group))
            slot = slots.get(name)
            if slot is None:
                out[k] = full
            else:  # a piece covering this rank's range: loads without another exchange
                a, b = (0, full.numel()) if rank0 else (slot.start, slot.end)
                out[k] = ShardedPiece(
                    full.reshape(-1)[a:b].clone() if not rank0 else full.reshape(-1), full.shape, a, b
                )
        state[name] = out
    return {"state": state, "param_groups": shape["param_groups"]}


def _shape_of(v) -> dict:
    if torch.is_tensor(v) and v.dim() > 0:
        return {"kind": "tensor", "shape": list(v.shape), "dtype": dtype_name(v.dtype)}
    return describe(v, None, "", "") if torch.is_tensor(v) else {"kind": "value", "value": v}


def _range(slot) -> tuple[int, int]:
    return (slot.start, slot.end) if slot is not None else (0, 0)


def _covers(piece: ShardedPiece, slot) -> bool:
    return slot is not None and piece.start <= slot.start and slot.end <= piece.end


def _local_value(v, slot, exchanged, kind, key, held):
    if isinstance(v, ShardedPiece):
        t = exchanged if exchanged is not None else v.tensor.reshape(-1)[slot.start - v.start : slot.end - v.start]
        return t.clone().view(slot.view.shape)  # shaped like the shard view it belongs to
    if slot is not None and torch.is_tensor(v) and _per_element(v, slot, kind, key, held):
        return v.reshape(-1)[slot.start : slot.end].clone().view(slot.view.shape)
    return v.clone() if torch.is_tensor(v) else v


def _per_element(v: torch.Tensor, slot, kind, key: str, held) -> bool:
    """Whether a whole tensor ``v`` is per-element state of the slot's parameter (loaded as this rank's
    piece of it) rather than a scalar such as ``step``. For a 0-D parameter the two look alike (both
    0-D, in FULL state dicts and in SHARDED ones, where 0-D values are whole: sharded_tensors.py): the
    optimizer's own state decides when it has some (per-element state of a shard view is 1-D), and
    before its first step every key but ``step`` is per-element."""
    if v.dim() > 0:
        return kind is StateDictType.FULL_STATE_DICT
    if kind is StateDictType.LOCAL_STATE_DICT or tuple(slot.info.shape) != ():
        return False
    if torch.is_tensor(held):
        return held.dim() == 1
    return key != "step"


def check(optim, osd: dict, names: list[str], kind: StateDictType, view: ModelView) -> Optional[str]:
    """Why ``osd`` cannot load into ``optim`` (holding the parameters ``names``), or None."""
    if not isinstance(osd, dict) or "param_groups" not in osd or "state" not in osd:
        return (
            "the optimizer state dict has no 'state' and 'param_groups'; pass what "
            "FullyShardedDataParallel.optim_state_dict(model, optim) returned"
        )
    saved = osd["param_groups"]
    if len(saved) != len(optim.param_groups):
        return (
            f"the optimizer state dict has {len(saved)} param groups, the optimizer {len(optim.param_groups)}; "
            "build the optimizer as when saving"
        )
    i = 0
    for n, (g_saved, g_now) in enumerate(zip(saved, optim.param_groups)):
        here = names[i : i + len(g_now["params"])]
        i += len(g_now["params"])
        if list(g_saved["params"]) != here:
            missing = sorted(set(here) - set(g_saved["params"]))
            extra = sorted(set(g_saved["params"]) - set(here))
            return (
                f"param group {n} of the optimizer state dict does not match the optimizer (missing {missing}, "
                f"unexpected {extra}); build the optimizer's param groups as when saving"
            )
    unknown = sorted(set(osd["state"]) - set(names))
    if unknown:
        return f"the optimizer state dict has state for parameters this optimizer does not hold: {unknown}"
    if kind is StateDictType.LOCAL_STATE_DICT:
        layouts = osd.get("layouts", {})
        for unit in view.units:
            if layouts.get(unit.name) != layout_fingerprint(unit).tolist():
                return (
                    f"LOCAL optimizer state dict for unit {unit.name!r} was saved with another layout; a LOCAL state "
                    "dict loads only into the same layout. Use SHARDED or FULL (or flatshard.checkpoint) to reshard."
                )
    return None


def groups_to_load(optim, osd: dict) -> list[dict]:
    """The saved hyperparameters with this optimizer's parameter indices (tuples kept as tuples)."""
    out, i = [], 0
    for g_saved, g_now in zip(osd["param_groups"], optim.param_groups):
        g = {}
        for k, v in g_saved.items():
            if k == "params":
                continue
            g[k] = tuple(v) if isinstance(g_now.get(k), tuple) and isinstance(v, list) else v
        g["params"] = list(range(i, i + len(g_now["params"])))
        i += len(g_now["params"])
        out.append(g)
    return out
