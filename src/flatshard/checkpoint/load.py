"""Loading a checkpoint (save.py has the format): into any world size, sharding factor or strategy.

Loading finds the checkpoint committed at the path (directory.py: ``committed``, also while a save
that replaces it is stopped mid-commit), checks that every rank found the same save, then reads, for
each parameter and optimizer state this rank holds in the *current* layout, the byte ranges that
hold its elements, from whichever files hold them; it stages them (at most this rank's share of the
model), agrees with the other ranks that every read succeeded, and only then copies them in. RNG
states are restored when the world size is the one saved.
"""

from __future__ import annotations

import json
import os
import random
from typing import Any, NamedTuple, Optional

import numpy as np
import torch

from flatshard.api import CheckpointError, StateDictType
from flatshard.checkpoint.directory import locate, manifest_in
from flatshard.checkpoint.format import ShardReader, shard_file
from flatshard.checkpoint.save import peer_errors, wait_pending
from flatshard.runtime.comm.agree import gather_json, rank_in, run_agreed, world_of
from flatshard.runtime.consistency import Phase
from flatshard.runtime.instrument import label
from flatshard.state.model_view import EntryKind, ModelView, dtype_from, model_view
from flatshard.state.module import copy_into_model
from flatshard.state.optim import check, groups_to_load, param_names, scalar_tensor


class Loaded(NamedTuple):
    step: Optional[int]
    extra: Any


def load(path, model, optimizer=None, *, strict: bool = True, rng: bool = True, state=None) -> Loaded:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), whatever world size, sharding
    factor or strategy it was saved with. Collective. Returns ``(step, extra)``. With ``rng`` and the
    same world size, every rank's RNG states (torch, CUDA, numpy, random) are restored too. ``state``
    (``{name: obj}``, as given to ``save``) has each ``obj.load_state_dict`` called with what this rank
    saved under ``name``; it needs the world size saved (resume.py: "The loop's own state")."""
    path = os.path.abspath(os.fspath(path))
    view = model_view(model)
    with label("checkpoint.load"), view.phase(Phase.CHECKPOINT):
        with peer_errors(f"the load of {path}"):
            wait_pending(view, "load")
            manifest, staged = _stage(path, view, optimizer, strict, rng, state)
        return _apply(view, manifest, staged, optimizer, state)


def _stage(path: str, view: ModelView, optimizer, strict: bool, rng: bool, state) -> tuple[dict, Staged]:
    """Every check and read, agreed by every rank; nothing is copied in yet."""
    group, record = view.group, view.record
    where, manifest = run_agreed(lambda: _open(path), group, record=record)
    _same_save(path, where, manifest, group, record)
    run_agreed(lambda: _check_model(path, manifest, view, optimizer, strict), group, record=record)
    run_agreed(lambda: _check_state(path, manifest, state, world_of(group)), group, record=record)
    with_rng = rng and manifest["world_size"] == world_of(group)
    staged = run_agreed(lambda: _read_all(where, manifest, view, optimizer, with_rng, state), group, record=record)
    return manifest, staged


def _apply(view: ModelView, manifest: dict, staged: Staged, optimizer, state) -> Loaded:
    copy_into_model(view, staged.params, staged.plain)
    if optimizer is not None:
        optimizer.load_state_dict(staged.optim)
    if staged.rng is not None:
        _restore_rng(*staged.rng)
    for name, obj in (state or {}).items():
        obj.load_state_dict(staged.state[name])
    return Loaded(manifest.get("step"), manifest.get("extra"))


def _open(path: str) -> tuple[str, dict]:
    where = locate(path)
    return where, manifest_in(where, path)


def _same_save(path: str, where: str, manifest: dict, group, record) -> None:
    """Every rank must read the same save (shared storage): the manifests' save ids are compared."""
    seen = gather_json([where, manifest.get("save_id")], group, record)
    if any(i != seen[0][1] for _, i in seen):
        listed = "; ".join(f"rank {r}: {w} (save {i})" for r, (w, i) in enumerate(seen))
        raise CheckpointError(
            f"the ranks found different checkpoints at {path}: {listed}. Every rank must be given the "
            "same path and see the same files (a shared file system)"
        )


def _check_model(path: str, manifest: dict, view, optimizer, strict: bool) -> None:
    saved = manifest["model"]["keys"]
    check_names(path, saved, view.names(), strict)
    for kind, name, obj in view.entries:
        if kind is EntryKind.EXTRA or name not in saved:
            continue
        want = tuple(obj.info.shape if kind is EntryKind.PARAM else obj.shape)
        got = tuple(manifest["tensors"][manifest["model"]["tensor_of"][name]]["shape"])
        if got != want:
            raise CheckpointError(
                f"checkpoint {path} holds {name} with shape {got}, the model has {want}: not the same model"
            )
    if optimizer is not None and manifest.get("optim") is None:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state; call load without optimizer=, or save with it"
        )


def _check_state(path: str, manifest: dict, state, world: int) -> None:
    if state is None:
        return
    if not isinstance(state, dict) or not all(callable(getattr(o, "load_state_dict", None)) for o in state.values()):
        raise CheckpointError("state must be a dict of names to objects with load_state_dict(), as given to save")
    saved = manifest.get("state") or []
    missing = [n for n in state if n not in saved]
    if missing:
        raise CheckpointError(
            f"checkpoint {path} holds no loop state {_listed(missing)} (it holds {_listed(saved) or 'none'}): "
            "pass the names given to save(state=...), or leave state= out"
        )
    if manifest["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {path} was saved by {manifest['world_size']} ranks and this job has {world}: each "
            f"rank's loop state ({_listed(list(state))}) belongs to a rank of that job. Resume with "
            f"{manifest['world_size']} ranks, or load without state= and rebuild it from the step"
        )


def check_names(path: str, saved: list[str], names: list[str], strict: bool) -> None:
    """Under ``strict``, a CheckpointError naming what the model has and the checkpoint lacks and the
    reverse (either front end's load)."""
    missing = [n for n in names if n not in set(saved)]
    unexpected = [n for n in saved if n not in set(names)]
    if strict and (missing or unexpected):
        parts = [f"the model's {_listed(missing)} not in the checkpoint"] if missing else []
        parts += [f"the checkpoint's {_listed(unexpected)} not in the model"] if unexpected else []
        raise CheckpointError(
            f"checkpoint {path} does not match the model: {'; '.join(parts)}. Load it into the model "
            "it was saved from, or pass strict=False to load the names both have"
        )


def _listed(names: list[str], most: int = 6) -> str:
    more = f" and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(names[:most]) + more


class _Files:
    """Shard readers opened on first use, checked against the manifest's records."""

    def __init__(self, path: str, manifest: dict):
        self.path, self.manifest = path, manifest
        self.open: dict[str, ShardReader] = {}

    def reader(self, name: str) -> ShardReader:
        if name not in self.open:
            self.open[name] = ShardReader(os.path.join(self.path, name), self.manifest["files"][name])
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


class Staged(NamedTuple):
    """What a load read, before anything is copied in."""

    params: dict[int, torch.Tensor]  # id(LocalParam) -> this rank's elements
    plain: dict[str, Any]  # buffers, unmanaged parameters, extra state, by name
    optim: Optional[dict]  # what optimizer.load_state_dict takes
    rng: Optional[tuple[dict, dict]]
    state: dict  # the loop's own state, this rank's, by name


def _read_all(path: str, manifest: dict, view: ModelView, optimizer, with_rng: bool, state) -> Staged:
    files = _Files(path, manifest)
    try:
        tensor_of = manifest["model"]["tensor_of"]
        params = {
            id(s): files.fetch(next(tensor_of[n] for n in s.names if n in tensor_of), s.start, s.end)
            for s in view.params
            if any(n in tensor_of for n in s.names)
        }
        plain = {}
        for kind, name, obj in view.entries:
            if kind is EntryKind.EXTRA and name in manifest["model"]["extra_state"]:
                plain[name] = manifest["model"]["extra_state"][name]
            elif kind in (EntryKind.UNMANAGED, EntryKind.BUFFER) and name in tensor_of:
                plain[name] = files.fetch(tensor_of[name], 0, obj.numel()).view(obj.shape)
        optim_sd = _read_optim(files, manifest, view, optimizer) if optimizer is not None else None
        rng_state = _read_rng(files, manifest, rank_in(view.group)) if with_rng else None
        loop_state = _read_state(files, manifest, rank_in(view.group)) if state else {}
        return Staged(params, plain, optim_sd, rng_state, loop_state)
    finally:
        files.close()


def _read_optim(files: _Files, manifest: dict, view: ModelView, optimizer) -> dict:
    params, names, slots = param_names(optimizer, view)
    saved = {"state": manifest["optim"]["state"], "param_groups": manifest["optim"]["param_groups"]}
    problem = check(optimizer, saved, names, StateDictType.FULL_STATE_DICT, view)
    if problem is not None:
        raise CheckpointError(f"checkpoint {files.path}: {problem}")
    packed = {}
    for i, name in enumerate(names):
        if name not in saved["state"]:
            continue
        slot, state = slots[name], {}
        for k, d in saved["state"][name].items():
            if d["kind"] == "piece":
                key = f"optim/{name}/{k}"
                if slot is not None:
                    state[k] = files.fetch(key, slot.start, slot.end).view(slot.view.shape)  # the shard view's shape
                else:
                    shape = manifest["tensors"][key]["shape"]
                    state[k] = files.fetch(key, 0, int(torch.Size(shape).numel())).view(shape)
            elif d["kind"] == "scalar":
                state[k] = scalar_tensor(d)
            else:
                state[k] = d["value"]
        packed[i] = state
    return {"state": packed, "param_groups": groups_to_load(optimizer, saved)}


def _read_rng(files: _Files, manifest: dict, rank: int):
    name = shard_file(rank, manifest["world_size"])
    reader = files.reader(name)
    meta = json.loads(reader.metadata.get("rng", "null"))
    tensors = {k: reader.read(k) for k in reader.header if k.startswith("rng/")}
    return tensors, meta


def _read_state(files: _Files, manifest: dict, rank: int) -> dict:
    name = shard_file(rank, manifest["world_size"])
    text = files.reader(name).metadata.get("state")
    if text is None:
        raise CheckpointError(f"{os.path.join(files.path, name)} holds no loop state, while the manifest lists some")
    return json.loads(text)


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
