"""Checkpoints of ``fully_shard`` models (DTensor parameters): DCP's safetensors shards, flatshard's commit.

``save`` and ``load`` (save.py, load.py) come here when the model's parameters are DTensors. The
directory holds ``shard-RRRRR-model-00001-of-00001.safetensors`` per rank that holds something
(written by ``torch.distributed.checkpoint`` through ``HuggingFaceStorageWriter(save_distributed=True)``:
each tensor's local piece, its global offsets in the safetensors header) and ``manifest.json``: step,
extra, the optimizer's ``param_groups``, every rank's RNG states and loop state, each file's size.

[Note: fully_shard checkpoints are DCP safetensors]
A fully_shard checkpoint must be something ``torch.distributed.checkpoint`` reads (and the frameworks
that load through it), and nothing a user loads later may be unpickled. DCP's default
``FileSystemWriter`` writes a pickled ``.metadata``, and its ``torch.save`` path pickles every non-tensor
value; both are out. DCP's ``HuggingFaceStorageWriter(save_distributed=True)`` writes one safetensors file
per rank, each tensor piece with its global offsets in the file's JSON header and no ``.metadata``;
``HuggingFaceStorageReader`` rebuilds DCP's metadata from those headers, so ``dcp.load`` reshards it to any
world size or mesh (the DTensors it is given decide the pieces read). So: the state dict handed to DCP
holds tensors only (the model's, from ``get_model_state_dict``, under ``model.``; the optimizer's state,
from ``get_optimizer_state_dict``, under ``optim.state.``), written into ``PATH.partial``; everything else
(the optimizer's ``param_groups``, step, extra, RNG, loop state) is JSON in the manifest, which rank 0
writes last and commits exactly as the wrapper's checkpoints ([Note: crash-safe commit], directory.py;
``latest`` and ``keep_last`` alike). A user without flatshard loads the tensors with ``dcp.load(sd,
storage_reader=HuggingFaceStorageReader(PATH))`` and the hyperparameters from ``manifest.json``.
Not chosen: consolidating to full tensors on save (``enable_consolidation``) costs a full copy per save
and rank 0's time; a pickle-free rewrite of DCP's ``.metadata`` would be a format only flatshard reads.

[Note: asynchronous saves of fully_shard models]
``save(..., async_save=True)`` does in the caller's thread what must see the model as it is now: agrees
the save, prepares ``PATH.partial``, takes the state dicts, copies every tensor of them to host memory
(``.to("cpu", copy=True)``: a DTensor keeps its mesh and placements, its local piece copied, as DCP's own
staging does) and records this rank's RNG and loop state. A thread then runs what the synchronous save
runs after that (``dcp.save`` of the copies, the manifest, the commit) over a gloo group of every rank
made for it once per model, with the job group's timeout: the training's collectives and the save's never
share a group, so neither waits behind the other. The handle is save.py's ``AsyncSave``; the model's next
save or load waits for it first and raises a failure no ``wait()`` raised, once, on every rank, as the
wrapper's does. Not chosen: DCP's ``async_save``, whose executor writes and returns a future but knows
nothing of flatshard's commit, manifest or ``latest``: the commit would run in yet another callback,
and its errors would reach only the rank whose future is waited on.

[Note: a fully_shard checkpoint waits as long as the model does]
A save or load is collective over every rank of the job (DCP plans and writes over one group). Over the
default group, a rank stopped in a save (SIGSTOP, a hung filesystem) would stall every other rank for
the default group's timeout (30 minutes on gloo), however short the timeout the user gave the groups
the model trains over. So the checkpoint's collectives run over ``job_group(model)``: the default group
when the groups the model gathers and reduces over (each flat group's shard and replicate groups) wait
as long as it does; else a group of every rank waiting the longest of those groups' timeouts (never
shorter than training's own waits): a 1-D mesh's
group when it is every rank in order with that timeout, else one made once per model (``new_group`` at
its first save or load, which every rank of the job calls together). The user sets the timeout where
FSDP2's users do, on the groups of the mesh; nothing new to pass. The error then names the save
(``saving.peer_errors``) on every rank that waited.
Not chosen: a ``process_group=`` keyword as DCP's ``save`` has (a second place to say what the mesh
already says, and a wrong one given silently hangs as before).
"""

from __future__ import annotations

import base64
import importlib
import os
import threading
import weakref
from datetime import timedelta
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import PARTIAL, commit, locate, manifest_in, prepare
from flatshard.checkpoint.format import MANIFEST, fsync_dir, write_json_atomic
from flatshard.checkpoint.load import Loaded, check_names
from flatshard.checkpoint.save import AsyncSave, SavePlan, manifest_head
from flatshard.runtime.comm.agree import agree, gather_json, rank_in, run_agreed, world_of
from flatshard.runtime.comm.mesh import group_timeout
from flatshard.runtime.tree import unit_hosts

KIND = "dcp-safetensors"  # the manifest's "layout"/"kind" of a fully_shard checkpoint


def is_dcp(manifest: dict) -> bool:
    layout = manifest.get("layout")
    return isinstance(layout, dict) and layout.get("kind") == KIND


_JOB_GROUPS: weakref.WeakKeyDictionary[torch.nn.Module, Optional[dist.ProcessGroup]] = weakref.WeakKeyDictionary()


def job_group(model) -> Optional[dist.ProcessGroup]:
    """The group a fully_shard model's checkpoint collectives run over: every rank of the job, waiting as
    long as the model's own collectives ([Note: a fully_shard checkpoint waits as long as the model does]);
    None for the default group. Collective on its first call for a model that needs a group of its own."""
    if model in _JOB_GROUPS:
        return _JOB_GROUPS[model]
    used = {
        id(g): g
        for host in unit_hosts(model)
        for flat in host._unit.flat_groups
        for g in (flat.groups.shard_group, flat.groups.replicate_group)  # what gathers and reduces
        if g is not None and dist.get_world_size(g) > 1
    }
    waits = [t for t in map(group_timeout, used.values()) if t is not None]
    longest: Optional[timedelta] = max(waits, default=None)
    chosen: Optional[dist.ProcessGroup] = None
    if longest is not None and longest != group_timeout(None):
        every = list(range(dist.get_world_size()))
        found = [g for g in used.values() if group_timeout(g) == longest and dist.get_process_group_ranks(g) == every]
        chosen = found[0] if found else dist.new_group(every, timeout=longest)
    _JOB_GROUPS[model] = chosen
    return chosen


def save(path: str, model, optimizer, step, extra, async_save: bool, keep_last, state) -> Optional[AsyncSave]:
    """save.py's ``save`` for a fully_shard model ([Note: fully_shard checkpoints are DCP safetensors]);
    with ``async_save`` the writing and the commit run in a thread ([Note: asynchronous saves of
    fully_shard models]) and the handle is returned."""
    group = job_group(model)  # every rank of the job calls save
    with saving.peer_errors(f"the save to {path}"):
        wait_pending(model, group, "save")
        head, sd = run_agreed(lambda: _collect(model, optimizer, step, extra, keep_last, state), group)
        message = None
        if rank_in(group) == 0:
            try:
                prepare(path)
            except (CheckpointError, OSError) as exc:
                message = f"cannot prepare {path}{PARTIAL}: {exc}"
        agree(message, group)
        record = _rank_record(state)  # this rank's RNG and loop state as they are now
        if not async_save:
            _write_and_commit(path, head, sd, record, keep_last, group)
            return None
        copies = _host_copies(sd)
        background = _background_group(model, group)
        handle = AsyncSave(path)

        def run() -> None:
            try:
                with saving.peer_errors(f"the asynchronous save to {path}"):
                    _write_and_commit(path, head, copies, record, keep_last, background)
            except Exception as exc:  # noqa: BLE001 - handed to wait() or to the next save or load
                handle._error = exc

        handle._thread = threading.Thread(target=run, name=f"flatshard-save {path}", daemon=True)
        _PENDING[model] = handle
        handle._thread.start()
        return handle


def _write_and_commit(path: str, head: dict, sd: dict, record: dict, keep_last, group) -> None:
    """DCP writes ``sd`` into ``PATH.partial``; rank 0 writes the manifest and commits; every rank hears
    how it went."""
    partial = path + PARTIAL
    message = None
    try:
        dcp.save(sd, storage_writer=HuggingFaceStorageWriter(partial, save_distributed=True), process_group=group)
        saving._reached("writing")
    except Exception as exc:  # noqa: BLE001 - every rank must hear of it
        message = f"writing {partial} failed: {exc}"
    agree(message, group)  # each rank its own message: the error names the rank that failed
    groups = None if head["optim"] is None else head["optim"]["param_groups"]
    ranks = gather_json({**record, "param_groups": groups}, group)
    message = None
    if rank_in(group) == 0:
        try:
            manifest = _manifest(partial, head, _groups_per_rank(ranks), world_of(group))
            write_json_atomic(os.path.join(partial, MANIFEST), manifest)
            fsync_dir(partial)
            saving._reached("before_commit")
            commit(partial, path, saving._reached)
        except Exception as exc:  # noqa: BLE001 - every rank must hear of it
            message = f"committing the checkpoint {path} failed: {exc}"
        else:
            plan = SavePlan(path, 0, world_of(group), keep_last)
            saving._after_commit(plan, manifest)
    agree(message, group)


def _host_copies(sd: Any) -> Any:
    """``sd`` (nested dicts) with every tensor copied to host memory (a DTensor's local piece, its mesh and placements
    kept): what the training does next cannot change what the thread writes."""
    if isinstance(sd, dict):
        return {k: _host_copies(v) for k, v in sd.items()}
    if isinstance(sd, torch.Tensor):
        return sd.detach().to("cpu", copy=True)
    return sd


_PENDING: weakref.WeakKeyDictionary[torch.nn.Module, AsyncSave] = weakref.WeakKeyDictionary()
_BACKGROUND: weakref.WeakKeyDictionary[torch.nn.Module, dist.ProcessGroup] = weakref.WeakKeyDictionary()


def _background_group(model, group: Optional[dist.ProcessGroup]) -> dist.ProcessGroup:
    """The gloo group of every rank the model's asynchronous saves run over, with the job group's
    timeout; made once per model, at its first asynchronous save (collective, as the save is)."""
    if model not in _BACKGROUND:
        every = list(range(dist.get_world_size()))
        _BACKGROUND[model] = dist.new_group(every, timeout=group_timeout(group), backend="gloo")
    return _BACKGROUND[model]


def wait_pending(model, group: Optional[dist.ProcessGroup], what: str) -> None:
    """Wait for the model's asynchronous save in flight, if any (``save`` and ``load`` call it first);
    save.py's ``settle`` rule for its failure."""
    saving.settle(_PENDING.pop(model, None), what, group)


def _collect(model, optimizer, step, extra, keep_last, state) -> tuple[dict, dict]:
    """The manifest's head and what DCP writes, from one model and one optimizer state dict."""
    msd, osd = _state_dicts(model, optimizer)
    return _head(msd, osd, step, extra, keep_last, state), _tensors(msd, osd)


def _state_dicts(model, optimizer) -> tuple[dict, Optional[dict]]:
    """The model's state dict and the optimizer's (``None`` without an optimizer), each taken once."""
    osd = None if optimizer is None else dict(get_optimizer_state_dict(model, optimizer))
    return get_model_state_dict(model), osd


def _head(msd: dict, osd: Optional[dict], step, extra, keep_last, state) -> dict:
    if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
        raise CheckpointError(
            f"keep_last must be a positive integer (how many checkpoints to keep) or None, got {keep_last!r}"
        )
    saving._json_check(step, "step")
    saving._json_check(extra, "extra")
    groups = None
    if osd is not None:
        groups = osd["param_groups"]
        saving._json_check(groups, "the optimizer's param_groups (its hyperparameters)")
    return {
        "step": step,
        "extra": extra,
        "model": {"keys": list(msd)},
        "optim": None if groups is None else {"param_groups": groups},
        "state": None if state is None else sorted(saving._loop_state(state)),
    }


def _tensors(msd: dict, osd: Optional[dict]) -> dict:
    """What DCP writes and reads: tensors only, the model's under ``model``, the optimizer's state under
    ``optim.state`` (DTensors where the parameters are; a scalar ``step`` as a plain tensor)."""
    sd: dict[str, Any] = {"model": msd}
    if osd is not None:
        state: dict[str, Any] = dict(osd["state"])
        for fqn, keys in state.items():
            for k, v in keys.items():
                if not isinstance(v, torch.Tensor):
                    raise CheckpointError(
                        f"the optimizer state {fqn}/{k} is a {type(v).__name__}, not a tensor: a fully_shard "
                        "checkpoint holds tensor optimizer state only (DCP's safetensors format)"
                    )
        sd["optim"] = {"state": state}
    return sd


def _groups_per_rank(ranks: list) -> list:
    """The ranks' records with each rank's optimizer ``param_groups`` kept only where they differ between
    ranks (each rank's optimizer over what it owns, or hyperparameters of its own); where every rank's
    are the same, the manifest's ``optim.param_groups`` (rank 0's) serves all."""
    groups = [r.pop("param_groups") for r in ranks]
    if any(g != groups[0] for g in groups):
        for record, g in zip(ranks, groups):
            record["param_groups"] = g
    return ranks


def _rank_record(state) -> dict:
    """This rank's RNG states and loop state, as JSON (bytes as base64)."""
    tensors, meta = saving._rng_state()
    rng = {k: base64.b64encode(t.contiguous().numpy().tobytes()).decode() for k, t in tensors if k != "rng/numpy"}
    numpy_keys = dict(tensors)["rng/numpy"].tolist()
    return {
        "rng": rng,
        "numpy_keys": numpy_keys,
        "rng_meta": meta,
        "state": None if state is None else saving._loop_state(state),
    }


def _manifest(partial: str, head: dict, ranks: list, world: int) -> dict:
    files = {
        n: {"bytes": os.path.getsize(os.path.join(partial, n))}
        for n in sorted(os.listdir(partial))
        if n.endswith(".safetensors")
    }
    return {
        **manifest_head(),
        "world_size": world,
        "layout": {"kind": KIND, "front_end": "fully_shard"},
        **head,
        "files": files,
        "ranks": ranks,
    }


def load(path: str, model, optimizer, strict: bool, rng: bool, state) -> Loaded:
    """load.py's ``load`` for a fully_shard model: ``dcp.load`` through ``HuggingFaceStorageReader``
    reshards to this job's DTensors (any world size or mesh); returns ``(step, extra)``."""
    group = job_group(model)
    with saving.peer_errors(f"the load of {path}"):
        wait_pending(model, group, "load")
        where, manifest = run_agreed(lambda: _open(path), group)
        loading._same_save(path, where, manifest, group, None)
        msd, osd = run_agreed(lambda: _state_dicts(model, optimizer), group)
        run_agreed(lambda: _check(path, manifest, msd, optimizer, strict, world_of(group)), group)
        run_agreed(lambda: loading._check_state(path, manifest, state, world_of(group)), group)
        sd = run_agreed(lambda: _tensors(msd, osd), group)
        if not strict:
            keys = set(manifest["model"]["keys"])
            sd["model"] = {k: v for k, v in sd["model"].items() if k in keys}
        dcp.load(sd, storage_reader=HuggingFaceStorageReader(where), process_group=group)
    set_model_state_dict(model, sd["model"], options=_options(strict))
    mine = manifest["ranks"][rank_in(group)] if manifest["world_size"] == world_of(group) else None
    if optimizer is not None:
        # the ranks' own groups where they differ (_check made sure the world size is the one saved)
        groups = (
            mine["param_groups"] if mine is not None and "param_groups" in mine else manifest["optim"]["param_groups"]
        )
        set_optimizer_state_dict(model, optimizer, {"state": sd["optim"]["state"], "param_groups": groups})
    if rng and mine is not None:
        _restore_rng(mine)
    for name, obj in (state or {}).items():
        assert mine is not None  # _check_state made sure the world size is the one saved
        obj.load_state_dict(mine["state"][name])  # _check_state made sure the world size is the one saved
    return Loaded(manifest.get("step"), manifest.get("extra"))


def _options(strict: bool) -> StateDictOptions:
    return StateDictOptions(strict=strict)


def _open(path: str) -> tuple[str, dict]:
    where = locate(path)
    manifest = manifest_in(where, path)
    if not is_dcp(manifest):
        raise CheckpointError(
            f"checkpoint {path} was saved from a FullyShardedDataParallel model (flatshard's flat format); "
            "a fully_shard model loads checkpoints saved from fully_shard models. Load it into the wrapper "
            "and save its full state dict, or save the fully_shard model anew"
        )
    return where, manifest


def _check(path: str, manifest: dict, msd: dict, optimizer, strict: bool, world: int) -> None:
    check_names(path, manifest["model"]["keys"], list(msd), strict)
    if optimizer is not None and manifest.get("optim") is None:
        raise CheckpointError(
            f"checkpoint {path} holds no optimizer state; call load without optimizer=, or save with it"
        )
    per_rank = any("param_groups" in r for r in manifest["ranks"])
    if optimizer is not None and per_rank and manifest["world_size"] != world:
        raise CheckpointError(
            f"checkpoint {path} was saved by {manifest['world_size']} ranks whose optimizers' param_groups "
            f"differ between ranks (each rank's own parameters or hyperparameters), so no rank of a job of "
            f"{world} has groups to load; load it at world size {manifest['world_size']}, or load the model "
            "alone (optimizer=None) and build the optimizers anew"
        )


def _restore_rng(mine: dict) -> None:
    tensors = {k: torch.frombuffer(bytearray(base64.b64decode(v)), dtype=torch.uint8) for k, v in mine["rng"].items()}
    tensors["rng/numpy"] = torch.tensor(mine["numpy_keys"], dtype=torch.int64)
    loading._restore_rng(tensors, mine["rng_meta"])


# The modules by name (the package's ``save`` and ``load`` attributes are the functions): save.py's
# ``_reached`` is looked up at each call, so tests and fault injection that patch it stop this save too.
saving = importlib.import_module("flatshard.checkpoint.save")
loading = importlib.import_module("flatshard.checkpoint.load")
