"""One unit: the atom of scheduling. Hooks and the run context speak to units; a unit fans each step
out to its flat groups (flat_group.py), the atoms of communication, and to the parameters that gather
themselves (``SidePath``), if it has any.

A unit is one wrapped module (its own parameters, not those of units nested inside it); for
``fully_shard``, one call. It holds:
  * ``flat_groups``: one per (mesh, dtype, layout kind) of its parameters -- exactly one under the FSDP1
    wrapper, which ``flat_group`` names for the paths that read one flat (its state dicts, summon,
    checkpoints); a ``fully_shard`` call has one per dtype, the trainable dtype's first ([Note: a flat
    group per dtype], build/units.py), and its paths loop over them;
  * ``self_gathered``: fully_shard's parameters kept out of the flat groups, that gather themselves
    ([Note: parameters that gather themselves], fsdp2/extensions.py), behind a declared protocol;
  * ``settings``: what its wrap call asked for and fully_shard's ``set_*`` methods change (context.py);
  * ``link``: its name and its root's run context, shared with its parts (context.py).
When each transition runs is decided by the hooks (hooks.py) and the run context (schedule.py); this file
only knows how a unit changes state. ``unshard`` and ``reshard`` are idempotent.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Optional, Protocol, TypeVar

import torch

from flatshard.runtime.context import Context, Link, UnitSettings
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.precision import UnitPrecision

_F = TypeVar("_F", bound=Callable[..., None])


def _outside_function_transforms(method: _F) -> _F:
    """Run ``method`` with torch.func's transforms disabled when any is active ([Note: outside function
    transforms])."""

    @functools.wraps(method)
    def run(*args, **kwargs) -> None:
        if torch._C._are_functorch_transforms_active():
            with torch._C._DisableFuncTorch():
                return method(*args, **kwargs)
        return method(*args, **kwargs)

    return run  # type: ignore[return-value]  # functools.wraps keeps the signature mypy cannot see


class SidePath(Protocol):
    """Parameters of a unit kept out of its flat groups that gather themselves (fully_shard's all-gather
    extensions: fsdp2/extensions.py's ``SelfGathered``). The unit calls each method beside the same step
    of its flat groups."""

    params: set[int]  # ids of their sharded parameters (the objects optimizers hold)

    def use_compute(self) -> None:
        """Gather them (unless gathered since the last ``free``) and set the unsharded ones on the modules."""

    def use_sharded(self) -> None:
        """Put the sharded parameters back on the modules."""

    def free(self) -> None:
        """Release what the gather holds (the tensors keep their objects, for autograd and the next refill)."""

    def reduce(self, sync: bool) -> None:
        """End of backward: reduce their gradients (``sync``), or keep them unreduced in an open window."""

    def drop_cleared(self) -> None:
        """Before the root's next forward: drop the unreduced gradient of each one the loop cleared."""

    def abandon(self) -> None:
        """A step that raised: drop what backward had not put on ``.grad``; sharded parameters back."""

    def memory_bytes(self) -> dict[str, int]:
        """Bytes held now, by category ("params", "grads", "gathered")."""


class Unit:
    def __init__(self, link: Link, settings: UnitSettings, flat_groups: list[FlatGroup]):
        """Built by build/units.py, which then binds ``link`` to a run context of the unit's own; the root
        that adopts it later binds it to the root's."""
        self.link = link
        self.settings = settings
        self.flat_groups = flat_groups
        self.self_gathered: Optional[SidePath] = None
        self.inputs_hooked = False  # the last forward's inputs carry hooks.py's _InputsBackward
        self.forward_entries: list = []  # fully_shard: the exception being handled as each forward began (hooks.py)
        self.summoned = False  # inside summon_full_params, its modules hold the full parameters (summon.py)

    @property
    def name(self) -> str:
        return self.link.name

    @name.setter
    def name(self, value: str) -> None:
        self.link.name = value

    @property
    def ctx(self) -> Context:
        """The run context of this unit's root (schedule.py's RunContext; ``schedule.run_context(unit)``)."""
        return self.link.run

    @property
    def is_root(self) -> bool:
        """The root is the outermost unit of a model; it stays gathered from forward to backward."""
        return self.link.is_root

    @property
    def flat_group(self) -> FlatGroup:
        """The unit's one flat group, for the FSDP1 wrapper's paths that read a unit as one flat (its state
        dicts, summon_full_params, clip_grad_norm_, checkpoints); never called on fully_shard's paths,
        whose units may hold a flat group per dtype."""
        if len(self.flat_groups) != 1:
            raise NotImplementedError(
                f"unit {self.name!r} holds {len(self.flat_groups)} flat groups; this path reads a unit as one flat"
            )
        return self.flat_groups[0]

    @property
    def precision(self) -> UnitPrecision:
        """The unit's compute precision (one policy per wrap call): what its forward's inputs are cast to;
        its first flat group's, the trainable dtype's ([Note: a flat group per dtype])."""
        return self.flat_groups[0].precision

    @property
    def requires_grad(self) -> bool:
        return any(g.requires_grad for g in self.flat_groups)

    @property
    def sync(self) -> bool:
        """Whether this backward reduces this unit's gradients (not under no_sync / set_requires_gradient_sync)."""
        return self.ctx.sync_gradients and self.settings.requires_gradient_sync

    # ---- transitions ---------------------------------------------------------------------
    # [Note: outside function transforms]
    # Under torch.func's transforms (jvp, vmap, grad) a tensor made before the transform is a captured one,
    # and an in-place write to it raises ("would mutate a captured Tensor"); the unsharded flats are such
    # tensors, written by every gather and freed by every reshard. So the three transitions run with the
    # transforms disabled, as PyTorch FSDP2 runs its own: what they write is the parameters, which the
    # transformed function reads as constants (a jvp's tangents flow through the inputs, not the weights).
    @_outside_function_transforms
    def unshard(self, wait: bool = True) -> None:
        """Fill every flat group's unsharded flat; with ``wait=False`` the all-gathers are only issued."""
        for group in self.flat_groups:
            group.unshard(wait)

    @_outside_function_transforms
    def wait_for_unshard(self) -> None:
        """Compute waits for this unit's all-gathers in flight, if any are (gather.py)."""
        for group in self.flat_groups:
            group.gather.consume()

    @property
    def gathered(self) -> bool:
        """Whether this unit holds (or is receiving) unsharded flats in memory of their own."""
        return any(g.gathered for g in self.flat_groups)

    @_outside_function_transforms
    def reshard(self, after_forward: bool = False) -> None:
        """Free the unsharded flats (their tensor objects stay, for autograd's saved views)."""
        if self.self_gathered is not None and not self.ctx.in_backward:  # in backward: at its end
            self.self_gathered.free()
        for group in self.flat_groups:
            group.reshard(after_forward)

    def use_compute_views(self) -> list[tuple[FlatGroup, Optional[torch.autograd.graph.Node]]]:
        """Set every group's compute views on the modules; returns each group with the autograd node of its
        split (whose backward builds the group's flat gradient), None where no gradient flows."""
        splits = [(group, group.use_compute_views()) for group in self.flat_groups]
        if self.self_gathered is not None:
            self.self_gathered.use_compute()
        return splits

    @property
    def compute_views_set(self) -> bool:
        return any(g.compute_views_set for g in self.flat_groups)

    def use_shard_views(self) -> None:
        if self.self_gathered is not None:
            self.self_gathered.use_sharded()
        for group in self.flat_groups:
            group.use_shard_views()

    def refresh_requires_grad(self) -> list[FlatGroup]:
        """The groups whose trainable parameters changed since the last forward (FlatGroup.refresh_requires_grad)."""
        return [group for group in self.flat_groups if group.refresh_requires_grad()]

    def drop_cleared(self) -> None:
        """Before the root's next forward ([Note: an open accumulation window], grad_state.py)."""
        for group in self.flat_groups:
            group.drop_cleared()
        if self.self_gathered is not None:
            self.self_gathered.drop_cleared()

    def end_backward(self) -> None:
        """End of backward: reduce what gathers itself, put shard views back, reshard what is still
        gathered, and mark the window a backward that did not synchronise left open."""
        if self.self_gathered is not None:  # [Note: parameters that gather themselves] (fsdp2/extensions.py)
            self.self_gathered.reduce(self.sync)
        for group in self.flat_groups:
            group.open_splits = 0
            group.reduced_in_backward = False
        self.use_shard_views()
        settings = self.settings
        if settings.reshard_after_backward and (self.sync or settings.reshard_after_forward):
            if self.self_gathered is not None:
                self.self_gathered.free()
            self.reshard()
        for group in self.flat_groups:
            group.mark_window()

    def abandon_step(self) -> None:
        """A step that raised ([Note: a step that raised], schedule.py): wait for this unit's collectives in
        flight, drop the gradients it had not exposed, put the shard views back and reshard."""
        for group in self.flat_groups:
            group.abandon()
        if self.self_gathered is not None:
            self.self_gathered.abandon()
        self.use_shard_views()
        self.reshard()

    # ---- accounting ------------------------------------------------------------------------
    def memory_bytes(self) -> dict[str, int]:
        """Bytes this unit holds now, by category (see ``instrument.MemoryRecorder``)."""
        held = {"params": 0, "grads": 0, "optimizer": 0, "gathered": 0}
        for group in self.flat_groups:
            for kind, nbytes in group.memory_bytes().items():
                held[kind] += nbytes
        if self.self_gathered is not None:  # parameters that gather themselves (fsdp2/extensions.py)
            for kind, nbytes in self.self_gathered.memory_bytes().items():
                held[kind] += nbytes
        return held

    def managed_tensors(self) -> list[torch.Tensor]:
        return [t for group in self.flat_groups for t in group.managed_tensors()]

    def __repr__(self) -> str:
        return f"Unit({self.name}, {self.flat_groups})"
