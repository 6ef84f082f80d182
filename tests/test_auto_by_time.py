"""FullyShardedDataParallel(sharding_factor="auto", link_figures=...): the engine hands the planner the
links, the ranks per node it resolves and the collectives it runs (gloo on CPU: the direct exchange), and
takes the planner's choice by time; link_figures without "auto", or of the wrong type, is an error."""

from __future__ import annotations

import torch

import flatshard
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT


def _gpt():
    torch.manual_seed(0)
    return TinyGPT(vocab=61, dim=24, heads=2, layers=3, block=8)


def auto_by_time_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.planner import Links, PlanInputs, choose_sharding_factor
    from flatshard.wrap import ModuleWrapPolicy

    links = Links(intra_bandwidth=1e9, inter_bandwidth=12e6, intra_latency_s=4e-4, inter_latency_s=4e-4)
    policy = ModuleWrapPolicy({Block})
    model = FSDP(
        _gpt(),
        auto_wrap_policy=policy,
        sharding_factor="auto",
        memory_budget=10**9,
        link_figures=links,
        ranks_per_node=1,
    )
    out = {"shard_size": flatshard.units(model)[0].shard_size, "decision": model.sharding_decision}
    inputs = PlanInputs.from_module(
        _gpt(), [Block], world, gpus_per_node=1, headroom=0.0, device_memory_bytes=10**9, links=links
    )
    out["planned"] = choose_sharding_factor(inputs.replace(exchange="direct"), by_time=True)
    for name, kw in (
        ("without_auto", dict(sharding_factor=2, link_figures=links)),
        ("wrong_type", dict(sharding_factor="auto", memory_budget=10**9, link_figures={"inter_bandwidth": 1e9})),
    ):
        try:
            FSDP(_gpt(), auto_wrap_policy=policy, **kw)
            out[name] = "no error"
        except (ValueError, TypeError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def test_auto_chooses_by_time_with_link_figures():
    results = run_distributed(auto_by_time_worker, 2, timeout=120)
    for out in results:
        f, why = out["decision"]
        assert (f, why) == tuple(out["planned"]) and out["shard_size"] == f
        assert "predicted" in why and "per step" in why and "direct all-gathers" in why, why
        assert "nodes of 1 ranks" in why and "compute not known" in why, why
        assert out["without_auto"].startswith("ValueError: link_figures is read only with"), out["without_auto"]
        assert out["wrong_type"].startswith("TypeError: link_figures must be a flatshard.planner.Links")
