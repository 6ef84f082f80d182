"""PyTorch's FSDP2, built the way the benchmark compares it with flatshard.

flatshard implements FSDP and never imports PyTorch's inside its package; the benchmark
(``python -m bench.compare``) and the GPU check import this module, as they import examples/gpt.py.
"""

from __future__ import annotations

import torch
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def build(gpt, cfg, bf16: bool) -> torch.nn.Module:
    """``fully_shard`` on each Block, then on the root: the same units as flatshard's."""
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    )
    return build_from(gpt.GPT(cfg), mp)


def build_from(model: torch.nn.Module, mp: MixedPrecisionPolicy | None = None) -> torch.nn.Module:
    """``fully_shard`` on each of ``model.blocks``, then on ``model``."""
    mp = mp or MixedPrecisionPolicy()
    for block in model.blocks:
        fully_shard(block, mp_policy=mp)
    return fully_shard(model, mp_policy=mp)
