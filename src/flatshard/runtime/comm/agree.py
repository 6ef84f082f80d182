"""Small collectives for checks that must end alike on every rank: exchange JSON, agree on failure.

[Note: equal errors]
A check that fails on one rank only (its shard file is truncated, its state dict misses a key, its
model differs) must not leave the other ranks waiting in the next collective. Every check that can
fail runs to the end on every rank and yields a message or None; ``agree`` exchanges them and, if any
rank failed, raises the same error (the first failing rank's message, naming that rank) on every
rank. JSON travels as bytes in a uint8 tensor: nothing is pickled, here or on disk.

Every exchange goes through comm/collectives.py; a caller that wants it recorded passes ``record``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist

from flatshard.api import CheckpointError
from flatshard.runtime.comm import collectives

Record = Optional[Callable[[collectives.CollectiveResult], None]]


def collective_device(group) -> torch.device:
    """Where tensors for collectives on ``group`` must live (NCCL: the current GPU; gloo: CPU)."""
    backend = dist.get_backend(group)
    if "nccl" in str(backend) and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def world_of(group) -> int:
    if not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def rank_in(group) -> int:
    return dist.get_rank(group) if world_of(group) > 1 else 0


def _group(group):
    return group if group is not None else dist.group.WORLD


def all_gather_padded(local: torch.Tensor, group, record: Record = None) -> torch.Tensor:
    """Every rank's 1-D ``local`` (all the same length) concatenated in rank order."""
    n = world_of(group)
    out = torch.empty(n * local.numel(), dtype=local.dtype, device=local.device)
    result = collectives.all_gather(out, local.contiguous(), _group(group))
    if record is not None:
        record(result)
    return out


def gather_json(obj: Any, group=None, record: Record = None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order, on every rank of ``group``."""
    if world_of(group) == 1:
        return [json.loads(json.dumps(obj))]
    device = collective_device(group)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = world_of(group)
    sizes = all_gather_padded(torch.tensor([data.numel()], dtype=torch.int64, device=device), group, record)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = all_gather_padded(padded, group, record).cpu()
    return [json.loads(bytes(out[r * longest : r * longest + int(sizes[r])].numpy()).decode()) for r in range(n)]


def agree(message: Optional[str], group=None, error: type[Exception] = CheckpointError, record: Record = None) -> None:
    """Raise ``error`` on every rank of ``group`` if ``message`` is not None on any of them."""
    messages = gather_json(message, group, record)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    rank, first = failed[0]
    others = "" if len(failed) == 1 else f"; {len(failed) - 1} more rank(s) failed too"
    where = f" [rank {rank} of {len(messages)}{others}]" if len(messages) > 1 else ""
    raise error(f"{first}{where}")


def run_agreed(fn: Callable[[], Any], group=None, error: type[Exception] = CheckpointError, record: Record = None):
    """Call ``fn()``; a ``CheckpointError``, ``ValueError``, ``KeyError``, ``OSError`` or ``RuntimeError``
    it raises on any rank is raised as ``error`` on every rank ([Note: equal errors]), chained to the
    original exception on the rank where it happened. Returns what ``fn`` returned."""
    result, message, failure = None, None, None
    try:
        result = fn()
    except (CheckpointError, ValueError, KeyError, OSError, RuntimeError) as exc:
        message = str(exc) if not isinstance(exc, KeyError) else str(exc.args[0])
        failure = exc
    try:
        agree(message, group, error, record)
    except error as agreed:
        if failure is not None:
            raise agreed from failure
        raise
    return result
