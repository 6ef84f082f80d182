"""CPUOffload(offload_params=True): flat shards, gradient shards and optimizer state in CPU memory.

This machine has no accelerator, so the offload path runs here with CPU as the compute device
(``flatshard.testing.offload_on_cpu()``): the flat shards are then separate tensors, copied before every
gather and copied back after every reduction, exactly as with a CUDA compute device, where they are
also pinned. Results must be bitwise those of the same run without offload, at F = W and at F = 1
(where without offload the flat shard is used in place). bench/gpu/check.sh checks the CUDA case."""

from __future__ import annotations

import torch
import torch.nn.functional as F_

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT


def offload_worker(rank: int, world: int) -> dict:
    from flatshard import CPUOffload, ShardingStrategy, testing
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    out = {}
    for strategy in ("FULL_SHARD", "NO_SHARD"):
        runs = {}
        for offload in (False, True):
            torch.manual_seed(0)
            with testing.offload_on_cpu():
                model = FSDP(
                    TinyGPT(vocab=37, dim=20, heads=2, layers=2, block=8),
                    auto_wrap_policy=ModuleWrapPolicy({Block}),
                    sharding_strategy=ShardingStrategy[strategy],
                    cpu_offload=CPUOffload(offload_params=offload),
                )
            units = testing.engine_units(model)
            if offload:  # the shard is its own tensor, never the memory the unit computes with
                assert all(u.flat_group.offload and not u.flat_group.storage.aliased for u in units)
                assert all(
                    u.flat_group.flat_shard.untyped_storage().data_ptr()
                    != u.flat_group.unsharded.untyped_storage().data_ptr()
                    for u in units
                )
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            g = torch.Generator().manual_seed(rank)
            losses = []
            for _ in range(3):
                x = torch.randint(0, 37, (2, 8), generator=g)
                loss = F_.cross_entropy(model(x).flatten(0, 1), x.flatten())
                loss.backward()
                norm = model.clip_grad_norm_(0.5)
                opt.step()
                opt.zero_grad()
                losses.append((loss.item(), norm.item()))
            state = {k: v.clone() for k, v in model.state_dict().items()}
            runs[offload] = (losses, [p.detach().clone() for p in model.parameters()], state)
        (l0, p0, s0), (l1, p1, s1) = runs[False], runs[True]
        assert l0 == l1, (strategy, l0, l1)
        assert all(map(torch.equal, p0, p1)), strategy
        assert s0.keys() == s1.keys() and all(torch.equal(s0[k], s1[k]) for k in s0), strategy
        out[strategy] = [norm for _, norm in l1]
    return out


def test_offload_path_matches_the_run_without_offload_bitwise():
    results = run_distributed(offload_worker, 2, timeout=120)
    assert results[0] == results[1]  # the global gradient norm, the same on every rank
