"""Small collectives for state dicts and checkpoints: exchange JSON between ranks, agree on failure.

[Note: equal errors]
A check that fails on one rank only (its shard file is truncated, its state dict misses a key) must
not leave the other ranks waiting in the next collective. Every check that can fail runs to the end
on every rank and yields a message or None; ``agree`` exchanges them and, if any rank failed,
raises the same error (the first failing rank's message, naming that rank) on every rank.
JSON travels as bytes in a uint8 tensor: nothing is pickled, here or on disk.
"""
from __future__ import annotations

import json
from typing import Any, Optional

import torch
import torch.distributed as dist


all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class CheckpointError(RuntimeError):
    """A checkpoint or state dict that cannot be saved or loaded; the message names the file or parameter
    and the fix. Raised alike on every rank."""


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


def gather_json(obj: Any, group=None) -> list[Any]:
    """Every rank's ``obj`` (JSON-serialisable), in rank order, on every rank of ``group``."""
    if world_of(group) == 1:
        return [json.loads(json.dumps(obj))]
    device = collective_device(group)
    data = torch.frombuffer(bytearray(json.dumps(obj).encode()), dtype=torch.uint8).to(device)
    n = world_of(group)
    sizes = torch.zeros(n, dtype=torch.int64, device=device)
    all_gather_single(sizes, torch.tensor([data.numel()], dtype=torch.int64, device=device), group=group)
    longest = int(sizes.max())
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: data.numel()] = data
    out = torch.empty(n * longest, dtype=torch.uint8, device=device)
    all_gather_single(out, padded, group=group)
    out = out.cpu()
    return [json.loads(bytes(out[r * longest : r * longest + int(sizes[r])].numpy()).decode()) for r in range(n)]


def agree(message: Optional[str], group=None, error: type = CheckpointError) -> None:
    """Raise ``error`` on every rank of ``group`` if ``message`` is not None on any of them."""
    messages = gather_json(message, group)
    failed = [(r, m) for r, m in enumerate(messages) if m is not None]
    if not failed:
        return
    rank, first = failed[0]
    others = "" if len(failed) == 1 else f"; {len(failed) - 1} more rank(s) failed too"
    where = f" [rank {rank} of {len(messages)}{others}]" if len(messages) > 1 else ""
    raise error(f"{first}{where}")


def run_agreed(fn, group=None, error: type = CheckpointError):
    """Call ``fn()``; a ``CheckpointError``/``ValueError``/``KeyError``/``OSError`` it raises on any rank is
    raised on every rank (see [Note: equal errors]). Returns what ``fn`` returned."""
    result, message = None, None
    try:
        result = fn()
    except (CheckpointError, ValueError, KeyError, OSError, RuntimeError) as exc:
        message = str(exc) if not isinstance(exc, KeyError) else str(exc.args[0])
    agree(message, group, error)
    return result
