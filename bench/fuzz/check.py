"""Comparisons of the fuzzer (bench/fuzz/): which slice of a reference tensor a rank's parameter holds,
and the first mismatch a rank sees.

[Note: fuzz tolerances]
* fp32 against the single-process reference: ``torch.testing.assert_close``'s defaults (rtol 1.3e-6,
  atol 1e-5), as the suite's parity tests.
* bf16 parameters (mixed precision) against the fp32 reference ("loose"): the two runs round differently
  by design, so a check is tensor-wise, ``max|got - want| <= atol + rtol * scale``, rtol = 5e-2. A bf16
  number carries 8 significant bits (relative rounding 2^-9 = 2e-3); every Linear rounds its input, its
  weight and its output, and a gradient passes through some ten such roundings in these models, so 5e-2
  is about 25 roundings' worth. What a rounding error is relative to decides the scale:
  - a gradient: the largest element of any reference gradient of that step. Backward's rounding errors
    follow the magnitudes flowing through it, not the result: a bias or a 1-element gain sums many terms
    that cancel, and its error relative to its own (small) gradient was measured at 17x 5e-2 where
    PyTorch's FSDP2 errs alike; relative to the model's largest gradient it stays below 0.5x;
  - a loss: max(|loss|, 1 / accum): the outputs and targets are of order 1 (unit-variance targets, a
    cross-entropy of order log V), each micro-batch's loss divided by accum; a small MSE is not more exact;
  - a parameter: fp32 masters, so only the updates differ. SGD's update is the momentum buffer, at most
    1/(1 - 0.9) = 10 gradients, so its error grows by lr * 10 * 5e-2 * max|g| a step. Adam's update
    m/sqrt(v) is +-1 where the gradient's sign is certain and flips where it is not (a near-zero element):
    with the bias corrections |m/sqrt(v)| <= 1.011 for the first five steps (Cauchy-Schwarz; these runs
    take at most four), so one step moves an element by up to 2.02 lr either way; 3 lr a step
    (``Checker.param_atol``).
  Measured over 400 mixed-precision configurations the closest approach was 0.89 of these bounds, apart
  from the steps after a backward that raised, before that bug was fixed (17x).
* flatshard's ``fully_shard`` against PyTorch's FSDP2: bitwise where every reduction is in fp32 and sums at
  most two addends (every mesh dimension of size <= 2: a + b does not depend on the order), as
  tests/test_fully_shard.py asserts at W = 2 and on a 2x2 mesh, with bf16 parameters too (bf16 gradients
  sum exactly in fp32 there); fp32's defaults for fp32 reductions of 3 or 4 addends (another order rounds
  the last bit); and with a bf16 reduce dtype ("tight") the loose checks at rtol 2^-5: the reduction
  rounds each partial sum of the ranks' local gradients, which may be several times the averaged one, to
  8 bits (a few ulps of the largest gradient; measured 1.3 x 2^-7 at W = 3).
"""

from __future__ import annotations

import math
from typing import Optional

import torch

EXACT = "exact"
DEFAULT = "default"
LOOSE_RTOL = 5e-2
TIGHT_RTOL = 2.0**-5  # eight bf16 rounding steps of the largest gradient


def local_of(full: torch.Tensor, param, ranges: dict) -> torch.Tensor:
    """The part of the reference tensor ``full`` that this rank's parameter ``param`` holds."""
    from torch.distributed.tensor import DTensor, Shard

    if isinstance(param, DTensor):
        from torch.distributed.tensor.placement_types import _StridedShard

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
        self.param_atol = {"loose": 0.0, "tight": 0.0}  # grows with the steps ([Note: fuzz tolerances])
        self.grad_scale = 0.0  # the step's largest reference gradient element
        self.loss_floor = 1.0  # 1 / the micro-batches per step: each micro-batch's loss is divided by it
        self.bitwise = {"steps": 0, "equal": 0, "held": 0}  # steps compared with FSDP2; equal; held to equal
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
        for mode, rtol in (("loose", LOOSE_RTOL), ("tight", TIGHT_RTOL)):
            self.param_atol[mode] += self.lr * (3.0 if self.optim_kind != "sgd" else 10 * rtol * grad_max)

    def check(self, step: int, what: str, name: str, got, want, mode: str = DEFAULT, against: str = "reference"):
        """``mode``: EXACT (bitwise), DEFAULT (assert_close's fp32 defaults), or "loose" / "tight" (mixed
        precision, against the fp32 reference / PyTorch's FSDP2: [Note: fuzz tolerances])."""
        self.compared += 1
        got = local_tensor(got).detach() if torch.is_tensor(got) else torch.tensor(got)
        want = local_tensor(want).detach() if torch.is_tensor(want) else torch.tensor(want)
        problem = self._problem(got, want, mode, what)
        if problem is not None:
            self.fail(step, what, name, against, _max_diff(got, want), problem)

    def _problem(self, got: torch.Tensor, want: torch.Tensor, mode: str, what: str) -> Optional[str]:
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
        rtol = TIGHT_RTOL if mode == "tight" else LOOSE_RTOL
        if what.startswith("param"):  # fp32 masters: only the updates differ
            atol, rtol, scale, of = 1e-5 + self.param_atol[mode], 0.0, 0.0, "the updates so far"
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
