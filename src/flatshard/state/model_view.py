"""What a flatshard model holds, in state-dict order, as one rank sees it; and moving flat pieces between ranks.

``model_view(module)`` walks the module tree once and lists every state-dict entry with wrapper hops
removed: each original parameter of a unit as a ``LocalParam`` (which elements of it this rank holds,
and where they sit in its unit's flat shard), parameters no unit manages (ignored ones), buffers and
extra state. Every state-dict, optimizer state-dict and checkpoint path starts here. Its collectives
go through comm/collectives.py and are recorded with the root's run context, under the entry point's phase.
"""

from __future__ import annotations

import contextlib
import enum
import zlib
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional

import torch
from torch import nn

from flatshard.api import NotBuiltError
from flatshard.runtime.comm import agree
from flatshard.runtime.comm.collectives import CollectiveResult
from flatshard.runtime.consistency import Phase
from flatshard.runtime.layout import ParamInfo
from flatshard.runtime.schedule import RunContext, run_context
from flatshard.runtime.tree import HOPS, UnitHost, unit_hosts
from flatshard.runtime.unit import Unit
from flatshard.state.sharded_tensors import ShardedPiece


@dataclass
class LocalParam:
    """One original parameter of a unit, seen from this rank."""

    fqn: str  # canonical name (its first name in state-dict order)
    names: list[str]
    unit: Unit
    info: ParamInfo
    view: nn.Parameter  # its shard view
    start: int  # elements [start, end) of the flattened parameter that this rank holds
    end: int
    lo: int  # where they sit in the flat shard
    hi: int


class EntryKind(enum.Enum):
    PARAM = enum.auto()  # a unit's parameter: obj is a LocalParam
    UNMANAGED = enum.auto()  # a parameter no unit owns (ignored): obj is the tensor
    BUFFER = enum.auto()  # obj is the tensor
    EXTRA = enum.auto()  # a module's extra state: obj is the module


class Entry(NamedTuple):
    kind: EntryKind
    name: str
    obj: Any


@dataclass
class ModelView:
    """Every state-dict entry of a module tree, with wrapper hops removed."""

    entries: list[Entry] = field(default_factory=list)
    params: list[LocalParam] = field(default_factory=list)
    hosts: list[tuple[str, UnitHost]] = field(default_factory=list)  # (clean prefix, host)
    group: Any = None  # the model's process group (None: no unit)
    ctx: Optional[RunContext] = None  # the root's run context, for recording

    @property
    def units(self) -> list[Unit]:
        seen, out = set(), []
        for s in self.params:
            if id(s.unit) not in seen:
                seen.add(id(s.unit))
                out.append(s.unit)
        return out

    def params_of(self, unit: Unit) -> list[LocalParam]:
        if not hasattr(self, "_by_unit"):
            self._by_unit: dict[int, list[LocalParam]] = {}
            for s in self.params:
                self._by_unit.setdefault(id(s.unit), []).append(s)
        return self._by_unit.get(id(unit), [])

    def names(self) -> list[str]:
        return [e.name for e in self.entries]

    def record(self, result: CollectiveResult) -> None:
        """A collective over the model's whole process group, for the recorders."""
        if self.ctx is not None:
            self.ctx.record(result, "world", "<model>")

    def phase(self, phase: Phase):
        """The entry point's phase on the root's run context (recorded with its collectives)."""
        return self.ctx.phase_scope(phase) if self.ctx is not None else contextlib.nullcontext()


def holds_dtensors(module: nn.Module) -> bool:
    """Whether ``module`` is (or holds) a ``fully_shard`` model, whose parameters are DTensors: its
    state goes through torch.distributed.checkpoint's state-dict functions, not through ``model_view``."""
    return any(g.wrap_grad is not None for h in unit_hosts(module) for g in h._unit.flat_groups)


def model_view(module: nn.Module, prefix: str = "") -> ModelView:
    hosts = unit_hosts(module)
    if holds_dtensors(module):  # fully_shard's DTensors
        raise NotBuiltError(
            "flatshard's state-dict views read FullyShardedDataParallel models; fully_shard's parameters are "
            "DTensors: use flatshard.checkpoint.save / load / Checkpointer (they write DCP's safetensors format "
            "for fully_shard), or torch.distributed.checkpoint's get_model_state_dict / get_optimizer_state_dict."
        )
    if hosts:  # a step that raised is put back before the model is read ([Note: a step that raised])
        hosts[0]._unit.ctx.recover()
    owners = {}
    for h in hosts:
        unit = h._unit
        group = unit.flat_group
        rank = group.owner_rank  # the shard views' cut: the shard group's, or pieces over all ranks
        layout = group.owner_layout
        for info, view, rng, loc in zip(
            layout.infos, group.shard_views, layout.param_ranges(rank), layout.local_slices(rank)
        ):
            owners[id(view)] = (unit, info, view, rng, loc)
    out = ModelView(
        group=hosts[0]._unit.flat_group.groups.process_group if hosts else None,
        ctx=run_context(hosts[0]._unit) if hosts else None,
    )
    _walk(module, prefix, out, owners, {})
    return out


def _walk(module: nn.Module, prefix: str, out: ModelView, owners: dict, seen: dict) -> None:
    if isinstance(module, UnitHost):
        out.hosts.append((prefix, module))
    for name, p in module._parameters.items():
        if p is None:
            continue
        if id(p) in owners:
            if id(p) not in seen:
                unit, info, view, (a, b), (lo, hi) = owners[id(p)]
                seen[id(p)] = LocalParam(prefix + name, [], unit, info, view, a, b, lo, hi)
                out.params.append(seen[id(p)])
            seen[id(p)].names.append(prefix + name)
            out.entries.append(Entry(EntryKind.PARAM, prefix + name, seen[id(p)]))
        else:
            out.entries.append(Entry(EntryKind.UNMANAGED, prefix + name, p))
    for name, b in module._buffers.items():
        if b is not None and name not in module._non_persistent_buffers_set:
            out.entries.append(Entry(EntryKind.BUFFER, prefix + name, b))
    if type(module).get_extra_state is not nn.Module.get_extra_state:
        out.entries.append(Entry(EntryKind.EXTRA, prefix + "_extra_state", module))
    for name, child in module._modules.items():
        if child is not None:
            _walk(child, prefix if name in HOPS else f"{prefix}{name}.", out, owners, seen)


def layout_fingerprint(unit: Unit) -> torch.Tensor:
    """What must match for a LOCAL state dict to load: F, shard rank, sizes and every name and shape."""
    layout = unit.flat_group.owner_layout
    text = ";".join(f"{i.name}:{tuple(i.shape)}" for i in layout.infos)
    return torch.tensor(
        [
            layout.shard_size,
            unit.flat_group.owner_rank,
            layout.total,
            zlib.crc32(layout.signature.encode()),
            zlib.crc32(text.encode()),
        ],
        dtype=torch.int64,
    )


def gather_to(unit: Unit, owned: torch.Tensor) -> torch.Tensor:
    """``FlatGroup.gather_owned(owned)`` of the unit's flat group (a tensor laid out like its ``owned``: the
    flat shard, or its piece) returned where ``owned`` lives (CPU under CPUOffload)."""
    return unit.flat_group.gather_owned(owned).to(owned.device)


# ---- moving flat pieces between ranks -----------------------------------------------------------
def exchange(pieces: dict[Any, Any], wanted: dict[Any, tuple[int, int]], view: ModelView) -> dict[Any, torch.Tensor]:
    """Redistribute flat pieces: ``pieces[key]`` is this rank's ShardedPiece (or full tensor, or None);
    every rank gets elements ``wanted[key]``. The keys must be the same, in the same order, on every rank."""
    group = view.group
    keys = list(pieces)
    everyone = agree.gather_json([_piece_range(pieces[k]) for k in keys], group, view.record)
    device = agree.collective_device(group)
    out = {}
    for i, (key, piece) in enumerate(pieces.items()):
        ranges = [m[i] for m in everyone]
        if all(r is None for r in ranges):
            continue
        longest = max(r[1] - r[0] for r in ranges if r is not None)
        dtype = _piece_tensor(piece).dtype if piece is not None else _dtype_of(ranges)
        local = torch.zeros(longest, dtype=dtype, device=device)
        if piece is not None:
            t = _piece_tensor(piece).reshape(-1)
            local[: t.numel()] = t.to(dtype)
        everything = agree.all_gather_padded(local, group, view.record)
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
        return [v.start, v.end, dtype_name(v.dtype)]
    return [0, v.numel(), dtype_name(v.dtype)]


def _piece_tensor(v) -> torch.Tensor:
    return v.tensor if isinstance(v, ShardedPiece) else v


def _dtype_of(ranges: list) -> torch.dtype:
    return dtype_from(next(r[2] for r in ranges if r is not None))


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"`` (how dtypes travel in JSON and manifests)."""
    return str(dtype).replace("torch.", "")


def dtype_from(name: str) -> torch.dtype:
    return getattr(torch, name.replace("torch.", ""))
