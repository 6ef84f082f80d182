"""The accelerator's stream discipline ([Note: stream discipline], runtime/comm/streams.py), checked on CPU: a
full training step of each front end runs against a recording stand-in for the device's streams, which
logs every event recorded, every wait and every buffer allocated, written, read or freed, on the lane
(compute, gather, reduce) a device would run it on; ``check_schedule`` then checks the happens-before
order: every read of gathered parameters after its gather's event, every reduction after its gradient,
every free after the last use on every stream, allocations and frees on compute only, no wait for an event
never recorded, and prefetches within the limit. Each front end and strategy, both backward prefetches,
forward prefetch, with and without the limiter, mixed precision, the optimizer across replicas. And the
check must fail: the same step with one wait removed (each kind in turn) is caught."""

from __future__ import annotations

import itertools

import torch
import torch.nn.functional as F

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

PER_RANK = 2


def _model(front: str, strategy: str, prefetch: str, limit: bool, mixed: bool, pieces: bool):
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import BackwardPrefetch, MixedPrecision, MixedPrecisionPolicy, ShardingStrategy, fully_shard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = TinyGPT(layers=3)
    if front == "fsdp1":
        kw = {"sharding_factor": 2} if strategy == "HYBRID_SHARD" else {}
        if pieces:
            kw["shard_optimizer_across_replicas"] = True
        return FSDP(
            model,
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            backward_prefetch=BackwardPrefetch[prefetch],
            forward_prefetch=True,
            limit_all_gathers=limit,
            mixed_precision=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if mixed else None,
            **kw,
        )
    mesh = (
        init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if strategy == "HYBRID_SHARD" else None
    )
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if mixed
        else MixedPrecisionPolicy()
    )
    reshard = 2 if strategy == "FULL_SHARD" and mixed else strategy != "SHARD_GRAD_OP"  # 2: a post-forward group
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    blocks = list(model.blocks)
    if prefetch == "explicit":  # explicit prefetch targets, as FSDP2 scripts set them (not rate-limited)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _step(model, opt, rank: int, step: int) -> None:
    x = torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(10 * step + rank))
    F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
    opt.step()
    opt.zero_grad()


def recorded_step(rank: int, case: tuple, streams=None):
    """The log of one full step (forward, backward, optimizer) after a first, unrecorded one."""
    from flatshard.testing import record_streams

    model = _model(*case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank, 0)  # the first step records the forward order prefetch follows
    with record_streams(model, streams) as recording:
        _step(model, opt, rank, 1)
        x = torch.randint(0, 37, (PER_RANK, 8))
        with torch.no_grad():
            model(x)  # the next forward: its gathers read what the optimizer wrote
    return recording.ops


CASES = [
    *[
        ("fsdp1", strategy, prefetch, limit, False, False)
        for strategy, prefetch, limit in itertools.product(
            ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD"), ("BACKWARD_PRE", "BACKWARD_POST"), (True, False)
        )
    ],
    ("fsdp1", "FULL_SHARD", "BACKWARD_PRE", True, True, False),  # mixed precision: the cast source
    ("fsdp1", "HYBRID_SHARD", "BACKWARD_PRE", True, False, True),  # the optimizer across replicas
    *[
        ("fully_shard", s, p, True, False, False)
        for s in ("FULL_SHARD", "SHARD_GRAD_OP", "HYBRID_SHARD")
        for p in ("BACKWARD_PRE", "BACKWARD_POST")
    ],
    ("fully_shard", "FULL_SHARD", "BACKWARD_PRE", True, True, False),  # mixed precision, a post-forward group
]


def schedule_worker(rank: int, world: int) -> list:
    from flatshard.runtime.comm.streams import Lane, check_schedule

    out = []
    for case in CASES:
        ops = recorded_step(rank, case)
        limited = case[3] and case[2] != "explicit"  # explicit targets are the script's choice, as in FSDP2
        problems = check_schedule(ops, max_gathered=2 if limited else None)
        assert not problems, f"{case}: " + "\n".join(problems[:10])
        lanes = {(op.lane, op.kind) for op in ops}
        # the log is a real step's: gathers written on the gather stream, reductions on the reduce stream
        assert {(Lane.GATHER, "write"), (Lane.REDUCE, "write"), (Lane.COMPUTE, "wait")} <= lanes, (case, lanes)
        out.append(sum(op.kind == "wait" for op in ops))
    return out


def test_every_step_keeps_the_stream_discipline():
    counts = run_distributed(schedule_worker, 4, timeout=400)
    assert all(len(c) == len(CASES) and min(c) > 0 for c in counts), counts


class Sabotaged:
    """A recording stand-in that drops the first wait of one kind: ``lane`` waiting for an event of ``on``."""

    def __new__(cls, lane, on):
        from flatshard.runtime.comm.streams import RecordingStreams

        class Streams(RecordingStreams):
            def __init__(self):
                super().__init__()
                self.lane_of: dict = {}
                self.dropped = False

            def record(self, recorded_on):
                event = super().record(recorded_on)
                self.lane_of[event] = recorded_on
                return event

            def wait(self, waiting, event):
                if not self.dropped and waiting is lane and self.lane_of.get(event) is on:
                    self.dropped = True  # this wait is removed from the schedule
                    return
                super().wait(waiting, event)

        return Streams()


def sabotage_worker(rank: int, world: int) -> dict:
    from flatshard.runtime.comm.streams import Lane, check_schedule

    out = {}
    for lane, on in (
        (Lane.COMPUTE, Lane.GATHER),
        (Lane.GATHER, Lane.COMPUTE),
        (Lane.REDUCE, Lane.COMPUTE),
        (Lane.COMPUTE, Lane.REDUCE),
    ):
        for case in (CASES[0], CASES[-1]):
            streams = Sabotaged(lane, on)
            problems = check_schedule(recorded_step(rank, case, streams))
            assert streams.dropped, (lane, on, case)
            out[f"{lane} waiting for {on}, {case[0]}"] = problems[0] if problems else None
    # the limiter removed: SHARD_GRAD_OP keeps its units gathered and forward prefetch gathers one more
    unlimited = ("fsdp1", "SHARD_GRAD_OP", "BACKWARD_PRE", False, False, False)
    problems = check_schedule(recorded_step(rank, unlimited), max_gathered=2)
    out["limit_all_gathers=False"] = next((p for p in problems if "prefetch" in p), None)
    return out


def test_a_schedule_with_one_wait_removed_fails_the_check():
    """Each kind of wait removed once (compute for a gather, the gather stream for compute, the reduce stream
    for the gradient, compute for a reduction), in both front ends: the check names the unordered access;
    and with the limiter off, the check sees the prefetch it would have refused."""
    for out in run_distributed(sabotage_worker, 4, timeout=400):
        missing = [k for k, v in out.items() if v is None]
        assert not missing, f"removed waits the check did not catch: {missing}"
