"""FSDP2's reduction settings on ``fully_shard`` against PyTorch's FSDP2 on the same script: the same
TinyGPT (odd shapes: 37 rows of the tied embedding pad at W = 2 and 3), the same batches, SGD-momentum,
compared after every step (loss, every rank's local gradient before the step, local shard after it).

* ``set_force_sum_reduction_for_comms(True)`` on every module, alone and with torchtitan's
  ``set_gradient_divide_factor(1.0)`` (which PyTorch's FSDP2 cannot run on gloo without it), at W = 2 and
  W = 3; with ``set_all_reduce_hook`` the hook sees the sum (force-sum) or the mean (default) as FSDP2's.

Bitwise: at W = 2 (sums of two numbers, and divisions by two, round alike).
At W = 3 within PyTorch's default fp32 tolerance: gloo's reduce-scatter and flatshard's exchange add the
three ranks' gradients in different orders, so no step is bitwise there.
"""

from __future__ import annotations

import torch

from tests.helpers.cases import fsdp2_pair, token_loss
from tests.helpers.dist import run_distributed

STEPS, PER_RANK = 2, 2


def _fsdp_modules(model):
    import torch.distributed.fsdp as torch_fsdp

    return [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)]


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor.detach().clone()


def _step(model, opt, rank: int, step: int, micros: int, before_micro) -> tuple[float, list, list]:
    """One optimizer step over ``micros`` micro-batches (``before_micro(model, i)`` first); returns the loss,
    the local gradients before the step and the local shards after it."""
    total = 0.0
    for i in range(micros):
        before_micro(model, i)
        loss = token_loss(model, _batch(rank, step, i)) / micros
        loss.backward()
        total += loss.item()
    grads = [_local(p.grad) for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return total, grads, [_local(p) for p in model.parameters()]


def _compare(pair, rank: int, what: str, *, micros: int = 1, before_micro=lambda m, i: None) -> int:
    """Train FSDP2's model and flatshard's side by side for STEPS steps; each step within fp32's default
    tolerance (loss, gradients, shards); returns how many steps were equal to the bit."""
    theirs, ours = pair
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in pair]
    bitwise = 0
    for step in range(STEPS):
        a = _step(theirs, opts[0], rank, step, micros, before_micro)
        b = _step(ours, opts[1], rank, step, micros, before_micro)
        loss_a, loss_b = (torch.tensor(x[0], dtype=torch.float32) for x in (a, b))  # fp32's tolerance
        torch.testing.assert_close(loss_b, loss_a, msg=lambda m: f"{what} step {step}: loss {m}")
        for kind, i in (("gradient", 1), ("parameter", 2)):
            for x, y in zip(a[i], b[i]):
                torch.testing.assert_close(y, x, msg=lambda m: f"{what} step {step}: {kind} {m}")
        bitwise += a[0] == b[0] and all(torch.equal(x, y) for i in (1, 2) for x, y in zip(a[i], b[i]))
    return bitwise


def _hooked(pair, add: float) -> tuple[list, list]:
    """Set on every module of both models a hook that records what it is given and adds ``add`` to it (so
    the gradients show whether it ran before or after the division)."""
    seen: tuple[list, list] = ([], [])
    for model, record in zip(pair, seen):

        def hook(t: torch.Tensor, record=record) -> None:
            record.append(t.detach().clone())
            t.add_(add)

        for m in _fsdp_modules(model):
            m.set_all_reduce_hook(hook)
    return seen


def _same_tensors(a: list, b: list) -> tuple[bool, bool]:
    """(within fp32's default tolerance, equal to the bit) for two lists of tensors."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False, False
    close = all(torch.allclose(y, x, rtol=1.3e-6, atol=1e-5) for x, y in zip(a, b))
    return close, all(map(torch.equal, a, b))


# ---- set_force_sum_reduction_for_comms ---------------------------------------------------------------
def force_sum_worker(rank: int, world: int) -> dict:
    out: dict = {}
    for name, factor in (("force sum", None), ("force sum, divide factor 1", 1.0)):
        pair = fsdp2_pair()
        for model in pair:
            for m in _fsdp_modules(model):
                m.set_force_sum_reduction_for_comms(True)
                if factor is not None:
                    m.set_gradient_divide_factor(factor)
        out[name] = _compare(pair, rank, name)
    for force in (False, True):  # the hook sees the mean, or (force-sum) the sum, as FSDP2's does
        pair = fsdp2_pair()
        seen = _hooked(pair, add=0.25)
        for model in pair:
            for m in _fsdp_modules(model):
                m.set_force_sum_reduction_for_comms(force)
        name = f"hook, force sum {force}"
        out[name] = _compare(pair, rank, name)
        out[f"{name}: what it saw (close, bitwise)"] = _same_tensors(*seen)
        out[f"{name}: calls"] = len(seen[1])
    return out


def _check_force_sum(world: int) -> None:
    for out in run_distributed(force_sum_worker, world, timeout=240):
        for force in (False, True):
            assert out[f"hook, force sum {force}: calls"] == STEPS * 3, out  # once per unit (root, 2 blocks) a step
            close, bitwise = out[f"hook, force sum {force}: what it saw (close, bitwise)"]
            assert close and (bitwise or world == 3), out
        if world == 2:  # sums of two, divisions by two: every step to the bit
            steps = [
                out[k]
                for k in ("force sum", "force sum, divide factor 1", *(f"hook, force sum {f}" for f in (False, True)))
            ]
            assert steps == [STEPS] * 4, out


def test_force_sum_reduction_matches_fsdp2_at_2_ranks():
    _check_force_sum(2)


def test_force_sum_reduction_matches_fsdp2_at_3_ranks():
    _check_force_sum(3)
