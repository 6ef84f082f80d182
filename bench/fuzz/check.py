"""Comparisons of the fuzzer (bench/fuzz/): which slice of a reference tensor a rank's parameter holds,
and the first mismatch a rank sees.

[Note: fuzz tolerances]
* against the single-process reference: ``torch.testing.assert_close``'s fp32 defaults (rtol 1.3e-6,
  atol 1e-5), as the suite's parity tests, for every configuration: with bf16 parameters the reference
  performs the ranks' casts and reduces in their order ([Note: a reference that rounds as the ranks do],
  reference.py), so that it differs from them by no more than an fp32 run does. No tolerance grows with
  the steps there.
* flatshard's ``fully_shard`` against PyTorch's FSDP2: bitwise where every reduction is in fp32 and sums at
  most two addends (every mesh dimension of size <= 2: a + b does not depend on the order), as
  tests/test_fully_shard.py asserts at W = 2 and on a 2x2 mesh, with bf16 parameters too (bf16 gradients
  sum exactly in fp32 there), except a fused optimizer under ``shard_optimizer_across_replicas`` (its kernel
  steps 1/W of each tensor where FSDP2's steps 1/F, and the vectorised body and the scalar tail round
  apart: fp32's defaults); fp32's defaults for fp32 reductions of 3 or 4 addends (another order rounds
  the last bit). With a bf16 reduce dtype ("tight") PyTorch's FSDP2 sums in gloo's order, flatshard in its
  own, each partial sum rounded to 8 bits: a gradient is held to 2^-5 of the step's largest reference
  gradient (a few ulps of it; measured 1.3 x 2^-7 at W = 3), a loss to 2^-5 of max(|loss|, 1/accum), and a
  parameter (fp32 masters, only the updates differ) to 3 lr per step so far: Adam's |m/sqrt(v)| <= 1.011
  for the first five steps (Cauchy-Schwarz; these runs take at most four), so an update moves an element
  by up to 2.02 lr either way, whatever the rounding of its gradient; SGD's by lr * 10 gradients'
  rounding. This is the one tolerance that grows with the steps, and only against FSDP2: the same
  configurations are held to fp32's defaults against the reference.
* "N of M steps bitwise equal to FSDP2" counts a step when, on every rank, every loss, gradient (and
  gradient norm) and parameter compared with FSDP2 in it was bitwise equal (``Checker.equal_now``).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

EXACT = "exact"
DEFAULT = "default"
TIGHT_RTOL = 2.0**-5  # eight bf16 rounding steps of the largest gradient


def local_of(full: torch.Tensor, param, ranges: dict) -> torch.Tensor:
    """The part of the reference tensor ``full`` that this rank's parameter ``param`` holds."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor):
        from torch.distributed.tensor.placement_types import _StridedShard

        if param.device_mesh.get_coordinate() is None:  # a mesh without this rank (a whole parameter's owner's)
            return full.new_empty(param.to_local().shape)

        out = full
        order = list(enumerate(param.placements))
        if any(isinstance(p, _StridedShard) for p in param.placements):
            order.reverse()  # FSDP over TP: the TP split (the last mesh dim) first, then the strided DP one
        for dim, placement in order:
            if isinstance(placement, (Shard, _StridedShard)):  # in torch 2.13 not a Shard subclass
                chunks = torch.chunk(out, param.device_mesh.size(dim), dim=placement.dim)
                index = param.device_mesh.get_local_rank(dim)
                out = chunks[index] if index < len(chunks) else out.narrow(placement.dim, 0, 0)
        return out
    if id(param) in ranges:
        a, b = ranges[id(param)]
        return full.reshape(-1)[a:b].view(param.shape)
    return full


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's values of ``t`` as a plain tensor (a DTensor's local tensor; a parameter that gathers
    itself, bench/fuzz/gathers.py, as its data)."""
    from torch.distributed.tensor import DTensor

    from bench.fuzz.gathers import plain

    return plain(t.to_local() if isinstance(t, DTensor) else t)


class Checker:
    """Compares, records the first mismatch against each side (and keeps going, so that every rank runs
    every collective)."""

    def __init__(self, mixed: bool, optim_kind: str, lr: float):
        self.mixed, self.optim_kind, self.lr = mixed, optim_kind, lr
        self.firsts: dict[str, dict] = {}  # against ("reference", "fsdp2") -> the first mismatch
        self.compared = 0
        self.param_atol = 0.0  # against FSDP2 with a bf16 reduce dtype, grows with the steps ([Note: fuzz tolerances])
        self.grad_scale = 0.0  # the step's largest reference gradient element
        self.loss_floor = 1.0  # 1 / the micro-batches per step: each micro-batch's loss is divided by it
        self.equal_now = True  # this step's comparisons with FSDP2 all bitwise equal so far
        self.bitwise_steps: list[bool] = []  # per step compared with FSDP2: was every comparison bitwise equal
        self.margins: dict[str, float] = {}  # mode -> the largest diff / bound seen (1 is the tolerance)

    @property
    def first(self) -> Optional[dict]:
        return min(self.firsts.values(), key=lambda m: m["order"], default=None)

    def fail(self, step: int, what: str, name: str, against: str, diff: float, detail: str) -> None:
        if against not in self.firsts:
            order = len(self.firsts)
            self.firsts[against] = {
                "step": step, "what": what, "name": name, "against": against, "max_abs_diff": diff,
                "detail": detail, "order": order,
            }  # fmt: skip

    def advance_param_tolerance(self, grad_max: float) -> None:
        """After an optimizer step whose reference gradients were at most ``grad_max`` in magnitude."""
        self.param_atol += self.lr * (3.0 if self.optim_kind != "sgd" else 10 * TIGHT_RTOL * grad_max)

    def check(self, step: int, what: str, name: str, got, want, mode: str = DEFAULT, against: str = "reference"):
        """``mode``: EXACT (bitwise), DEFAULT (assert_close's fp32 defaults), or "tight" (a bf16 reduce dtype,
        against PyTorch's FSDP2: [Note: fuzz tolerances])."""
        self.compared += 1
        got = local_tensor(got).detach() if torch.is_tensor(got) else torch.tensor(got)
        want = local_tensor(want).detach() if torch.is_tensor(want) else torch.tensor(want)
        problem = self._problem(got, want, mode, what)
        if against == "fsdp2":
            empty = got.numel() == 0 and want.numel() == 0
            self.equal_now = self.equal_now and (empty or (got.shape == want.shape and torch.equal(got, want)))
        if problem is not None:
            self.fail(step, what, name, against, _max_diff(got, want), problem)

    def _problem(self, got: torch.Tensor, want: torch.Tensor, mode: str, what: str) -> Optional[str]:
        if got.numel() == 0 and want.numel() == 0:  # nothing held here (a whole parameter's non-owner)
            return None
        if got.shape != want.shape:
            return f"shape {tuple(got.shape)} != {tuple(want.shape)}"
        if mode == EXACT:
            return None if torch.equal(got, want) else "not bitwise equal"
        got, want = got.float(), want.float()
        if mode == DEFAULT:
            try:
                torch.testing.assert_close(got, want)
            except AssertionError as exc:
                return str(exc).splitlines()[0]
            return None
        rtol = TIGHT_RTOL
        if what.startswith("param"):  # fp32 masters: only the updates differ
            atol, rtol, scale, of = 1e-5 + self.param_atol, 0.0, 0.0, "the updates so far"
        elif what == "grad":  # rounding follows the magnitudes flowing through backward, not one result
            atol, scale, of = 1e-5, self.grad_scale, "max|reference gradient| of the model"
        elif what == "loss":  # rounding follows the outputs and targets, of order 1, not the loss
            atol, scale, of = 1e-5, max(abs(want.item()), self.loss_floor), "max(|loss|, 1/accum)"
        else:
            atol, scale, of = 1e-5, want.abs().max().item() if want.numel() else 0.0, "max|want|"
        bound = atol + rtol * scale
        diff = _max_diff(got, want)
        key = f"{mode} {what.split(' ')[0]}"
        self.margins[key] = max(self.margins.get(key, 0.0), diff / bound)
        if not math.isfinite(diff) or diff > bound:
            return f"max abs diff {diff:.3g} > {bound:.3g} (atol {atol:.3g} + {rtol:.3g} * {of} {scale:.3g})"
        return None


def _max_diff(got: torch.Tensor, want: torch.Tensor) -> float:
    if got.shape != want.shape or got.numel() == 0:
        return 0.0 if got.shape == want.shape else float("nan")
    return (got.float() - want.float()).abs().max().item()
