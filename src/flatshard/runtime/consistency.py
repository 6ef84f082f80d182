"""Every rank runs the same units in the same order: the check, and errors that name the unit.

[Note: order checks]
Units of equal size could pair their collectives across ranks (rank 0 gathering unit ``a`` while rank
1 gathers ``b``) and train silently mixed; units of different sizes make gloo abort the process. Three
defences, cheapest first:
  * tags: on gloo every point-to-point exchange carries the unit's index in its tag
    (``exchange_tag``), so messages of different units never pair: a rank that runs another unit, or
    skips one, waits instead, until the group's timeout, which ``collective_errors`` turns into an
    error naming the rank, the unit, the phase and the collective.
  * the first step is checked: before each gather and each reduction, and at the end of forward and of
    backward, the ranks all-gather (what, which unit, phase) and compare (``Checker``); a difference is
    the same error on every rank, at once. Later steps are not checked (no cost on the happy path) ...
  * ... unless ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` (PyTorch's own debug level): then every step is.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist

from flatshard.runtime.comm import agree, collectives
from flatshard.runtime.comm.collectives import CollectiveResult

GATHER, REDUCE, END_FORWARD, END_BACKWARD = 1, 2, 3, 4
_WHAT = {
    GATHER: "all-gather of unit",
    REDUCE: "gradient reduction of unit",
    END_FORWARD: "end of forward",
    END_BACKWARD: "end of backward",
}
_CHECK_TAG = 1 << 30  # check exchanges: a tag space of their own, above every exchange_tag


class Phase(str, enum.Enum):
    """Where a root is in its step; recorded with every collective (a ``str``, so ``"forward"`` matches)."""

    IDLE = "idle"  # before the first forward, and between a forward and its backward
    FORWARD = "forward"
    BACKWARD = "backward"
    OPTIMIZER = "optimizer"  # after a backward: optimizer.step(), clip_grad_norm_
    SUMMON = "summon"  # summon_full_params
    STATE_DICT = "state_dict"  # model and optimizer state dicts
    CHECKPOINT = "checkpoint"  # flatshard.checkpoint save and load

    def __str__(self) -> str:
        return self.value


_PHASES = tuple(p.value for p in Phase)  # a phase travels as its position here


def exchange_tag(seq: int, unit_index: int) -> int:
    """The tag of a unit's exchange: the run context's sequence number and the unit's index."""
    return ((seq % (1 << 16)) << 12) | (unit_index & 0xFFF)


def detail_debug() -> bool:
    try:
        return dist.get_debug_level() == dist.DebugLevel.DETAIL
    except (AttributeError, RuntimeError):
        return False


# [Note: order checks of units on several meshes]
# A unit whose parameters sit on several meshes (fully_shard's ShardPlacementResult: an MoE's experts on the
# expert-FSDP mesh) reduces each mesh's flat group over its own process group, and CPU collectives block: a
# rank whose experts got no gradient reduces only the dense group while its expert peer waits in the
# experts' reduce-scatter, and neither returns. Without set_reduce_scatter_unused_params(True) (which makes
# every rank reduce every group: [Note: unused parameters in a reduction], hooks.py) such units check every
# reduction and the end of every backward in every step, not only the first: an all-gather of four integers
# over the root's ranks per flat group per backward, for those units only, so the mistake is the same error
# on every rank, naming the unit, its group's parameters and mesh, and the setting, instead of a hang.
class Checker:
    """The order check of one root (see the Note): ``active`` for the first step, or always under DETAIL.
    Units are named by their index in ``names`` (the root's units, root first)."""

    def __init__(self, names: list[str], group, record: Callable[[CollectiveResult], None]):
        self.names = names
        self.record = record  # checks are collectives too: recorded as kind "order_check"
        self.group = group
        self.detail = detail_debug()
        self.first_step = True
        self.parts: list[list[str]] = []  # per unit, each flat group's description (for units of several)
        self._seq = 0

    @property
    def active(self) -> bool:
        return (self.first_step or self.detail) and self.group is not None and dist.get_world_size(self.group) > 1

    def check(self, what: int, index: int, phase: str, part: int = 0, always: bool = False) -> None:
        """Compare (``what``, the unit at ``index`` or -1 for none, ``phase``, the unit's flat group ``part``)
        across the ranks: a unit's groups on different meshes reduce over different process groups, so a
        rank reducing one group while its peer reduces another would wait in each other's collectives.
        ``always``: checked in every step ([Note: order checks of units on several meshes])."""
        if not (self.active or (always and self.group is not None and dist.get_world_size(self.group) > 1)):
            return
        self._seq += 1
        device = agree.collective_device(self.group)
        code = _PHASES.index(str(phase)) if str(phase) in _PHASES else -1
        mine = torch.tensor([what, index, code, part], dtype=torch.int64, device=device)
        n = dist.get_world_size(self.group)
        everyone = torch.empty(4 * n, dtype=torch.int64, device=device)
        result = collectives.all_gather(everyone, mine, self.group, tag=_CHECK_TAG | (self._seq % (1 << 20)))
        self.record(result._replace(kind="order_check"))
        rows = everyone.view(n, 4).cpu().tolist()
        if any(r != rows[0] for r in rows):
            raise RuntimeError(self._message(rows))

    def _message(self, rows: list[list[int]]) -> str:
        def said(rank: int) -> str:
            what, index, phase, part = rows[rank]
            name = f" {self.names[index]!r}" if 0 <= index < len(self.names) else ""
            parts = self.parts[index] if 0 <= index < len(self.parts) else []
            if what == REDUCE and len(parts) > 1 and 0 <= part < len(parts):
                name += f" {parts[part]}"
            where = f" ({_PHASES[phase]})" if 0 <= phase < len(_PHASES) and what in (GATHER, REDUCE) else ""
            return f"rank {rank}: {_WHAT.get(what, '?')}{name}{where}"

        groups: dict[tuple, list[int]] = {}
        for rank, row in enumerate(rows):
            groups.setdefault(tuple(row), []).append(rank)
        listed = "; ".join(
            said(ranks[0]) + (f" (and ranks {ranks[1:]})" if len(ranks) > 1 else "") for ranks in groups.values()
        )
        reductions = {(r[0], r[1]) for r in rows}
        hint = (
            " Here ranks reduce different flat groups of one unit, on different meshes: its parameters on one mesh "
            "got no gradient on some ranks (an MoE's experts that received no token and were skipped). Call "
            "set_reduce_scatter_unused_params(True) on the fully_shard module (the root: recurse=True) so those "
            "ranks reduce zeros, as FSDP2 asks for the same; or give every parameter a gradient on every rank."
            if len(reductions) == 1 and next(iter(reductions))[0] == REDUCE
            else ""
        )
        return (
            f"ranks ran different units at the same point of the step: {listed}.{hint} Every rank must run the same "
            "units in the same order: look for control flow that depends on the rank or its data (a branch, an "
            "early exit, a module whose output one rank's loss does not use). flatshard checks the order of "
            "every collective in the first step, and in every step under TORCH_DISTRIBUTED_DEBUG=DETAIL."
        )


@contextlib.contextmanager
def collective_errors(unit: str, phase: str, collective: str) -> Iterator[None]:
    """A collective of the unit named ``unit``, in ``phase``, that fails (a timeout above all) raises an error
    naming the rank, the unit, the phase and the collective, chained to the backend's own."""
    try:
        yield
    except RuntimeError as exc:
        text = str(exc)
        if text.startswith(("flatshard: rank", "ranks ran different units")):
            raise
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise RuntimeError(
            f"flatshard: rank {rank}: the {collective} of unit {unit!r} in {phase} did not "
            f"complete: {text}. A collective that times out usually means a rank never reached it: every rank "
            "must run the same units in the same order (rank-dependent control flow, a module unused in one "
            "rank's loss), and no peer may have died or stalled. TORCH_DISTRIBUTED_DEBUG=DETAIL checks the "
            "order of every collective."
        ) from exc
