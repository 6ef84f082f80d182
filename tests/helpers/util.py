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


def assert_params_match(model, ref, what: str, **tol) -> None:
    for name, p, ref_val, _ in pairs(model, ref):
        torch.testing.assert_close(p.detach(), ref_val, msg=lambda m: f"{what}: parameter {name}: {m}", **tol)


def assert_grads_match(model, ref, what: str, **tol) -> None:
    for name, p, _, ref_grad in pairs(model, ref):
        if ref_grad is None or not p.requires_grad:
            assert p.grad is None, f"{what}: {name} has a gradient but the reference has none"
            continue
        assert p.grad is not None, f"{what}: {name} has no gradient"
        torch.testing.assert_close(p.grad, ref_grad, msg=lambda m: f"{what}: gradient of {name}: {m}", **tol)


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
