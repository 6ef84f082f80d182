"""Collectives across nodes left in flight while backward goes on ([Note: reductions in flight]).

Four ranks as two "nodes" of two (``ranks_per_node=2``): HYBRID_SHARD's and NO_SHARD's all-reduces
across replicas cross the node boundary and are issued during backward and waited on only at its end;
FULL_SHARD's reduce-scatter spans the nodes and is left in flight for one unit. Each path equals the
single-process reference every step (tests/helpers/cases.py's run_case), and the same bits as with the
setting off. Where nothing crosses a node, nothing is left in flight on CPU."""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F

from tests.helpers.cases import run_case
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

CASES = [  # (model, strategy, optimizer, keywords): each crosses the "nodes" differently
    ("gpt_tie_in_root", "HYBRID_SHARD", "adamw", {"sharding_factor": 2}),  # replicate all-reduce across
    ("frozen_nested_manual", "HYBRID_SHARD", "sgd_momentum", {"sharding_factor": 2}),  # a unit run twice
    ("gpt_tie_across_units", "FULL_SHARD", "sgd_momentum", {}),  # the reduce-scatter spans the nodes
    ("odd_mlp", "NO_SHARD", "adamw", {}),  # the F = 1 all-reduce over all four
]


def parity_worker(rank: int, world: int) -> int:
    for kind, strategy, opt_kind, kw in CASES:
        run_case(rank, world, kind, strategy, opt_kind, ranks_per_node=2, **kw)
    return len(CASES)


def test_in_flight_across_nodes_keeps_parity():
    assert run_distributed(parity_worker, 4, timeout=300) == [len(CASES)] * 4


def _build(strategy: str, **kw):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    return FSDP(
        TinyGPT(layers=3),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({Block}),
        **kw,
    )


def _traced_backward(model, rank: int) -> tuple[list[str], list[torch.Tensor]]:
    """One forward and backward, logging every replicate all-reduce issued and every wait on one."""
    from flatshard.runtime import schedule
    from flatshard.runtime.comm import collectives

    log: list[str] = []
    real_all_reduce, real_end = collectives.all_reduce, schedule.RunContext.end_of_backward

    class Logged:
        def __init__(self, work):
            self.work = work

        def wait(self):
            log.append("wait")
            return self.work.wait()

    def all_reduce(tensor, group, *args, **kwargs):
        result = real_all_reduce(tensor, group, *args, **kwargs)
        log.append("issue async" if result.work is not None else "issue sync")
        return result._replace(work=Logged(result.work)) if result.work is not None else result

    def end_of_backward(ctx):
        log.append("end of backward")
        return real_end(ctx)

    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
    with (
        mock.patch.object(collectives, "all_reduce", all_reduce),
        mock.patch.object(schedule.RunContext, "end_of_backward", end_of_backward),
    ):
        F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    return log, [p.grad.clone() for p in model.parameters()]


def schedule_worker(rank: int, world: int) -> dict:
    from flatshard import testing

    out = {}
    for name, kw in {
        "hybrid, two nodes": {"sharding_factor": 2, "ranks_per_node": 2},
        "hybrid, two nodes, setting off": {"sharding_factor": 2, "ranks_per_node": 2, "inter_node_in_flight": False},
        "hybrid, one node": {"sharding_factor": 2},  # no LOCAL_WORLD_SIZE here: all four on one node
    }.items():
        model = _build("HYBRID_SHARD", **kw)
        log, grads = _traced_backward(model, rank)
        crosses = [u.flat_group.inter_node.replicate_spans for u in testing.engine_units(model)]
        out[name] = (log, grads, crosses)
    return out


def test_replicate_all_reduces_wait_for_the_end_of_backward():
    """Across nodes every unit's all-reduce is issued (asynchronously) before any is waited on, and the
    waits come in the end-of-backward callback; with the setting off, or on one node, each is issued and
    finished in turn, as before. The gradients are the same bits in all three."""
    for out in run_distributed(schedule_worker, 4, timeout=120):
        log, _, crosses = out["hybrid, two nodes"]
        units = len(crosses)
        assert all(crosses), crosses
        assert log == ["issue async"] * units + ["end of backward"] + ["wait"] * units, log
        for name in ("hybrid, two nodes, setting off", "hybrid, one node"):
            log, _, crosses = out[name]
            assert log == ["issue sync"] * units + ["end of backward"], (name, log)
        assert not any(out["hybrid, one node"][2])
        base = out["hybrid, two nodes"][1]
        for name in ("hybrid, two nodes, setting off", "hybrid, one node"):
            assert all(map(torch.equal, out[name][1], base)), name


def memory_worker(rank: int, world: int) -> dict:
    """FULL_SHARD across nodes: the reduce-scatter in flight holds one more full-size gradient (and its
    receive buffers), never more; the hybrid all-reduces in flight hold nothing beyond the grad shards."""
    from flatshard import units

    out = {}
    for name, strategy, kw in [
        ("full, off", "FULL_SHARD", {"ranks_per_node": 2, "inter_node_in_flight": False}),
        ("full, on", "FULL_SHARD", {"ranks_per_node": 2}),
        ("hybrid, off", "HYBRID_SHARD", {"sharding_factor": 2, "ranks_per_node": 2, "inter_node_in_flight": False}),
        ("hybrid, on", "HYBRID_SHARD", {"sharding_factor": 2, "ranks_per_node": 2}),
    ]:
        model = _build(strategy, **kw)
        x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
        with model.record_memory() as mem:
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        out[name] = (mem.peak["gathered"], mem.peak["grads"], [(u.padded_numel, u.shard_numel) for u in units(model)])
    return out


def test_memory_in_flight_is_bounded():
    for out in run_distributed(memory_worker, 4, timeout=120):
        sizes = out["full, on"][2]
        unit_padded, shard = max(p for p, _ in sizes[1:]), max(s for _, s in sizes[1:])
        off, on = out["full, off"][0], out["full, on"][0]
        # one full-size gradient still being reduced, and the n - 2 = 2 receive buffers of its rounds
        assert on - off <= 4 * (unit_padded + 2 * shard), (off, on)
        assert on > off, (off, on)
        assert out["hybrid, on"][:2] == out["hybrid, off"][:2], (out["hybrid, on"], out["hybrid, off"])
