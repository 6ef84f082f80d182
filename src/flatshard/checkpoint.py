"""Checkpoints on disk: one safetensors file per rank and a JSON manifest; atomic, verified, pickle-free,
and loadable at any world size, sharding factor or strategy.

    flatshard.checkpoint.save("ckpt/step_100", model, opt, step=100, extra={"lr": 3e-4})
    handle = flatshard.checkpoint.save("ckpt/step_200", model, opt, step=200, async_save=True); handle.wait()
    step, extra = flatshard.checkpoint.load("ckpt/step_200", model, opt)

A checkpoint directory holds ``rank-RRRRR-of-WWWWW.safetensors`` per rank and ``manifest.json``
(written last): every tensor's name, shape, dtype and the flat ranges [start, end) each file holds,
the layout it was saved from, each file's size and checksums ([Note: checksums],
checkpoint_format.py), step, extra and the flatshard version. Each rank writes only its own pieces
(the ranks of the first replica write parameters and optimizer state; global rank 0 adds buffers;
every rank adds its RNG states).

[Note: atomic commit]
Ranks write into ``PATH.partial``; each fsyncs its file; rank 0 gathers every rank's record, writes
the manifest, fsyncs, and renames the directory to ``PATH`` (an old ``PATH`` is first renamed to
``PATH.replaced`` and removed after). ``load`` reads only a directory named ``PATH`` that has a
manifest, so a save killed at any point leaves either the previous checkpoint or nothing that
loads; an unfinished ``PATH.partial`` is named in the error and removed by the next save.

Loading reads, for each parameter and optimizer state this rank holds in the *current* layout, the
byte ranges that hold its elements, from whichever files hold them; it stages them (at most this
rank's share of the model), agrees with the other ranks that every read succeeded, and only then
copies them in. RNG states are restored when the world size is the one saved.
"""
from __future__ import annotations

import json
import os
import random
import shutil
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch
import torch.distributed as dist

from flatshard.checkpoint_format import (
    ShardReader, ShardWriter, dtype_from, dtype_name, fsync_dir, write_json_atomic,
)
from flatshard.checkpoint_optim import local_state, merged_meta, scalar_tensor
from flatshard.checkpoint_sync import CheckpointError, agree, gather_json, run_agreed, world_of
from flatshard.state_dict import copy_into_model, model_view, rank_in

MANIFEST = "manifest.json"
FORMAT, FORMAT_VERSION = "flatshard-checkpoint", 1
_PENDING, _GROUP = "_flatshard_pending_save", "_flatshard_checkpoint_group"


class Loaded(NamedTuple):
    step: Optional[int]
    extra: Any


def shard_file(rank: int, world: int) -> str:
    return f"rank-{rank:05d}-of-{world:05d}.safetensors"


# ---- saving ---------------------------------------------------------------------------------
@dataclass
class _Job:
    """What one rank writes, and what rank 0 needs for the manifest."""

    path: str
    rank: int
    world: int
    items: list = field(default_factory=list)  # (key, full shape, dtype, start, end, 1-D tensor)
    rng: list = field(default_factory=list)  # (key, tensor)
    rng_meta: dict = field(default_factory=dict)
    head: dict = field(default_factory=dict)  # manifest fields known before writing (rank 0)

    @property
    def partial(self) -> str:
        return self.path + ".partial"

    @property
    def file(self) -> str:
        return shard_file(self.rank, self.world)

    def snapshot(self) -> None:
        """Copy every tensor this rank writes off the training path (host memory, one copy of its share)."""
        self.items = [(k, s, d, a, b, t.detach().to("cpu", copy=True)) for k, s, d, a, b, t in self.items]
        self.rng = [(k, t.to("cpu", copy=True)) for k, t in self.rng]


class AsyncSave:
    """The handle ``save(..., async_save=True)`` returns: ``wait()`` blocks until the checkpoint is
    committed on every rank (returns its path) or raises the save's error; ``done()`` polls."""

    def __init__(self, path: str):
        self.path = path
        self._thread: Optional[threading.Thread] = None
        self._error: Optional[str] = None

    def done(self) -> bool:
        return self._thread is None or not self._thread.is_alive()

    def wait(self, timeout: Optional[float] = None) -> str:
        if self._thread is not None:
            self._thread.join(timeout)
            if self._thread.is_alive():
                raise TimeoutError(f"the asynchronous save to {self.path} is still running after {timeout}s")
        if self._error is not None:
            raise CheckpointError(self._error)
        return self.path


def save(path, model, optimizer=None, step: Optional[int] = None, extra: Any = None, async_save: bool = False,
         *, _test_hook: Optional[Callable[[str], None]] = None) -> Optional[AsyncSave]:
    """Save ``model`` (and ``optimizer``'s state, ``step``, JSON-serialisable ``extra``, this rank's RNG
    states) to the directory ``path``. Collective: every rank of the model's process group calls it.

    With ``async_save=True`` the tensors are first copied to host memory and the writing and commit
    run in a background thread on a separate gloo group; the returned ``AsyncSave`` says when it is
    committed. A later ``save`` or ``load`` of the same model waits for it first. ``_test_hook(stage)``
    is for tests: called with ``"writing"`` halfway through this rank's file and, on rank 0,
    ``"before_commit"`` once the manifest is written but before the rename."""
    path = os.path.abspath(os.fspath(path))
    wait_pending(model)
    view = model_view(model)
    group = view.group
    job = run_agreed(lambda: _prepare(path, model, view, optimizer, step, extra), group)
    if optimizer is not None:
        job.head["optim"]["state"] = _manifest_optim(merged_meta(job.head.pop("optim_meta"), group))
    _fresh_partial(job, group)
    if not async_save:
        _write_and_commit(job, group, _test_hook)
        return None
    job.snapshot()
    handle = AsyncSave(path)
    cgroup = _checkpoint_group(model, group)

    def run() -> None:
        try:
            _write_and_commit(job, cgroup, _test_hook)
        except Exception as exc:  # noqa: BLE001 - handed to wait()
            handle._error = str(exc)

    handle._thread = threading.Thread(target=run, name=f"flatshard-save {path}", daemon=True)
    model.__dict__[_PENDING] = handle
    handle._thread.start()
    return handle


def wait_pending(model) -> None:
    handle = model.__dict__.pop(_PENDING, None)
    if handle is not None:
        handle.wait()


def _checkpoint_group(model, group):
    """A gloo group of the model's ranks for the background commit (never the training group)."""
    if world_of(group) == 1:
        return group
    if _GROUP not in model.__dict__:
        ranks = dist.get_process_group_ranks(group)
        model.__dict__[_GROUP] = dist.new_group(ranks, backend="gloo", use_local_synchronization=True)
    return model.__dict__[_GROUP]


def _prepare(path: str, model, view, optimizer, step, extra) -> _Job:
    group = view.group
    job = _Job(path, rank_in(group), world_of(group))
    _json_check(step, "step")
    _json_check(extra, "extra")
    groups = view.units[0].groups if view.units else None
    replica0 = groups is None or groups.replicate_size == 1 or dist.get_rank(groups.replicate_group) == 0
    tensor_of, extra_state = {}, {}
    for slot in view.slots:
        if replica0 and slot.end > slot.start:
            job.items.append(("model/" + slot.fqn, list(slot.info.shape), slot.view.dtype, slot.start, slot.end, slot.view.detach()))
    for kind, name, obj in view.entries:
        if kind == "param":
            tensor_of[name] = "model/" + obj.fqn
        elif kind == "extra":
            extra_state[name] = _json_check(obj.get_extra_state(), f"extra state of {name}")
        else:
            tensor_of[name] = "model/" + name
            if job.rank == 0:
                job.items.append(("model/" + name, list(obj.shape), obj.dtype, 0, obj.numel(), obj.detach().reshape(-1)))
    job.head = {
        "step": step, "extra": extra, "world_size": job.world, "layout": _layout(model, view),
        "model": {"keys": view.names(), "tensor_of": tensor_of, "extra_state": extra_state}, "optim": None,
    }
    if optimizer is not None:
        _optim_items(job, model, view, optimizer, replica0)
    job.rng, job.rng_meta = _rng_state()
    return job


def _optim_items(job: _Job, model, view, optimizer, replica0: bool) -> None:
    groups_json, meta, values, slots = local_state(model, optimizer, None, view)
    for fqn, keys in values.items():
        slot = slots[fqn]
        for k, v in keys.items():
            d = meta[fqn][k]
            key = f"optim/{fqn}/{k}"
            if d["kind"] == "piece" and replica0 and slot.end > slot.start:
                job.items.append((key, list(slot.info.shape), v.dtype, slot.start, slot.end, v.detach().reshape(-1)))
            elif d["kind"] == "whole" and job.rank == 0:
                job.items.append((key, list(v.shape), v.dtype, 0, v.numel(), v.detach().reshape(-1)))
    job.head["optim"] = {"param_groups": groups_json}
    job.head["optim_meta"] = meta


def _manifest_optim(meta: dict) -> dict:
    return {fqn: {k: ({"kind": "piece", "dtype": d["dtype"]} if d["kind"] in ("piece", "whole") else d)
                  for k, d in keys.items()} for fqn, keys in meta.items()}


def _json_check(value: Any, what: str) -> Any:
    try:
        json.dumps(value)
    except (TypeError, ValueError) as exc:
        raise CheckpointError(f"{what} must be JSON-serialisable (numbers, strings, lists, dicts): {exc}") from None
    return value


def _layout(model, view) -> dict:
    from flatshard.fsdp import FullyShardedDataParallel as FSDP

    wrappers = FSDP.fsdp_modules(model)
    g = view.units[0].groups if view.units else None
    return {
        "strategy": getattr(getattr(wrappers[0], "_strategy", None), "name", None) if wrappers else None,
        "shard_size": g.shard_size if g else 1, "replicate_size": g.replicate_size if g else 1,
        "units": [{"name": u.name, "total": u.layout.total, "shard_numel": u.layout.shard_numel,
                   "params": [i.name for i in u.layout.infos]} for u in view.units],
    }


def _rng_state() -> tuple[list, dict]:
    tensors = [("rng/torch", torch.get_rng_state())]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors += [(f"rng/cuda/{i}", s) for i, s in enumerate(torch.cuda.get_rng_state_all())]
    name, keys, pos, has_gauss, cached = np.random.get_state()
    tensors.append(("rng/numpy", torch.from_numpy(keys.astype(np.int64))))
    version, state, gauss = random.getstate()
    meta = {"python": [version, list(state), gauss], "numpy": [name, int(pos), int(has_gauss), float(cached)]}
    return tensors, meta


def _fresh_partial(job: _Job, group) -> None:
    """Rank 0 removes a stale ``PATH.partial`` and creates an empty one; the others wait for it."""
    message = None
    if job.rank == 0:
        try:
            if os.path.exists(job.partial):
                shutil.rmtree(job.partial)
            os.makedirs(job.partial)
        except OSError as exc:
            message = f"cannot create {job.partial}: {exc}; check that the directory is writable"
    agree(message, group)


def _write_and_commit(job: _Job, group, hook) -> None:
    record, message = None, None
    try:
        record = _write_file(job, hook)
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        message = f"writing {os.path.join(job.partial, job.file)} failed: {exc}"
    records = gather_json({"record": record, "error": message}, group)
    agree(next((r["error"] for r in records if r["error"]), None), group)
    message = None
    if job.rank == 0:
        try:
            write_json_atomic(os.path.join(job.partial, MANIFEST), _manifest(job, [r["record"] for r in records]))
            fsync_dir(job.partial)
            if hook is not None:
                hook("before_commit")
            _commit(job.partial, job.path)
        except Exception as exc:  # noqa: BLE001
            message = f"committing the checkpoint {job.path} failed: {exc}"
    agree(message, group)


def _write_file(job: _Job, hook) -> dict:
    items = job.items + [(k, list(t.shape), t.dtype, 0, t.numel(), t) for k, t in job.rng]
    metadata = {"format": "pt", "flatshard": f"rank {job.rank} of {job.world}", "rng": json.dumps(job.rng_meta)}
    writer = ShardWriter(os.path.join(job.partial, job.file), [(k, d, [b - a]) for k, _, d, a, b, _ in items], metadata)
    for i, (key, _, _, _, _, tensor) in enumerate(items):
        writer.write(key, tensor)
        if i == len(items) // 2 and hook is not None:
            hook("writing")
    record = writer.close()
    record["pieces"] = {k: [a, b, shape, dtype_name(d)] for k, shape, d, a, b, _ in job.items}
    return record


def _manifest(job: _Job, records: list[dict]) -> dict:
    import flatshard

    tensors: dict[str, dict] = {}
    files = {}
    for rank, rec in enumerate(records):
        name = shard_file(rank, job.world)
        for key, (a, b, shape, dtype) in rec.pop("pieces").items():
            entry = tensors.setdefault(key, {"shape": shape, "dtype": dtype, "pieces": []})
            entry["pieces"].append([name, a, b])
        files[name] = dict(rec, rank=rank)
    for key, entry in tensors.items():
        entry["pieces"].sort(key=lambda p: p[1])
        _check_cover(key, entry)
    return {
        "format": FORMAT, "format_version": FORMAT_VERSION, "flatshard_version": flatshard.__version__,
        "torch_version": torch.__version__, **job.head, "tensors": tensors, "files": files,
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


def _commit(partial: str, path: str) -> None:
    old = path + ".replaced"
    if os.path.exists(path):
        if os.path.exists(old):
            shutil.rmtree(old)
        os.rename(path, old)
    os.rename(partial, path)
    fsync_dir(os.path.dirname(path) or ".")
    if os.path.exists(old):
        shutil.rmtree(old)


# ---- loading --------------------------------------------------------------------------------
def load(path, model, optimizer=None, *, strict: bool = True, rng: bool = True) -> Loaded:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), whatever world size, sharding
    factor or strategy it was saved with. Collective. Returns ``(step, extra)``. With ``rng`` and the
    same world size, every rank's RNG states (torch, CUDA, numpy, random) are restored too."""
    path = os.path.abspath(os.fspath(path))
    wait_pending(model)
    view = model_view(model)
    group = view.group
    manifest = run_agreed(lambda: read_manifest(path), group)
    run_agreed(lambda: _check_model(path, manifest, view, optimizer, strict), group)
    staged = run_agreed(lambda: _read_all(path, manifest, model, view, optimizer, rng and manifest["world_size"] == world_of(group)), group)
    params, plain, optim_sd, rng_state = staged
    copy_into_model(view, params, plain)
    if optimizer is not None:
        optimizer.load_state_dict(optim_sd)
    if rng_state is not None:
        _restore_rng(*rng_state)
    return Loaded(manifest.get("step"), manifest.get("extra"))


def read_manifest(path: str) -> dict:
    """The manifest of the checkpoint at ``path``, with its files present and of the recorded sizes."""
    if not os.path.isdir(path):
        hint = ""
        if os.path.isdir(path + ".partial"):
            hint = f"; {path}.partial holds a save that never finished (it is not loadable; the next save removes it)"
        if os.path.isdir(path + ".replaced"):
            hint += f"; {path}.replaced holds the checkpoint that a save was replacing when it stopped"
        raise CheckpointError(f"no checkpoint at {path}{hint}")
    mpath = os.path.join(path, MANIFEST)
    if not os.path.exists(mpath):
        raise CheckpointError(f"{path} has no {MANIFEST}: the checkpoint is incomplete or not a flatshard checkpoint; "
                              "load an earlier checkpoint")
    try:
        with open(mpath) as f:
            manifest = json.load(f)
    except ValueError as exc:
        raise CheckpointError(f"{mpath} is not valid JSON ({exc}): the manifest is corrupt; load an earlier checkpoint") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{mpath} is not a flatshard checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointError(f"{path} has format version {manifest['format_version']}; this flatshard reads up to "
                              f"{FORMAT_VERSION}: upgrade flatshard")
    for name, rec in manifest["files"].items():
        file = os.path.join(path, name)
        if not os.path.exists(file):
            raise CheckpointError(f"shard file {file} is missing: the checkpoint is incomplete; restore the file or load "
                                  "an earlier checkpoint")
        if os.path.getsize(file) != rec["bytes"]:
            raise CheckpointError(f"shard file {file} is truncated or altered: {os.path.getsize(file)} bytes on disk, the "
                                  f"manifest records {rec['bytes']}; restore the file or load an earlier checkpoint")
    return manifest


def _check_model(path: str, manifest: dict, view, optimizer, strict: bool) -> None:
    saved = manifest["model"]["keys"]
    names = view.names()
    missing = [n for n in names if n not in set(saved)]
    unexpected = [n for n in saved if n not in set(names)]
    if strict and (missing or unexpected):
        parts = [f"the model's {_listed(missing)} not in the checkpoint"] if missing else []
        parts += [f"the checkpoint's {_listed(unexpected)} not in the model"] if unexpected else []
        raise CheckpointError(f"checkpoint {path} does not match the model: {'; '.join(parts)}. Load it into the model "
                              "it was saved from, or pass strict=False to load the names both have")
    for kind, name, obj in view.entries:
        if kind == "extra" or name not in saved:
            continue
        want = tuple(obj.info.shape if kind == "param" else obj.shape)
        got = tuple(manifest["tensors"][manifest["model"]["tensor_of"][name]]["shape"])
        if got != want:
            raise CheckpointError(f"checkpoint {path} holds {name} with shape {got}, the model has {want}: not the same model")
    if optimizer is not None and manifest.get("optim") is None:
        raise CheckpointError(f"checkpoint {path} holds no optimizer state; call load without optimizer=, or save with it")


def _listed(names: list[str], most: int = 6) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class _Files:
    """Shard readers opened on first use, checked against the manifest's records."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest, self.open = path, manifest, {}

    def reader(self, name: str) -> ShardReader:
        if name not in self.open:
            self.open[name] = ShardReader(os.path.join(self.path, name), self.manifest["files"][name], os.path.join(self.path, name))
        return self.open[name]

    def fetch(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of the flattened tensor ``key``, from the files that hold them."""
        entry = self.manifest["tensors"][key]
        out = torch.empty(b - a, dtype=dtype_from(entry["dtype"]))
        for name, start, end in entry["pieces"]:
            lo, hi = max(a, start), min(b, end)
            if hi > lo:
                self.reader(name).read_into(key, lo - start, out[lo - a : hi - a])
        return out

    def close(self) -> None:
        for r in self.open.values():
            r.close()


def _read_all(path: str, manifest: dict, model, view, optimizer, with_rng: bool):
    files = _Files(path, manifest)
    try:
        tensor_of = manifest["model"]["tensor_of"]
        params = {id(s): files.fetch(next(tensor_of[n] for n in s.names if n in tensor_of), s.start, s.end)
                  for s in view.slots if any(n in tensor_of for n in s.names)}
        plain = {}
        for kind, name, obj in view.entries:
            if kind == "extra" and name in manifest["model"]["extra_state"]:
                plain[name] = manifest["model"]["extra_state"][name]
            elif kind in ("plain", "buffer") and name in tensor_of:
                plain[name] = files.fetch(tensor_of[name], 0, obj.numel()).view(obj.shape)
        optim_sd = _read_optim(files, manifest, model, view, optimizer) if optimizer is not None else None
        rng_state = _read_rng(files, manifest, rank_in(view.group)) if with_rng else None
        return params, plain, optim_sd, rng_state
    finally:
        files.close()


def _read_optim(files: _Files, manifest: dict, model, view, optimizer) -> dict:
    from flatshard.api import StateDictType
    from flatshard.checkpoint_optim import _check, _groups_to_load, param_names

    params, names, slots = param_names(model, optimizer, view)
    saved = {"state": manifest["optim"]["state"], "param_groups": manifest["optim"]["param_groups"]}
    problem = _check(optimizer, saved, names, StateDictType.FULL_STATE_DICT, view)
    if problem is not None:
        raise CheckpointError(f"checkpoint {files.path}: {problem}")
    packed = {}
    for i, (p, name) in enumerate(zip(params, names)):
        if name not in saved["state"]:
            continue
        slot, state = slots[name], {}
        for k, d in saved["state"][name].items():
            if d["kind"] == "piece":
                key = f"optim/{name}/{k}"
                if slot is not None:
                    state[k] = files.fetch(key, slot.start, slot.end)
                else:
                    shape = manifest["tensors"][key]["shape"]
                    state[k] = files.fetch(key, 0, int(torch.Size(shape).numel())).view(shape)
            elif d["kind"] == "scalar":
                state[k] = scalar_tensor(d)
            else:
                state[k] = d["value"]
        packed[i] = state
    return {"state": packed, "param_groups": _groups_to_load(optimizer, saved)}


def _read_rng(files: _Files, manifest: dict, rank: int):
    name = shard_file(rank, manifest["world_size"])
    reader = files.reader(name)
    meta = json.loads(reader.metadata.get("rng", "null"))
    tensors = {k: reader.read(k) for k in reader.header if k.startswith("rng/")}
    return tensors, meta


def _restore_rng(tensors: dict, meta: dict) -> None:
    torch.set_rng_state(tensors["rng/torch"])
    cuda = sorted((k for k in tensors if k.startswith("rng/cuda/")), key=lambda k: int(k.rsplit("/", 1)[1]))
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([tensors[k] for k in cuda])
    if meta:
        version, state, gauss = meta["python"]
        random.setstate((version, tuple(state), gauss))
        name, pos, has_gauss, cached = meta["numpy"]
        np.random.set_state((name, tensors["rng/numpy"].numpy().astype(np.uint32), pos, has_gauss, cached))


__all__ = ["save", "load", "AsyncSave", "Loaded", "CheckpointError", "read_manifest", "shard_file"]
