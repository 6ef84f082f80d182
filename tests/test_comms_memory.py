"""Collectives counted per phase and bytes per rank against the formulas; memory per rank against 16·P/N.

Per rank and step, with P the padded element count of all units, b bytes per element, N ranks:
FULL_SHARD moves 3·P·b·(N−1)/N less the root unit's backward all-gather (the root stays gathered
from forward to backward); SHARD_GRAD_OP and NO_SHARD move 2·P·b·(N−1)/N. Steady state (after the
optimizer step) holds parameters + gradients + AdamW state = 16·P/N bytes, plus padding and AdamW's
4-byte step counter per parameter."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from flatshard.testing import DistCounts, count_dist_calls
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

B = 4  # bytes per fp32 element


def _model(strategy: str, **kw):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    return FSDP(
        TinyGPT(), sharding_strategy=ShardingStrategy[strategy], auto_wrap_policy=ModuleWrapPolicy({Block}), **kw
    )


def _step(model, opt, world: int, seed: int) -> DistCounts:
    """One training step; returns what torch.distributed communicated inside ``opt.step()``."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randint(0, 37, (2, 8), generator=g), torch.randint(0, 37, (2, 8), generator=g)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    with count_dist_calls() as in_step:
        opt.step()
    opt.zero_grad()
    return in_step


def comms_worker(rank: int, world: int) -> dict:
    from flatshard import units as unit_infos

    seen = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        model = _model(strategy)
        units = unit_infos(model)
        M, root = len(units), units[0]
        assert root.is_root and root.name == "<root>"
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        _step(model, opt, world, 0)  # the first step may differ (lazy init); count the second and third
        with model.record_comms(events=True) as rec:
            in_steps = [_step(model, opt, world, s) for s in (1, 2)]
        n, steps = world, 2
        padded = sum(u.padded_numel for u in units)
        if strategy == "FULL_SHARD" and n > 1:
            assert rec.count("all_gather", "forward") == steps * M
            assert rec.count("all_gather", "backward") == steps * (M - 1)
            assert rec.count("reduce_scatter", "backward") == steps * M
            expected = 3 * padded * B * (n - 1) / n - root.padded_numel * B * (n - 1) / n
        elif strategy == "SHARD_GRAD_OP" and n > 1:
            assert rec.count("all_gather", "forward") == steps * M
            assert rec.count("all_gather", "backward") == 0
            assert rec.count("reduce_scatter", "backward") == steps * M
            expected = 2 * padded * B * (n - 1) / n
        else:  # NO_SHARD, or any strategy at N = 1: nothing to gather
            assert rec.count("all_gather") == 0 and rec.count("reduce_scatter") == 0
            assert rec.count("all_reduce", "backward", "replicate") == (steps * M if n > 1 else 0)
            expected = 2 * padded * B * (n - 1) / n
        # counted at torch.distributed, not by flatshard's own recorder, which sees only flatshard's collectives
        assert not any(in_steps), f"optimizer.step() must not communicate: {in_steps}"
        total = rec.wire_bytes() / steps
        assert abs(total - expected) < 1e-6 * max(expected, 1), (strategy, total, expected)
        if strategy != "NO_SHARD" and n > 1:  # each collective moves exactly one unit's shard

            def per_unit(us):
                return sorted(float((n - 1) * u.shard_numel * B) for u in us for _ in range(steps))

            def events(kind, phase):
                return sorted(e.wire_bytes for e in rec.events if e.kind == kind and e.phase == phase)

            assert events("reduce_scatter", "backward") == per_unit(units)
            assert events("all_gather", "forward") == per_unit(units)
            if strategy == "FULL_SHARD":
                assert events("all_gather", "backward") == per_unit([u for u in units if u is not root])
        seen[strategy] = (rec.count(), total, expected)
    return seen


def test_collective_counts_and_bytes_match_formulas():
    for world in (2, 3):
        results = run_distributed(comms_worker, world, timeout=200)
        assert all(r == results[0] for r in results), "every rank moves the same bytes"


def sabotage_worker(rank: int, world: int) -> dict:
    """count_dist_calls can fail: communication placed inside optimizer.step() is seen, however it is issued
    (a step pre-hook that all-reduces; a ProcessGroup method called directly; a barrier from another
    thread), and a step with none is empty."""
    import threading

    import torch.distributed as dist

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    out = {}
    sabotage = {
        "none": lambda: None,
        "all_reduce": lambda: dist.all_reduce(torch.ones(2)),
        "process group": lambda: dist.group.WORLD.allreduce([torch.ones(2)]).wait(),
        "other thread": lambda: (t := threading.Thread(target=dist.barrier), t.start(), t.join()),
    }
    for what, fn in sabotage.items():

        def communicate(*_, fn=fn) -> None:
            fn()

        hook = opt.register_step_pre_hook(communicate)
        with count_dist_calls() as seen:
            opt.step()
        hook.remove()
        out[what] = (dict(seen.calls), dict(seen.ops))
    return out


def test_the_optimizer_step_counter_sees_communication_from_anyone():
    for out in run_distributed(sabotage_worker, 2):
        assert out["none"] == ({}, {})
        assert out["all_reduce"] == ({"all_reduce": 1}, {"c10d.allreduce_": 1})
        assert out["process group"] == ({}, {"c10d.allreduce_": 1})
        assert out["other thread"][0] == {"barrier": 1}


def memory_worker(rank: int, world: int) -> dict:
    from flatshard import testing
    from flatshard import units as unit_infos

    out = {}
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"):
        model = _model(strategy, backward_prefetch=None)  # no prefetch: one unit gathered at a time
        units = unit_infos(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        # after forward: FULL_SHARD frees every unit but the root; SHARD_GRAD_OP keeps every unit
        g = torch.Generator().manual_seed(0)
        x, y = torch.randint(0, 37, (2, 8), generator=g), torch.randint(0, 37, (2, 8), generator=g)
        with model.record_memory(opt) as mem:
            loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
            held = testing.gathered_bytes(model)
            full = [u.padded_numel * B for u in units]
            if world > 1 and strategy == "FULL_SHARD":
                assert held == [full[0]] + [0] * (len(units) - 1), held
            elif world > 1 and strategy == "SHARD_GRAD_OP":
                assert held == full, held
            loss.backward()
            if world > 1 and strategy != "NO_SHARD":  # NO_SHARD's unsharded flat is the flat shard itself
                held = testing.gathered_bytes(model)
                assert held == [0] * len(units), f"{strategy}: resharded after backward: {held}"
            opt.step()
            mem.sample()
        now = model.memory_bytes(opt)
        S = sum(u.shard_numel for u in units)
        n_params = sum(len(u.param_names) for u in units)
        local_elems = sum(u.local_numel for u in units)
        assert local_elems == sum(p.numel() for p in model.parameters())
        assert now["params"] == 4 * S and now["grads"] == 4 * S, now
        assert now["optimizer"] == 8 * local_elems + 4 * n_params, now  # exp_avg, exp_avg_sq, step
        assert now["gathered"] == 0 or world == 1, now
        P = sum(u.numel for u in units)
        steady = now["params"] + now["grads"] + now["optimizer"]
        padding = sum(u.padding for u in units)
        f = 1 if strategy == "NO_SHARD" else world  # the sharding factor
        assert 16 * P / f <= steady <= 16 * (P + padding) / f + 4 * n_params, (strategy, steady, 16 * P / f)
        if world > 1:
            gathered_all = sum(full)
            if strategy == "FULL_SHARD":
                # at most the root and one other unit, each with its full-size gradient, at any time
                assert mem.peak["gathered"] <= 2 * full[0] + 2 * max(full[1:]), (mem.peak, full)
            if strategy == "SHARD_GRAD_OP":
                assert mem.peak["gathered"] >= gathered_all
        out[strategy] = (steady, P)
    return out


def test_memory_per_rank_is_16P_over_N():
    for world in (1, 2, 4):
        results = run_distributed(memory_worker, world, timeout=200)
        for strategy, (steady, P) in results[0].items():
            f = 1 if strategy == "NO_SHARD" else world
            # within padding and AdamW's step counters (a few hundred bytes here) of 16·P/F
            assert abs(steady - 16 * P / f) < 0.05 * 16 * P / f, (world, strategy, steady, 16 * P / f)
