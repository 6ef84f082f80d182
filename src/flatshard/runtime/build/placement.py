"""Which unit owns which parameter.

Each parameter belongs to the innermost unit whose module holds every use of it. A tied parameter
(an embedding shared with an output head in another unit) therefore lands in the units' common
ancestor, which is gathered whenever either use computes. Parameters of ignored modules belong to no
unit. A parameter already flattened by a unit the user wrapped by hand, but also used outside it,
cannot be moved and is an error (raised identically on every rank, at wrap time).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

from torch import nn

from flatshard.runtime.layout import ParamInfo
from flatshard.runtime.tree import UnitHost


class Placement:
    def __init__(self, root: nn.Module, unit_modules: Iterable[nn.Module], skip: set[nn.Module], ignored_params: set):
        """``unit_modules``: the modules that become units (``root`` included); ``skip``: modules not to
        look into (ignored modules and units wrapped earlier, whose parameters are already flat)."""
        units = set(unit_modules) | {root}
        self.root = root
        self.path: dict[nn.Module, str] = {}
        self.parent_unit: dict[nn.Module, Optional[nn.Module]] = {root: None}
        self.uses: dict[nn.Parameter, list[tuple[nn.Module, str, nn.Module]]] = {}  # param -> [(module, attr, unit)]
        self._walk(root, "", root, units, skip, ignored_params)

    def _walk(self, module, path, unit, units, skip, ignored_params) -> None:
        if module in self.path:
            return  # a module reached twice (shared submodule): its parameters are recorded once
        self.path[module] = path
        for attr, param in module._parameters.items():
            if param is not None and param not in ignored_params:
                self.uses.setdefault(param, []).append((module, attr, unit))
        for name, child in module._modules.items():
            if child is None or child in skip:
                continue
            child_unit = unit
            if child in units:
                self.parent_unit[child] = unit
                child_unit = child
            self._walk(child, f"{path}.{name}" if path else name, child_unit, units, skip, ignored_params)

    def _ancestors(self, unit: Optional[nn.Module]) -> list[nn.Module]:
        chain = []
        while unit is not None:
            chain.append(unit)
            unit = self.parent_unit[unit]
        return chain

    def _common_unit(self, owners: list[nn.Module]) -> nn.Module:
        common = self._ancestors(owners[0])
        for other in owners[1:]:
            chain = set(self._ancestors(other))
            common = [u for u in common if u in chain]
        return common[0]

    def infos_by_unit(self) -> dict[nn.Module, list[tuple[ParamInfo, nn.Parameter]]]:
        """For each unit module, its parameters in module order, as (layout info, original parameter)."""
        out: dict[nn.Module, list] = {}
        offsets: dict[nn.Module, int] = {}
        for param, uses in self.uses.items():
            owner = self._common_unit([u for _, _, u in uses])
            first_module, first_attr, _ = uses[0]
            prefix = self.path[first_module]
            base = self.path[owner]
            name = f"{prefix}.{first_attr}" if prefix else first_attr
            if base and name.startswith(base + "."):
                name = name[len(base) + 1 :]
            offset = offsets.get(owner, 0)
            info = ParamInfo(
                name=name,
                shape=param.shape,
                numel=param.numel(),
                offset=offset,
                requires_grad=param.requires_grad,
                uses=tuple((m, a) for m, a, _ in uses),
            )
            offsets[owner] = offset + param.numel()
            out.setdefault(owner, []).append((info, param))
        return out


def check_no_tie_into_wrapped(placement: Placement, wrapped: Iterable[UnitHost]) -> None:
    """A parameter that a hand-wrapped unit already flattened must not be used outside that unit."""
    for inner in wrapped:
        originals = {k: v for g in inner._unit.flat_groups for k, v in g.originals.items()}  # id -> weakref(param)
        for param, uses in placement.uses.items():
            ref = originals.get(id(param))
            if ref is not None and ref() is param:
                where = ", ".join(f"{placement.path[m] or '<root>'}.{a}" for m, a, _ in uses)
                raise ValueError(
                    f"a parameter flattened into the unit {inner._unit.name!r}, wrapped earlier by hand, is also "
                    f"used outside it (at {where}); flatshard cannot move a tied parameter out of a unit that is "
                    "already built. Wrap the modules that share it inside one FullyShardedDataParallel, or wrap "
                    "the whole model once with an auto_wrap_policy: flatshard then places tied parameters in the "
                    "units' common ancestor by itself."
                )
