"""A training loop that resumes by itself: from the newest complete checkpoint in a directory, with its
step, RNG states and the loop's own state, saving every N steps and keeping the last k.

    ckpt = checkpoint.Checkpointer("ckpt", model, opt, every=100, keep_last=3, state={"loader": loader})
    start = ckpt.resume()                   # 0 when "ckpt" holds no complete checkpoint yet
    for step in range(start, steps):
        ...one step on the batch of step `step`...
        ckpt.step_done(step + 1, final=step + 1 == steps)

Under ``torchrun --max-restarts=K`` every attempt runs the same script: the first starts at 0, each
restart at the newest checkpoint committed before a rank died ([Note: crash-safe commit]).

The loop's own state.
What a resumed run needs, besides the model and the optimizer, to go on bitwise as the uninterrupted
run went: the step; every rank's RNG states (torch, CUDA, numpy, Python's ``random``: ``save`` writes
them into each rank's file and ``load`` restores them when the world size is the one saved); and
whatever decides the next batches. A loader that is a function of (seed, step) needs nothing more.
A loader with a position of its own (an epoch and a batch index, a shuffled order's cursor, a stream's
offset) passes an object with ``state_dict()`` returning JSON and ``load_state_dict(d)`` in
``state={name: obj}`` -- so can an LR scheduler. Each rank's objects are saved in that rank's file
(the file's metadata, as JSON: no pickle) and given back to the same rank on load, so per-rank
positions are kept; they need the world size saved (a rank of another world size has no state of its
own there), and a load at another world size with ``state=`` is an error on every rank that says so.
``state_dict()`` is called when the save begins: an object whose state changes later in the step
(a prefetching iterator that has already drawn the next batch) must report the position of the next
batch the loop will use.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Optional

from flatshard.api import CheckpointError
from flatshard.checkpoint import dtensors
from flatshard.checkpoint.directory import latest, read_manifest, step_path
from flatshard.checkpoint.front import load, save
from flatshard.checkpoint.save import AsyncSave
from flatshard.runtime.comm.agree import gather_json, world_of
from flatshard.state.model_view import holds_dtensors, model_view

logger = logging.getLogger("flatshard")


class Checkpointer:
    """Resume from the newest complete checkpoint under ``directory`` and save one there every
    ``every`` steps (``directory/step-00000100``, ...), keeping the ``keep_last`` newest.

    ``state``: the loop's own state, ``{name: obj}`` with ``obj.state_dict()`` (JSON) and
    ``obj.load_state_dict(d)``, saved and restored per rank (above: "The loop's own state").
    ``async_save``: each save writes in the background (``checkpoint.save``'s); ``wait()`` before exit.
    Every method is collective over the model's ranks."""

    def __init__(
        self,
        directory,
        model,
        optimizer=None,
        *,
        every: int,
        keep_last: Optional[int] = 3,
        state: Optional[dict] = None,
        async_save: bool = False,
    ):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"every must be a positive int (save every that many steps), got {every!r}")
        if keep_last is not None and (isinstance(keep_last, bool) or not isinstance(keep_last, int) or keep_last < 1):
            raise ValueError(f"keep_last must be a positive int or None (keep every checkpoint), got {keep_last!r}")
        self.directory = os.fspath(directory)
        self.model, self.optimizer, self.state = model, optimizer, state
        self.every, self.keep_last, self.async_save = every, keep_last, async_save
        self.resumed_from: Optional[str] = None  # the checkpoint resume() loaded, or None
        self.extra: Any = None  # its extra
        self._pending: Optional[AsyncSave] = None

    def resume(self, path=None) -> int:
        """Load the newest complete checkpoint under the directory (or ``path``) into the model, the
        optimizer, this rank's RNG states and ``state``; return its step, the first step to run. With
        none there yet, load nothing and return 0."""
        if holds_dtensors(self.model):  # fully_shard: [Note: a fully_shard checkpoint waits as long as the model does]
            group, record = dtensors.job_group(self.model), None
        else:
            view = model_view(self.model)
            group, record = view.group, view.record
        found = os.fspath(path) if path is not None else latest(self.directory)
        seen = gather_json(found, group, record)  # every rank must resume from the same one
        if any(s != seen[0] for s in seen):
            listed = "; ".join(f"rank {r}: {s}" for r, s in enumerate(seen))
            raise CheckpointError(
                f"the ranks found different newest checkpoints under {self.directory} ({listed}): every rank "
                "must see the same directory (a shared file system), or pass resume(path)"
            )
        if found is None:
            return 0
        saved_world = read_manifest(found).get("world_size")
        if saved_world != world_of(group):
            logger.warning(
                "flatshard checkpoint: %s was saved by %s ranks, this job has %d: the RNG states are not "
                "restored, so the run does not go on bitwise as it would have at %s ranks",
                found,
                saved_world,
                world_of(group),
                saved_world,
            )
        step, self.extra = load(found, self.model, self.optimizer, state=self.state)
        if not isinstance(step, int):
            raise CheckpointError(f"checkpoint {found} holds no step (saved with step={step!r}); pass step= to save")
        self.resumed_from = found
        return step

    def step_done(self, step: int, extra: Any = None, *, final: bool = False) -> Optional[str]:
        """Tell the checkpointer that ``step`` steps are done; it saves when ``step`` is a multiple of
        ``every``, or ``final``. Returns the path saved to, or None."""
        if not final and step % self.every:
            return None
        return self.save(step, extra)

    def save(self, step: int, extra: Any = None) -> str:
        """Save now, as checkpoint ``step`` (the number of steps done)."""
        path = step_path(self.directory, step)
        self.wait()
        self._pending = save(
            path,
            self.model,
            self.optimizer,
            step=step,
            extra=extra,
            async_save=self.async_save,
            keep_last=self.keep_last,
            state=self.state,
        )
        return path

    def wait(self) -> None:
        """Wait for an asynchronous save in flight (raises its error)."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.wait()
