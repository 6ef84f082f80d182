"""Model state dicts of flatshard models: FULL, LOCAL and SHARDED, as PyTorch FSDP names and means them.

The front ends' ``state_dict`` / ``load_state_dict`` call here; the optimizer's state dicts are in
optim.py, the settings in settings.py, the files on disk in the checkpoint package.

* FULL     keys exactly those of the unwrapped model, full tensors, gathered one unit at a time
           (never the whole model gathered at once); ``rank0_only`` keeps them on rank 0 only.
* LOCAL    each unit's flat shard as it is (``<unit>._flat_param``) with a layout fingerprint
           (``<unit>._flat_param_layout``); cheap, and loads only into the same layout.
* SHARDED  for each original parameter a ``ShardedTensor`` of its full shape whose local shards are
           boxes covering exactly the elements this rank holds ([Note: flat ranges as boxes],
           sharded_tensors.py), views of the flat shard; ``torch.distributed.checkpoint`` saves and
           loads it (resharding), and it loads into any world size, sharding factor or strategy on
           the same processes. ``ShardedPiece`` (a flat range) is the form the load path reduces them to.

Names never contain wrapper prefixes. Buffers, ignored parameters and extra state appear as full
tensors (every rank holds them whole) in every type. Load errors are raised on every rank alike
([Note: equal errors], runtime/comm/agree.py). Collectives are recorded under the ``state_dict`` phase.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Optional, Union

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.nn.modules.module import _IncompatibleKeys

from flatshard.api import (
    FullStateDictConfig,
    LocalStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictType,
)
from flatshard.runtime.comm import agree
from flatshard.runtime.consistency import Phase
from flatshard.runtime.instrument import label
from flatshard.runtime.tree import WRAPPED, UnitHost, unit_hosts
from flatshard.state.model_view import EntryKind, ModelView, exchange, gather_to, layout_fingerprint, model_view
from flatshard.state.settings import settings_of
from flatshard.state.sharded_tensors import ShardedPiece, pieces_from_sharded_tensors, sharded_tensor

LOCAL_SUFFIX, LAYOUT_SUFFIX = "_flat_param", "_flat_param_layout"


# ---- module state dicts -----------------------------------------------------------------------
def module_state_dict(module, *args, destination=None, prefix: str = "", keep_vars: bool = False):  # noqa: ARG001
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
    kind, config = settings.state_dict_type, settings.state_dict_config  # a config of the type's own class
    with label("state_dict"), view.phase(Phase.STATE_DICT):
        if kind is StateDictType.FULL_STATE_DICT:
            assert isinstance(config, FullStateDictConfig)
            _full(view, destination, config)
        elif kind is StateDictType.LOCAL_STATE_DICT:
            assert isinstance(config, LocalStateDictConfig)
            _local(view, destination, config)
        else:
            assert isinstance(config, ShardedStateDictConfig)
            _sharded(view, destination, config)
    return destination


def _to(t: torch.Tensor, config: StateDictConfig) -> torch.Tensor:
    return t.detach().cpu() if config.offload_to_cpu else t.detach()


def _full(view: ModelView, destination: dict, config: FullStateDictConfig) -> None:
    keep = not config.rank0_only or agree.rank_in(view.group) == 0
    values: dict[int, torch.Tensor] = {}
    for unit in view.units:  # one unit gathered at a time
        full = gather_to(unit, unit.flat_group.owned.detach())
        if keep:
            for param in view.params_of(unit):
                i = param.info
                piece = full[i.offset : i.offset + i.numel].view(i.shape)
                values[id(param)] = piece.to("cpu", copy=True) if config.offload_to_cpu else piece.clone()
        del full
    if not keep:
        return
    for kind, name, obj in view.entries:
        destination[name] = values[id(obj)] if kind is EntryKind.PARAM else _plain_value(kind, obj, config)


def _plain_value(kind: EntryKind, obj, config: StateDictConfig):
    return obj.get_extra_state() if kind is EntryKind.EXTRA else _to(obj, config)


def _local(view: ModelView, destination: dict, config: LocalStateDictConfig) -> None:
    for prefix, host in view.hosts:
        destination[prefix + LOCAL_SUFFIX] = _to(host._unit.flat_group.owned, config)
        destination[prefix + LAYOUT_SUFFIX] = layout_fingerprint(host._unit)
    for kind, name, obj in view.entries:
        if kind is not EntryKind.PARAM:
            destination[name] = _plain_value(kind, obj, config)


def _sharded(view: ModelView, destination: dict, config: ShardedStateDictConfig) -> None:
    values: dict[int, Union[ShardedTensor, torch.Tensor]] = {}  # tied names share one (a 0-D one: a tensor)
    for kind, name, obj in view.entries:
        if kind is EntryKind.PARAM:
            if id(obj) not in values:
                values[id(obj)] = sharded_tensor(obj, _to(obj.view, config), view.record)
            destination[name] = values[id(obj)]
        else:
            destination[name] = _plain_value(kind, obj, config)


# ---- loading --------------------------------------------------------------------------------
def load_module_state_dict(module, state_dict, *, strict: bool = True, assign: bool = False):
    view = model_view(module)
    with label("load_state_dict"), view.phase(Phase.STATE_DICT):
        return _load(module, view, state_dict, strict, assign)


def _load(module, view: ModelView, state_dict, strict: bool, assign: bool):
    kind = settings_of(module).state_dict_type
    if assign:
        agree.agree(
            "load_state_dict(assign=True) is not supported by flatshard: parameters live in flat shards; "
            "call it with assign=False (values are copied in place)",
            view.group,
            RuntimeError,
            view.record,
        )
    state_dict, problem = pieces_from_sharded_tensors(state_dict)
    expected = view.names() if kind is not StateDictType.LOCAL_STATE_DICT else _local_names(view)
    missing = [n for n in expected if n not in state_dict]
    unexpected = [k for k in state_dict if k not in set(expected)]
    if problem is None and strict:
        problem = _key_problem(type(module).__name__, missing, unexpected)
    if problem is None:
        problem = _check_values(view, state_dict, kind)
    agree.agree(problem, view.group, RuntimeError, view.record)
    if kind is StateDictType.LOCAL_STATE_DICT:
        staged = _stage_local(view, state_dict)
    else:
        staged = stage_pieces(view, state_dict)
    copy_into_model(view, staged, state_dict)
    return _IncompatibleKeys(missing, unexpected)


def _local_names(view: ModelView) -> list[str]:
    names = [p + s for p, _ in view.hosts for s in (LOCAL_SUFFIX, LAYOUT_SUFFIX)]
    return names + [e.name for e in view.entries if e.kind is not EntryKind.PARAM]


def _key_problem(owner: str, missing: list[str], unexpected: list[str]) -> Optional[str]:
    parts = []
    if missing:
        parts.append("Missing key(s) in state_dict: " + ", ".join(f'"{k}"' for k in missing) + ".")
    if unexpected:
        parts.append("Unexpected key(s) in state_dict: " + ", ".join(f'"{k}"' for k in unexpected) + ".")
    if not parts:
        return None
    return (
        f"Error(s) in loading state_dict for {owner}:\n\t"
        + "\n\t".join(parts)
        + ("\n\tSave and load with the same state_dict_type, or pass strict=False to skip these keys.")
    )


def _check_values(view: ModelView, sd: dict, kind: StateDictType) -> Optional[str]:
    if kind is StateDictType.LOCAL_STATE_DICT:
        return _check_local(view, sd)
    for kind_, name, obj in view.entries:
        if kind_ is EntryKind.EXTRA or name not in sd:
            continue
        value = sd[name]
        want = obj.info.shape if kind_ is EntryKind.PARAM else obj.shape
        got = value.shape if isinstance(value, ShardedPiece) else getattr(value, "shape", None)
        if got is None:
            return f"state_dict[{name!r}] is a {type(value).__name__}, not a tensor; it cannot load into {name}"
        if tuple(got) != tuple(want):
            return (
                f"size mismatch for {name}: copying a param with shape {tuple(got)} from checkpoint, the shape in "
                f"current model is {tuple(want)}. Load a state dict of the same model."
            )
    return None


def _check_local(view: ModelView, sd: dict) -> Optional[str]:
    for prefix, host in view.hosts:
        got = sd.get(prefix + LAYOUT_SUFFIX)
        want = layout_fingerprint(host._unit)
        if got is not None and not torch.equal(torch.as_tensor(got).cpu(), want):
            g = torch.as_tensor(got).tolist()
            return (
                f"LOCAL state dict for unit {host._unit.name!r} was saved with a different layout (F={g[0]}, shard "
                f"rank {g[1]}, {g[2]} elements) than this model has (F={int(want[0])}, shard rank {int(want[1])}, "
                f"{int(want[2])} elements); a LOCAL state dict loads only into the same layout. Use a SHARDED or "
                "FULL state dict (or flatshard.checkpoint) to change world size, sharding factor or strategy."
            )
    return None


def _stage_local(view: ModelView, sd: dict) -> dict[int, torch.Tensor]:
    staged = {}
    for prefix, host in view.hosts:
        flat = sd.get(prefix + LOCAL_SUFFIX)
        if flat is None:
            continue
        for param in view.params_of(host._unit):
            staged[id(param)] = flat.reshape(-1)[param.lo : param.hi]
    return staged


def stage_pieces(view: ModelView, sd: dict) -> dict[int, torch.Tensor]:
    """For each parameter, its [start, end) elements from FULL tensors or SHARDED pieces; pieces that do not
    cover what this rank needs are exchanged with the other ranks (one all-gather per such parameter)."""
    staged, need = {}, []
    for param in view.params:
        value = next((sd[n] for n in param.names if n in sd), None)
        if value is None:
            continue
        if isinstance(value, ShardedPiece):
            if value.start <= param.start and param.end <= value.end:
                staged[id(param)] = value.tensor.reshape(-1)[param.start - value.start : param.end - value.start]
            else:
                need.append(param.fqn)
        else:
            staged[id(param)] = value.reshape(-1)[param.start : param.end]
    if any(agree.gather_json(bool(need), view.group, view.record)):
        pieces = {s.fqn: next((sd[n] for n in s.names if n in sd), None) for s in view.params}
        wanted = {s.fqn: (s.start, s.end) for s in view.params}
        got = exchange(pieces, wanted, view)
        staged.update({id(s): got[s.fqn] for s in view.params if s.fqn in got})
    return staged


@torch.no_grad()
def copy_into_model(view: ModelView, staged: dict[int, torch.Tensor], sd: dict) -> None:
    """Write staged parameter values into the flat shards (in place: units re-gather on the next forward,
    their flat shard's version having changed), and buffers, ignored parameters and extra state."""
    for param in view.params:
        value = staged.get(id(param))
        if value is not None:
            param.unit.flat_group.owned[param.lo : param.hi].copy_(value.reshape(-1))
    for kind, name, obj in view.entries:
        if kind is EntryKind.PARAM or name not in sd:
            continue
        if kind is EntryKind.EXTRA:
            obj.set_extra_state(sd[name])
        else:
            value = sd[name]
            obj.copy_(value.tensor if isinstance(value, ShardedPiece) else value)


# [Note: loading through a plain parent]
# A model whose top is not wrapped (``model.backbone = FSDP(model.backbone)``) is loaded by
# nn.Module.load_state_dict, which walks the modules and calls each one's ``_load_from_state_dict``
# with the keys under its prefix. The outermost host on that walk loads its whole subtree here
# with flatshard's loader (a collective: every rank takes part, errors are raised on all ranks),
# and reports missing and unexpected keys to the walk, which applies the caller's ``strict``. The
# walk then goes on into the wrapped modules, which hold shard views and would call their own
# names missing: the host's post-hook drops those names, and hosts nested inside skip.
def load_from_parent(host: UnitHost, state_dict: dict, prefix: str, missing_keys: list, unexpected_keys: list) -> None:
    """A host's ``_load_from_state_dict``: load the subtree once, from the outermost host."""
    if host.loaded_by_outer:
        return
    ours = {k[len(prefix) :]: v for k, v in state_dict.items() if k.startswith(prefix)}
    result = load_module_state_dict(host, ours, strict=False)
    missing_keys.extend(prefix + k for k in result.missing_keys)
    unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
    for k in [k for k in state_dict if k.startswith(prefix)]:
        del state_dict[k]  # consumed: nothing below this host reads them
    host.load_prefix = prefix
    for inner in unit_hosts(host)[1:]:
        inner.loaded_by_outer = True


def after_load_from_parent(host: UnitHost, incompatible) -> None:
    """The host's load post-hook: the names the wrapped modules reported missing were loaded."""
    prefix, host.load_prefix = host.load_prefix, None
    if prefix is None:
        return
    inner = prefix + WRAPPED + "."
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(inner)]
    for h in unit_hosts(host)[1:]:
        h.loaded_by_outer = False
