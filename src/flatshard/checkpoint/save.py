"""Checkpoints on disk: one safetensors file per rank and a JSON manifest; crash-safe, verified,
pickle-free, and loadable at any world size, sharding factor or strategy.

    flatshard.checkpoint.save(step_path("ckpt", 100), model, opt, step=100, extra={"lr": 3e-4}, keep_last=3)
    handle = flatshard.checkpoint.save(step_path("ckpt", 200), model, opt, step=200, async_save=True)
    handle.wait()
    step, extra = flatshard.checkpoint.load(flatshard.checkpoint.latest("ckpt"), model, opt)

A checkpoint directory holds ``rank-RRRRR-of-WWWWW.safetensors`` per rank and ``manifest.json``
(written last): every tensor's name, shape, dtype and the flat ranges [start, end) each file holds,
the layout it was saved from, each file's size and checksums ([Note: checksums],
format.py), step, extra, the commit time, a save id and the flatshard version. Each rank writes only
its own pieces (the ranks of the first replica write parameters and optimizer state; global rank 0
adds buffers; every rank adds its RNG states).

Ranks write into ``PATH.partial`` and fsync; rank 0 gathers every rank's record, writes the manifest
and commits it to ``PATH`` without ever leaving ``PATH`` without a complete checkpoint ([Note:
crash-safe commit], directory.py); then it points ``dirname(PATH)/latest`` at it and, with
``keep_last``, removes older checkpoints beside it ([Note: latest and rotation]).

Loading (load.py) reads, for each parameter and optimizer state this rank holds in the *current*
layout, the byte ranges that hold its elements. Collectives are recorded under the ``checkpoint`` phase.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import random
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch
import torch.distributed as dist

from flatshard import __version__
from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import PARTIAL, commit, prepare, rotate, write_pointer
from flatshard.checkpoint.format import (
    FORMAT,
    FORMAT_VERSION,
    MANIFEST,
    ShardWriter,
    fsync_dir,
    shard_file,
    write_json_atomic,
)
from flatshard.runtime.comm.agree import agree, gather_json, rank_in, run_agreed, world_of
from flatshard.runtime.comm.mesh import group_timeout
from flatshard.runtime.consistency import Phase
from flatshard.runtime.instrument import label
from flatshard.runtime.tree import UnitHost
from flatshard.state.model_view import EntryKind, ModelView, dtype_name, model_view
from flatshard.state.optim import local_state, merged_meta

logger = logging.getLogger("flatshard")


def _reached(stage: str) -> None:
    """Called as a save passes ``"writing"`` (halfway through this rank's file) and, on rank 0,
    ``"before_commit"`` (manifest written, not yet renamed), ``"between_renames"`` (an old PATH moved
    aside, the new one not yet in place), ``"after_commit"`` (before the ``latest`` pointer) and
    ``"removing"`` (``keep_last``: an old checkpoint renamed to ``NAME.removing``, not yet deleted);
    tests and the example's fault injection patch it to stop a save there."""


@dataclass
class SavePlan:
    """What one rank writes, and what rank 0 needs for the manifest."""

    path: str
    rank: int
    world: int
    keep_last: Optional[int] = None
    items: list = field(default_factory=list)  # (key, full shape, dtype, start, end, 1-D tensor)
    rng: list = field(default_factory=list)  # (key, tensor)
    rng_meta: dict = field(default_factory=dict)
    state: Optional[str] = None  # this rank's loop state (``save(state=...)``) as JSON, or None
    head: dict = field(default_factory=dict)  # manifest fields known before writing (rank 0)

    @property
    def partial(self) -> str:
        return self.path + PARTIAL

    @property
    def file(self) -> str:
        return shard_file(self.rank, self.world)

    def snapshot(self) -> None:
        """Copy every tensor this rank writes off the training path (host memory, one copy of its share)."""
        self.items = [(k, s, d, a, b, t.detach().to("cpu", copy=True)) for k, s, d, a, b, t in self.items]
        self.rng = [(k, t.to("cpu", copy=True)) for k, t in self.rng]


@contextlib.contextmanager
def peer_errors(what: str) -> Iterator[None]:
    """A collective of a save or load that fails (a peer died, or stalled past the group's timeout)
    raises a ``CheckpointError`` naming this rank and the checkpoint phase, chained to the backend's."""
    try:
        yield
    except CheckpointError:
        raise
    except RuntimeError as exc:
        rank = dist.get_rank() if dist.is_initialized() else 0
        raise CheckpointError(
            f"flatshard: rank {rank}: {what} (phase checkpoint, no unit) did not complete: {exc}. A peer rank "
            "died or stalled (its collective never came), so a save may not have committed; restart the job "
            "and resume from the newest complete checkpoint (checkpoint.latest)"
        ) from exc


def _host(view: ModelView) -> Optional[UnitHost]:
    """The host that keeps the model's save state (its first unit's), if the model has units."""
    return view.hosts[0][1] if view.hosts else None


class AsyncSave:
    """The handle ``save(..., async_save=True)`` returns: ``wait()`` blocks until the checkpoint is
    committed on every rank (returns its path) or raises the save's error; ``done()`` polls. A failure
    that ``wait()`` never raised is raised, once, by the model's next ``save`` or ``load``."""

    def __init__(self, path: str):
        self.path = path
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[BaseException] = None
        self._reported = False

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> str:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout}s")
        if self._error is not None:
            self._reported = True
            raise CheckpointError(str(self._error)) from self._error
        return self.path


def save(
    path,
    model,
    optimizer=None,
    step: Optional[int] = None,
    extra: Any = None,
    async_save: bool = False,
    *,
    keep_last: Optional[int] = None,
    state: Optional[dict] = None,
) -> Optional[AsyncSave]:
    """Save ``model`` (and ``optimizer``'s state, ``step``, JSON-serialisable ``extra``, this rank's RNG
    states) to the directory ``path``. Collective: every rank of the model's process group calls it.

    Saving again to an existing ``path`` replaces it only once the new checkpoint is complete; killed
    at any point, ``path`` loads (the previous checkpoint until the new one commits). After the commit
    ``dirname(path)/latest`` names it (``latest(dirname(path))`` finds it), and with ``keep_last=k``
    k checkpoints are kept: ``path`` and the k - 1 most recently committed others beside it whose
    names differ from its name in their last number only (``step_path`` names them so).

    ``state`` is the loop's own state, this rank's: ``{name: obj}`` where each ``obj.state_dict()``
    returns JSON (a data loader's position, an LR scheduler); it goes into this rank's file, and
    ``load(..., state=)`` hands it back to the same rank's objects (resume.py: "The loop's own state").

    With ``async_save=True`` the tensors are first copied to host memory and the writing and commit
    run in a background thread on a separate gloo group; the returned ``AsyncSave`` says when it is
    committed. A later ``save`` or ``load`` of the same model waits for it first."""
    path = os.path.abspath(os.fspath(path))
    view = model_view(model)
    with label("checkpoint.save"), view.phase(Phase.CHECKPOINT), peer_errors(f"the save to {path}"):
        wait_pending(view, "save")
        return _save(path, view, optimizer, step, extra, async_save, keep_last, state)


def _save(path: str, view: ModelView, optimizer, step, extra, async_save, keep_last, state) -> Optional[AsyncSave]:
    group, record = view.group, view.record
    plan = run_agreed(lambda: _prepare(path, view, optimizer, step, extra, keep_last, state), group, record=record)
    if optimizer is not None:
        plan.head["optim"]["state"] = _manifest_optim(merged_meta(plan.head.pop("optim_meta"), view))
    _fresh_partial(plan, group, record)
    if not async_save:
        _write_and_commit(plan, group, record)
        return None
    plan.snapshot()
    handle = AsyncSave(path)
    host = _host(view)
    cgroup = _checkpoint_group(host, group)
    ctx = view.ctx

    def background_record(result) -> None:  # recorded as checkpoint traffic whatever the trainer does meanwhile
        if ctx is not None:
            ctx.record(result, "world", "<model>", phase=Phase.CHECKPOINT)

    def run() -> None:
        try:
            _write_and_commit(plan, cgroup, background_record)
        except Exception as exc:  # noqa: BLE001 - handed to wait()
            handle._error = exc

    handle._thread = threading.Thread(target=run, name=f"flatshard-save {path}", daemon=True)
    if host is not None:
        host.pending_save = handle
    handle._thread.start()
    return handle


def wait_pending(view: ModelView, what: str) -> None:
    """Wait for the model's asynchronous save in flight, if any (``save`` and ``load`` call it first);
    ``settle``'s rule for its failure."""
    host = _host(view)
    handle = host.pending_save if host is not None else None
    if host is not None:
        host.pending_save = None
    settle(handle, what, view.group, view.record)


def settle(handle: Optional[AsyncSave], what: str, group, record=None) -> None:
    """Wait for ``handle`` (a model's asynchronous save in flight, or None). If it failed and no
    ``wait()`` raised its error, raise it now, once, on every rank of ``group``, and do nothing else: the
    call after this one (``what``, a save or a load) runs as usual. Collective."""
    message, failure = None, None
    if handle is not None:
        if handle._thread is not None:
            handle._thread.join()
        if handle._error is not None and not handle._reported:
            handle._reported, failure = True, handle._error
            message = (
                f"the asynchronous save to {handle.path} failed: {failure}. This {what} did nothing; call it again"
            )
    first = next((m for m in gather_json(message, group, record) if m is not None), None)
    if first is not None:  # the save's error is already the same on every rank and names the rank
        raise CheckpointError(first) from failure


def _checkpoint_group(host: Optional[UnitHost], group):
    """A gloo group of the model's ranks for the background commit (never the training group), with
    the model group's timeout: a stalled peer fails the save after the time the user gave."""
    if world_of(group) == 1 or host is None:
        return group
    if host.checkpoint_group is None:
        ranks = dist.get_process_group_ranks(group)
        host.checkpoint_group = dist.new_group(
            ranks, backend="gloo", use_local_synchronization=True, timeout=group_timeout(group)
        )
    return host.checkpoint_group


def _prepare(path: str, view: ModelView, optimizer, step, extra, keep_last, state) -> SavePlan:
    group = view.group
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(
            f"keep_last must be a positive integer (how many checkpoints to keep) or None, got {keep_last!r}"
        )
    plan = SavePlan(path, rank_in(group), world_of(group), keep_last)
    _json_check(step, "step")
    _json_check(extra, "extra")
    unit = view.units[0] if view.units else None  # replicas that own the same elements: the first one writes
    group = unit.flat_group if unit is not None else None
    replica0 = group is None or not group.owners_replicated or dist.get_rank(group.groups.replicate_group) == 0
    tensor_of, extra_state = {}, {}
    for p in view.params:
        if replica0 and p.end > p.start:
            plan.items.append(("model/" + p.fqn, list(p.info.shape), p.view.dtype, p.start, p.end, p.view.detach()))
    for kind, name, obj in view.entries:
        if kind is EntryKind.PARAM:
            tensor_of[name] = "model/" + obj.fqn
        elif kind is EntryKind.EXTRA:
            extra_state[name] = _json_check(obj.get_extra_state(), f"extra state of {name}")
        else:
            tensor_of[name] = "model/" + name
            if plan.rank == 0:
                plan.items.append(
                    ("model/" + name, list(obj.shape), obj.dtype, 0, obj.numel(), obj.detach().reshape(-1))
                )
    plan.head = {
        "step": step,
        "extra": extra,
        "world_size": plan.world,
        "layout": _layout(view),
        "model": {"keys": view.names(), "tensor_of": tensor_of, "extra_state": extra_state},
        "optim": None,
    }
    if optimizer is not None:
        _optim_items(plan, view, optimizer, replica0)
    plan.rng, plan.rng_meta = _rng_state()
    if state is not None:
        plan.state = json.dumps(_loop_state(state))
        plan.head["state"] = sorted(state)
    return plan


def _loop_state(state) -> dict:
    """``{name: obj.state_dict()}``, each checked to be JSON (resume.py: "The loop's own state")."""
    if not isinstance(state, dict) or not all(isinstance(k, str) for k in state):
        raise CheckpointError(f"state must be a dict of names to objects with state_dict(), got {type(state).__name__}")
    out = {}
    for name, obj in state.items():
        if not callable(getattr(obj, "state_dict", None)) or not callable(getattr(obj, "load_state_dict", None)):
            raise CheckpointError(
                f"state[{name!r}] ({type(obj).__name__}) has no state_dict() and load_state_dict(): pass "
                "objects that have both (a data loader's position, an LR scheduler)"
            )
        out[name] = _json_check(obj.state_dict(), f"state[{name!r}].state_dict()")
    return out


def _optim_items(plan: SavePlan, view: ModelView, optimizer, replica0: bool) -> None:
    local = local_state(optimizer, view)
    for fqn, keys in local.values.items():
        param = local.params[fqn]
        for k, v in keys.items():
            d = local.meta[fqn][k]
            key = f"optim/{fqn}/{k}"
            if d["kind"] == "piece" and param is not None and replica0 and param.end > param.start:
                plan.items.append(
                    (key, list(param.info.shape), v.dtype, param.start, param.end, v.detach().reshape(-1))
                )
            elif d["kind"] == "whole" and plan.rank == 0:
                plan.items.append((key, list(v.shape), v.dtype, 0, v.numel(), v.detach().reshape(-1)))
    plan.head["optim"] = {"param_groups": local.groups}
    plan.head["optim_meta"] = local.meta


def _manifest_optim(meta: dict) -> dict:
    return {
        fqn: {
            k: ({"kind": "piece", "dtype": d["dtype"]} if d["kind"] in ("piece", "whole") else d)
            for k, d in keys.items()
        }
        for fqn, keys in meta.items()
    }


def _json_check(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from None
    return value


def _layout(view: ModelView) -> dict:
    units = view.units
    g = units[0].flat_group.groups if units else None
    strategy = units[0].settings.strategy if units else None
    return {
        "strategy": strategy.name if strategy is not None else None,
        "shard_size": g.shard_size if g else 1,
        "replicate_size": g.replicate_size if g else 1,
        "units": [
            {
                "name": u.name,
                "total": u.flat_group.layout.total,
                "shard_numel": u.flat_group.layout.shard_numel,
                "params": [i.name for i in u.flat_group.layout.infos],
            }
            for u in units
        ],
    }


def _rng_state() -> tuple[list, dict]:
    tensors = [("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors += [(f"rng/cuda/{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    legacy = np.random.get_state(legacy=True)  # the default, named: numpy types a bare call as the dict form
    assert isinstance(legacy, tuple)  # numpy's global generator is an MT19937, whose state is this tuple
    name, keys, pos, has_gauss, cached = legacy
    tensors.append(("rng/numpy", torch.from_numpy(keys.astype(np.int64))))
    version, state, gauss = random.getstate()
    meta = {"python": [version, list(state), gauss], "numpy": [name, int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def _fresh_partial(plan: SavePlan, group, record) -> None:
    """Rank 0 finishes what an interrupted save left, checks that ``PATH`` is flatshard's to replace, and
    creates an empty ``PATH.partial`` ([Note: crash-safe commit]); the others wait for it."""
    message = None
    if plan.rank == 0:
        try:
            prepare(plan.path)
        except CheckpointError as exc:
            message = str(exc)
        except OSError as exc:
            message = f"cannot create {plan.partial}: {exc}; check that the directory is writable"
    agree(message, group, record=record)


def _write_and_commit(plan: SavePlan, group, record) -> None:
    file_record, message = None, None
    try:
        file_record = _write_file(plan)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        message = f"writing {os.path.join(plan.partial, plan.file)} failed: {exc}"
    agree(message, group, record=record)  # each rank its own message: the error names the rank that failed
    records = gather_json(file_record, group, record)
    message = None
    if plan.rank == 0:
        try:
            manifest = _manifest(plan, records)
            write_json_atomic(os.path.join(plan.partial, MANIFEST), manifest)
            fsync_dir(plan.partial)
            _reached("before_commit")
            commit(plan.partial, plan.path, _reached)
        except Exception as exc:  # noqa: BLE001
            message = f"committing the checkpoint {plan.path} failed: {exc}"
        else:
            _after_commit(plan, manifest)
    agree(message, group, record=record)


def _after_commit(plan: SavePlan, manifest: dict) -> None:
    """Rank 0: the ``latest`` pointer, then ``keep_last`` rotation. The checkpoint is committed already,
    so a failure here is a warning, not a failed save: ``latest()`` does not need the pointer."""
    problem = write_pointer(plan.path, manifest["step"], manifest["committed_at"])
    if problem is not None:
        logger.warning("flatshard checkpoint: %s", problem)
    if plan.keep_last is not None:
        try:
            rotate(plan.path, plan.keep_last, _reached)
        except OSError as exc:
            logger.warning(
                "flatshard checkpoint: keep_last=%d: removing older checkpoints beside %s failed: %s",
                plan.keep_last,
                plan.path,
                exc,
            )


def _write_file(plan: SavePlan) -> dict:
    items = plan.items + [(k, list(t.shape), t.dtype, 0, t.numel(), t) for k, t in plan.rng]
    metadata = {"format": "pt", "flatshard": f"rank {plan.rank} of {plan.world}", "rng": json.dumps(plan.rng_meta)}
    if plan.state is not None:
        metadata["state"] = plan.state
    writer = ShardWriter(
        os.path.join(plan.partial, plan.file), [(k, d, [b - a]) for k, _, d, a, b, _ in items], metadata
    )
    for i, (key, _, _, _, _, tensor) in enumerate(items):
        writer.write(key, tensor)
        if i == len(items) // 2:
            _reached("writing")
    record = writer.close()
    record["pieces"] = {k: [a, b, shape, dtype_name(d)] for k, shape, d, a, b, _ in plan.items}
    return record


def _manifest(plan: SavePlan, records: list[dict]) -> dict:
    tensors: dict[str, dict] = {}
    files = {}
    for rank, rec in enumerate(records):
        name = shard_file(rank, plan.world)
        for key, (a, b, shape, dtype) in rec.pop("pieces").items():
            entry = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append([name, a, b])
        files[name] = dict(rec, rank=rank)
    for key, entry in tensors.items():
        entry["pieces"].sort(key=lambda p: p[1])
        _check_cover(key, entry)
    return {**manifest_head(), **plan.head, "tensors": tensors, "files": files}


def manifest_head() -> dict:
    """What every manifest begins with, whichever front end wrote it: the format and its version, the
    versions that wrote it, when, and this save's id."""
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "flatshard_version": __version__,
        "torch_version": torch.__version__,
        "committed_at": time.time(),
        "save_id": uuid.uuid4().hex,
    }


def _check_cover(key: str, entry: dict) -> None:
    numel = int(torch.Size(entry["shape"]).numel())
    at = 0
    for _, a, b in entry["pieces"]:
        if a > at:
            break
        at = max(at, b)
    if at < numel:
        raise CheckpointError(f"internal: the pieces of {key} cover only [0, {at}) of {numel} elements")
