"""Fault injection for train_gpt.py's restart tests and bench/faults/soak.py: TEST-ONLY machinery.

``--inject-fault ACTION:PHASE:step=N[:rank=R][:attempt=A]`` (repeatable) makes rank R (default 0) of
restart attempt A (default 0; torchrun's ``TORCHELASTIC_RESTART_COUNT``) kill itself with SIGKILL
(ACTION ``kill``) or stop itself with SIGSTOP (``stop``: a hung rank, which torchrun does not see as
dead) at one point of the loop's step N (the step index, 0-based: the step whose batch is drawn from
seed + N). The points (PHASE):

  forward     inside unit blocks.0's forward (the first Block's pre-forward hook, after its gather)
  backward    in the middle of backward: the gradient of blocks.0's output is computed, blocks.0 and
              the root are not yet done
  optimizer   as optimizer.step() begins (gradients reduced and clipped, no parameter changed yet)
  between     after step N and its checkpoint, before step N + 1 begins
  checkpoint  halfway through writing this rank's file of the checkpoint saved after step N
  commit      rank 0 only: that checkpoint's manifest written, not yet renamed into place
  committed   rank 0 only: the checkpoint committed, before the ``latest`` pointer and keep_last
  rotate      rank 0 only: an old checkpoint renamed to NAME.removing by keep_last, not yet deleted

Each fault fires in one attempt only, so the restarted run gets past it. A fault at a step the attempt
never reaches (it resumed after it) never fires; faults of attempts 0, 1, 2, ... at increasing steps
fire one per attempt.
"""

from __future__ import annotations

import importlib
import os
import signal
from dataclasses import dataclass
from typing import Optional

# the module (``flatshard.checkpoint.save`` the attribute is the function)
checkpoint_save = importlib.import_module("flatshard.checkpoint.save")

PHASES = ("forward", "backward", "optimizer", "between", "checkpoint", "commit", "committed", "rotate")
CHECKPOINT_STAGES = {
    "writing": "checkpoint",
    "before_commit": "commit",
    "after_commit": "committed",
    "removing": "rotate",
}
RANK0_ONLY = ("commit", "committed", "rotate")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP}


@dataclass(frozen=True)
class Fault:
    action: str
    phase: str
    step: int
    rank: int = 0
    attempt: int = 0

    def __str__(self) -> str:
        return f"{self.action}:{self.phase}:step={self.step}:rank={self.rank}:attempt={self.attempt}"


def parse(spec: str) -> Fault:
    """One ``--inject-fault`` value; raises ValueError saying what is wrong."""
    parts = spec.split(":")
    form = "ACTION:PHASE:step=N[:rank=R][:attempt=A], e.g. kill:backward:step=7:rank=1"
    if len(parts) < 3:
        raise ValueError(f"--inject-fault {spec!r}: expected {form}")
    action, phase, fields = parts[0], parts[1], {}
    if action not in SIGNALS:
        raise ValueError(f"--inject-fault {spec!r}: ACTION must be one of {', '.join(SIGNALS)}, got {action!r}")
    if phase not in PHASES:
        raise ValueError(f"--inject-fault {spec!r}: PHASE must be one of {', '.join(PHASES)}, got {phase!r}")
    for part in parts[2:]:
        key, _, value = part.partition("=")
        if key not in ("step", "rank", "attempt") or not value.isdigit():
            raise ValueError(f"--inject-fault {spec!r}: {part!r} is not step=N, rank=R or attempt=A (N, R, A >= 0)")
        fields[key] = int(value)
    if "step" not in fields:
        raise ValueError(f"--inject-fault {spec!r}: step=N is required ({form})")
    fault = Fault(action, phase, **fields)
    if phase in RANK0_ONLY and fault.rank != 0:
        raise ValueError(f"--inject-fault {spec!r}: only rank 0 commits, renames and rotates: use rank=0")
    return fault


def problem(faults: list[Fault], world: int, steps: int, save_every: int) -> Optional[str]:
    """What makes these faults impossible to reach in this run, or None."""
    for f in faults:
        if f.rank >= world:
            return f"--inject-fault {f}: rank {f.rank} does not exist with {world} ranks"
        if f.step >= steps:
            return f"--inject-fault {f}: step {f.step} is not run (--steps {steps} runs steps 0..{steps - 1})"
        saves = save_every and ((f.step + 1) % save_every == 0 or f.step == steps - 1)
        if f.phase in CHECKPOINT_STAGES.values() and not saves:
            return f"--inject-fault {f}: no checkpoint is saved after step {f.step} (--save-every {save_every})"
    return None


class Injector:
    """This rank's faults of this attempt, fired at their points of the loop."""

    def __init__(self, faults: list[Fault], rank: int, attempt: int):
        self.faults = [f for f in faults if f.rank == rank and f.attempt == attempt]
        self.step: Optional[int] = None  # the loop's step while it runs one, else None
        self.optimizer_hooked = False

    def install(self, block, optimizer) -> None:
        """Hooks for the points inside forward, backward and the optimizer step; ``block`` is the module
        whose forward the forward and backward points are in."""
        if not self.faults:
            return
        block.register_forward_pre_hook(lambda *_: self.point("forward"))

        def after_forward(*hook_args):
            out = hook_args[-1]
            if self._due("backward") is not None and out.requires_grad:
                out.register_hook(lambda *_: self.point("backward"))

        block.register_forward_hook(after_forward)
        if hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(lambda *_: self.point("optimizer"))
            self.optimizer_hooked = True
        if any(f.phase in CHECKPOINT_STAGES.values() for f in self.faults):
            # flatshard.checkpoint's test hook: it is called as a save passes each stage
            checkpoint_save._reached = lambda stage: self.point(CHECKPOINT_STAGES.get(stage, stage))

    def before_optimizer_step(self) -> None:
        """The optimizer point, for an optimizer without step hooks (called just before its step)."""
        if not self.optimizer_hooked:
            self.point("optimizer")

    def _due(self, phase: str) -> Optional[Fault]:
        return next((f for f in self.faults if f.phase == phase and f.step == self.step), None)

    def point(self, phase: str) -> None:
        fault = self._due(phase)
        if fault is None:
            return
        print(
            f"inject-fault: {fault.action} rank {fault.rank} in {phase} at step {fault.step} (attempt {fault.attempt})",
            flush=True,
        )
        os.kill(os.getpid(), SIGNALS[fault.action])
