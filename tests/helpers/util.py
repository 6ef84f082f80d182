"""Helpers shared by the tests: building a wrapped model next to its unwrapped reference, and
matching each shard view with the slice of the reference parameter it must equal."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
from torch import nn


def pairs(model: nn.Module, ref: nn.Module):
    """(name, local tensor, matching reference tensor) for every parameter, and the same for grads."""
    from flatshard.testing import shard_ranges

    ranges = shard_ranges(model)
    refp = dict(ref.named_parameters())
    names = [n for n, _ in model.named_parameters()]
    assert names == list(refp), f"names differ from the unwrapped model:\n{names}\n{list(refp)}"
    for name, p in model.named_parameters():
        full = refp[name]
        if id(p) in ranges:
            a, b = ranges[id(p)]
            ref_val = full.detach().reshape(-1)[a:b].view(p.shape)  # a shard view: 1-D, or rows of the parameter
            ref_grad = None if full.grad is None else full.grad.reshape(-1)[a:b].view(p.shape)
        else:
            ref_val, ref_grad = full.detach(), full.grad
        yield name, p, ref_val, ref_grad


# torch.testing.assert_close's default (rtol, atol) by dtype
_DEFAULT_TOLERANCES = {
    torch.float16: (1e-3, 1e-5),
    torch.bfloat16: (1.6e-2, 1e-5),
    torch.float32: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
}


def assert_all_close(checks: list, **tol) -> None:
    """``torch.testing.assert_close(actual, expected, msg=msg, **tol)`` for every (actual, expected, msg) of
    ``checks``, in one comparison when they share a floating dtype and each pair its shape (the same
    elementwise test, ``|actual - expected| <= atol + rtol * |expected|``, NaN never close): one
    ``isclose`` over all of them instead of one ``assert_close`` per tensor. When any element is not
    close, or the tensors differ in kind, each pair goes through ``assert_close``, so a failure reads
    as it always did."""
    dtypes = {a.dtype for a, _, _ in checks}
    same_kind = len(dtypes) == 1 and dtypes <= _DEFAULT_TOLERANCES.keys() and set(tol) in (set(), {"rtol", "atol"})
    same_kind = same_kind and all(
        e.dtype == a.dtype and e.shape == a.shape and a.layout == e.layout == torch.strided and a.device == e.device
        for a, e, _ in checks
    )
    if same_kind and len({a.device for a, _, _ in checks}) == 1:
        rtol, atol = (tol["rtol"], tol["atol"]) if tol else _DEFAULT_TOLERANCES[dtypes.pop()]
        actual = torch.cat([a.detach().reshape(-1) for a, _, _ in checks])
        expected = torch.cat([e.detach().reshape(-1) for _, e, _ in checks])
        if bool(torch.isclose(actual, expected, rtol=rtol, atol=atol).all()):
            return
    for actual, expected, msg in checks:
        torch.testing.assert_close(actual, expected, msg=msg, **tol)


def assert_params_match(model, ref, what: str, **tol) -> None:
    checks = [
        (p.detach(), ref_val, lambda m, name=name: f"{what}: parameter {name}: {m}")
        for name, p, ref_val, _ in pairs(model, ref)
    ]
    assert_all_close(checks, **tol)


def assert_grads_match(model, ref, what: str, **tol) -> None:
    checks = []
    for name, p, _, ref_grad in pairs(model, ref):
        if ref_grad is None or not p.requires_grad:
            assert p.grad is None, f"{what}: {name} has a gradient but the reference has none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        checks.append((p.grad, ref_grad, lambda m, name=name: f"{what}: gradient of {name}: {m}"))
    assert_all_close(checks, **tol)


@contextlib.contextmanager
def captured_logs(level: int = logging.WARNING) -> Iterator[list[logging.LogRecord]]:
    """The records the ``flatshard`` logger emits inside the block; handler and level restored after."""
    logger = logging.getLogger("flatshard")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    before = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield records
    finally:
        logger.removeHandler(handler)
        logger.setLevel(before)
