"""Deferred initialisation: a model built on the ``meta`` device, materialised unit by unit.

[Note: deferred initialisation]
A model built under ``torch.device("meta")`` has shapes and no data. The constructor walks the
model's modules once, in ``model.modules()`` order, and for each module that holds parameters or
buffers of its own on meta: allocates them on the device (uninitialised, as ``to_empty`` would),
then initialises them with ``param_init_fn(module)`` or, when none was given,
``module.reset_parameters()``. As soon as every module that uses a unit's parameters has been
initialised, the unit is built: its parameters are flattened, this rank keeps its flat shard, and
the full-size tensors are dropped. So a rank holds its flat shards plus the full parameters of the
units still being initialised (the one being visited and the units around it whose modules come
later in the order, typically the root), never the whole model.

Every rank initialises every module, in the same order, from the same random-number stream: each
draws the same numbers for a whole unit and keeps its own slice. The order is ``model.modules()``
whatever the units are, so the result depends neither on the world size nor on the wrap policy: it
equals, parameter for parameter and buffer for buffer, a single process running

    model.to_empty(device=...)      # re-tie shared weights: torch's to_empty unties them
    for m in model.modules():
        if m has parameters or buffers of its own:
            param_init_fn(m)   or   m.reset_parameters()

Tied parameters stay tied (one tensor, allocated once; every module that uses it initialises it in
turn, the last one winning, as in the reference). Each module's init must touch only its own
parameters and buffers (``recurse=False``), as PyTorch FSDP requires too: a module's children may
already be sharded when it runs. Ignored modules and units wrapped earlier are not touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Optional

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from flatshard.api import MixedPrecision
from flatshard.runtime import hooks
from flatshard.runtime.comm.mesh import device_of
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.precision import resolve
from flatshard.runtime.unit import Unit


def has_meta_states(module: nn.Module, skip: set[nn.Module]) -> bool:
    """Whether any module under ``module`` (outside ``skip``) holds a parameter or buffer on meta."""
    return any(_own_meta(m) for m in _walk(module, skip))


def materialization_device(device_id) -> torch.device:
    if device_id is not None:
        return device_of(device_id)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_init_fn(param_init_fn) -> None:
    if param_init_fn is not None and not callable(param_init_fn):
        raise TypeError(
            f"param_init_fn must be a callable taking one module (it is called on each module that has parameters "
            f"or buffers of its own on the meta device), got {param_init_fn!r}"
        )


def units_in_init_order(
    root: nn.Module,
    unit_modules: list[nn.Module],
    by_unit: dict[nn.Module, list],
    skip: set[nn.Module],
    param_init_fn: Optional[Callable[[nn.Module], None]],
    device: torch.device,
) -> Iterator[tuple[nn.Module, list]]:
    """Initialise ``root``'s meta modules in ``modules()`` order; yield each unit module with its
    (layout info, real parameter) pairs as soon as all its parameters are initialised.

    ``unit_modules`` includes ``root``; ``by_unit`` is ``Placement.infos_by_unit()`` of the meta model.
    The caller builds the unit (flatten, keep the shard) before asking for the next one, which is what
    frees the full-size parameters."""
    order = list(_walk(root, skip))
    index = {m: i for i, m in enumerate(order)}
    to_init = [m for m in order if _own_meta(m)]
    _check_initialisable(root, to_init, param_init_fn)
    last: dict[nn.Module, int] = {}  # unit -> position of the last module that uses one of its parameters
    for unit in unit_modules:
        uses = [index[m] for info, _ in by_unit.get(unit, []) for m, _ in info.uses if m in index]
        last[unit] = max(uses, default=-1)
    pending = sorted(unit_modules, key=lambda u: last[u])
    real: dict[int, tuple] = {}  # id(meta tensor) -> (meta tensor, its materialised tensor), shared by tied uses
    for unit in _ready(pending, last, -1):
        yield unit, _fresh(unit, by_unit, real)
    for module in to_init:
        _allocate(module, device, real)
        installed = dict(module._parameters)
        with torch.no_grad():
            if param_init_fn is not None:
                param_init_fn(module)
            else:
                module.reset_parameters()  # type: ignore[operator]  # its class's method (_check_initialisable)
        _keep_ties(root, module, installed)
        del installed
        for unit in _ready(pending, last, index[module]):
            yield unit, _fresh(unit, by_unit, real)
    for unit in pending:  # units whose last use lies in a module without meta states
        yield unit, _fresh(unit, by_unit, real)
    pending.clear()


# ---- helpers -------------------------------------------------------------------------------------
def _walk(root: nn.Module, skip: set[nn.Module]) -> Iterator[nn.Module]:
    """``root.modules()`` order (each module once), not entering ``skip`` (ignored modules and units
    wrapped earlier)."""
    seen: set[int] = set()

    def visit(m: nn.Module) -> Iterator[nn.Module]:
        if id(m) in seen or m in skip:
            return
        seen.add(id(m))
        yield m
        for child in m._modules.values():
            if child is not None:
                yield from visit(child)

    yield from visit(root)


def _own_meta(module: nn.Module) -> bool:
    states = [*module._parameters.values(), *module._buffers.values()]
    return any(t is not None and t.is_meta for t in states)


def _name(root: nn.Module, module: nn.Module) -> str:
    for name, m in root.named_modules(remove_duplicate=False):
        if m is module:
            return name or "<root>"
    return type(module).__name__


def _check_initialisable(root: nn.Module, to_init: list[nn.Module], param_init_fn) -> None:
    """Before anything is allocated: every module to initialise must know how (same answer on every rank)."""
    if param_init_fn is not None:
        return
    missing = [m for m in to_init if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        names = ", ".join(f"{_name(root, m)!r} ({type(m).__name__})" for m in missing[:5])
        raise ValueError(
            f"the model is on the meta device, but these modules hold parameters or buffers of their own and have no "
            f"reset_parameters() to initialise them: {names}{' ...' if len(missing) > 5 else ''}. Give each a "
            "reset_parameters() that fills its own parameters and buffers, or pass param_init_fn=fn, called as "
            "fn(module) on each such module in model.modules() order."
        )


def _allocate(module: nn.Module, device: torch.device, real: dict[int, tuple]) -> None:
    """``module.to_empty(device, recurse=False)``, except that a tensor shared with another module is
    allocated once and stays shared."""
    for attr, p in module._parameters.items():
        if p is not None and p.is_meta:
            if id(p) not in real:  # the meta tensor is kept in the entry, so its id is not reused meanwhile
                real[id(p)] = (p, nn.Parameter(torch.empty_like(p, device=device), requires_grad=p.requires_grad))
            module._parameters[attr] = real[id(p)][1]
    for attr, b in module._buffers.items():
        if b is not None and b.is_meta:
            if id(b) not in real:
                real[id(b)] = (b, torch.empty_like(b, device=device))
            module._buffers[attr] = real[id(b)][1]


def _keep_ties(root: nn.Module, module: nn.Module, installed: dict) -> None:
    """Accept an init that replaced a parameter (``to_empty`` inside ``param_init_fn``): copy the new value
    into the tensor we allocated, so every module sharing it sees it. Raise if it left one on meta."""
    for attr, p in module._parameters.items():
        if p is None:
            continue
        if p.is_meta:
            raise RuntimeError(
                f"after initialising module {_name(root, module)!r} ({type(module).__name__}) its parameter {attr!r} "
                "is still on the meta device; param_init_fn(module) must fill the module's own parameters (flatshard "
                "has already allocated them: initialise them in place, e.g. module.reset_parameters())."
            )
        before = installed.get(attr)
        if before is not None and p is not before:
            before.data.copy_(p.detach())
            module._parameters[attr] = before
    for attr, b in module._buffers.items():
        if b is not None and b.is_meta:
            raise RuntimeError(
                f"after initialising module {_name(root, module)!r} ({type(module).__name__}) its buffer {attr!r} is "
                "still on the meta device; its reset_parameters() (or param_init_fn) must fill its buffers too."
            )


def _ready(pending: list[nn.Module], last: dict[nn.Module, int], position: int) -> list[nn.Module]:
    """Remove and return (in order) the pending units whose last use is at or before ``position``."""
    done = [u for u in pending if last[u] <= position]
    del pending[: len(done)]  # ``pending`` is sorted by last use
    return done


def _fresh(unit: nn.Module, by_unit: dict[nn.Module, list], real: dict[int, tuple]) -> list:
    """The unit's (info, parameter) pairs with the materialised tensors in place of the meta ones; the
    entries are removed from ``real`` so that building the unit frees the full-size tensors."""
    out = []
    for info, p in by_unit.get(unit, []):
        out.append((info, real.pop(id(p), (p, p))[1]))
    return out


# [Note: meta parameters left to the user]
# fully_shard (FSDP2's contract) shards a model built on ``meta`` without initialising it: the unit is
# built on meta, its DTensor parameters stay on meta, and the user materialises them, e.g.
# ``model.to_empty(device=...)`` then each module's ``reset_parameters()``, or a state dict loaded with
# ``assign=True``. Each of those replaces the data behind the registered parameters (``to_empty``
# swaps the DTensor objects' contents; ``assign`` and attribute assignment register new objects), so
# the unit's flat shard no longer holds them. At the first forward the unit takes them back
# (``adopt_materialized``): it reads each parameter as the module now holds it, copies this rank's
# chunk into a new flat shard on that device, and points the registered DTensor at its slice, so
# optimizers built after ``to_empty`` step the unit's own storage. A sharded model cast or moved by
# ``model.to(...)`` (DTensor parameters are swapped in place) is taken back the same way, in the new
# dtype.


def adopt_materialized(unit: Unit, fqns: dict[int, str]) -> None:
    """Rebuild the storage of each of ``unit``'s flat groups from the parameters its modules hold now
    ([Note: meta parameters left to the user]). ``fqns``: id of a registered parameter -> its name from
    the root, for the error."""
    current = [[getattr(info.uses[0][0], info.uses[0][1]) for info in g.owner_layout.infos] for g in unit.flat_groups]
    still_meta = [
        fqns.get(id(p), info.name)
        for g, params in zip(unit.flat_groups, current)
        for info, p in zip(g.owner_layout.infos, params)
        if p.is_meta
    ]
    if still_meta:
        raise RuntimeError(
            "FSDP parameters should be materialized from meta device before training, but the following were "
            f"still on meta device: {still_meta}. Call model.to_empty(device=...) and initialise them "
            "(reset_parameters(), or load a state dict with assign=True) before the first forward"
        )
    for group, params in zip(unit.flat_groups, current):
        _adopt(group, params, unit.settings.mixed_precision)
        hooks.register_post_backward(unit, group)


def _adopt(group: FlatGroup, current: list, policy: Optional[MixedPrecision]) -> None:
    """One flat group takes back ``current``, the parameters its modules hold now, in its layout's order."""
    layout, rank = group.owner_layout, group.owner_rank
    device = current[0].device if current else torch.device("cpu")
    dtype = current[0].dtype if current else group.flat_shard.dtype
    flat = torch.zeros(group.flat_shard.numel(), dtype=dtype, device=device)
    views: list[nn.Parameter] = []
    dims = getattr(layout, "dims", [0] * len(layout.infos))  # [Note: sharded along another dim] (chunked.py)
    for info, param, dim, (lo, hi) in zip(layout.infos, current, dims, layout.local_slices(rank)):
        if isinstance(param, DTensor):
            local = param._local_tensor
        else:
            chunks = torch.chunk(param, layout.shard_size, dim=dim)
            local = chunks[rank] if rank < len(chunks) else param.narrow(dim, 0, 0)
        slot = flat[lo:hi].view(layout.local_shape(info, lo, hi))
        slot.copy_(local.detach().reshape(slot.shape))
        if isinstance(param, DTensor) and isinstance(param, nn.Parameter):
            param._local_tensor = slot  # the object optimizers hold keeps working
            views.append(param)
        else:
            old = group.shard_views[len(views)]
            assert isinstance(old, DTensor)  # fully_shard's shard views are DTensor parameters
            old._local_tensor = slot
            views.append(old)
    # the model was cast (model.to(torch.float64)): the group computes in the new dtype
    same = dtype == group.flat_shard.dtype
    group.replace_storage(flat, views, group.precision if same else resolve(policy, dtype))
