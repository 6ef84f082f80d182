"""``checkpoint.save`` and ``checkpoint.load``: by the model, flatshard's flat format (a
FullyShardedDataParallel model: save.py, load.py) or DCP's safetensors shards (a fully_shard model,
whose parameters are DTensors: dtensors.py, [Note: fully_shard checkpoints are DCP safetensors]).
The same directory rules hold for both ([Note: crash-safe commit], [Note: latest and rotation])."""

from __future__ import annotations

import importlib
import os
from typing import Any, Optional

from flatshard.checkpoint import dtensors
from flatshard.checkpoint.load import Loaded
from flatshard.checkpoint.save import AsyncSave
from flatshard.state.model_view import holds_dtensors

flat_save = importlib.import_module("flatshard.checkpoint.save")
flat_load = importlib.import_module("flatshard.checkpoint.load")


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
    """Save ``model`` (and ``optimizer``'s state, ``step``, JSON ``extra``, every rank's RNG states and
    ``state``, the loop's own) to the directory ``path``, crash-safely. Collective. save.py's ``save``
    says the rest; a fully_shard model is written in DCP's safetensors format (dtensors.py)."""
    if holds_dtensors(model):
        return dtensors.save(
            os.path.abspath(os.fspath(path)), model, optimizer, step, extra, async_save, keep_last, state
        )
    return flat_save.save(path, model, optimizer, step, extra, async_save, keep_last=keep_last, state=state)


def load(path, model, optimizer=None, *, strict: bool = True, rng: bool = True, state=None) -> Loaded:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``), at any world size.
    Collective. Returns ``(step, extra)``. load.py's ``load`` says the rest."""
    if holds_dtensors(model):
        return dtensors.load(os.path.abspath(os.fspath(path)), model, optimizer, strict, rng, state)
    return flat_load.load(path, model, optimizer, strict=strict, rng=rng, state=state)
