"""What runs in every rank of ``make cluster`` (started by ``python -m bench.cluster`` inside the namespaces).

    torchrun --nnodes=N --nproc-per-node=P ... -m bench.cluster.worker --out RESULT.json [--steps 8 ...]

Two parts, one job:

1. The calibration (bench/cluster/calibrate.py, [Note: cluster calibration]): the links per class and
   the collectives of one unit; compute comes from the no-communication system of part 2.
2. The systems, interleaved as bench/compare.py interleaves them (its helpers: the same GPT, batches,
   builders and result gathering): flatshard FULL_SHARD, HYBRID_SHARD (F = P, the shard groups are the
   nodes), SHARD_GRAD_OP and NO_SHARD; DDP; PyTorch FSDP2 FULL_SHARD and HSDP (a (N, P) mesh); and a
   run with no communication at all (a plain model per rank, the same per-rank batch: the compute
   floor). A step's time is the slowest rank's; the figure is the median over the measured steps.
   Around every step, local rank 0 of each node reads its link interface's byte counters, so the bytes
   that really crossed the slow link are known per system.

``--set link`` (bench/cluster/slow_link.py) measures instead, with no calibration, the engine's settings for
the slow link side by side: each flatshard strategy whose collectives cross the nodes with
``inter_node_in_flight`` off (every reduction finished before the next unit computes), on (the
default) and with ``compress_inter_node="int8"`` as well; DDP, FSDP2 HSDP and no communication.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_api as fsdp_api

import flatshard
from bench import compare
from bench.cluster import calibrate
from flatshard.runtime.comm import gloo_exchange

LINK_STATS = Path("/sys/class/net/fs0/statistics")
FLOOR = "no communication"
P2P_TAG = 7919  # the custom collectives' tag: FSDP2 issues them one at a time


# ---- the systems --------------------------------------------------------------------------------------
def build_hsdp(cfg, nodes: int, nproc: int, **kw):
    """PyTorch FSDP2's HSDP: ``fully_shard`` over a (replicate = nodes, shard = ranks per node) mesh, FSDP2's
    defaults unless ``kw`` says otherwise (``reshard_after_forward``)."""
    gpt = compare.load_gpt_module()
    mesh = init_device_mesh("cpu", (nodes, nproc), mesh_dim_names=("replicate", "shard"))
    model = gpt.GPT(cfg)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def build_hsdp_torchtitan(cfg, nodes: int, nproc: int):
    """FSDP2's HSDP wrapped as torchtitan wraps a model with tied weights (torchtitan/distributed/fsdp.py,
    ``reshard_after_forward_policy="default"`` without pipelining): the embeddings, final norm and head in
    one group left gathered after forward (backward needs them first), every block resharded after
    forward, then the root."""
    gpt = compare.load_gpt_module()
    mesh = init_device_mesh("cpu", (nodes, nproc), mesh_dim_names=("replicate", "shard"))
    model = gpt.GPT(cfg)
    fully_shard([model.wte, model.wpe, model.ln_f, model.head], mesh=mesh, reshard_after_forward=False)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, reshard_after_forward=True)
    return fully_shard(model, mesh=mesh)


class _P2PAllGather(fsdp_api.AllGather):
    """FSDP2's all-gather as flatshard issues it on gloo: one round of point-to-point sends (analysis only:
    how much of FSDP2's step on gloo is gloo's own collectives)."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        n = dist.get_world_size(group)
        return gloo_exchange.all_gather(output_tensor, input_tensor, group, n, P2P_TAG, async_op)


class _P2PReduceScatter(fsdp_api.ReduceScatter):
    """FSDP2's reduce-scatter as flatshard issues it on gloo: n - 1 rounds of point-to-point exchanges."""

    def allocate(self, size, *, dtype, device):
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        if op not in (dist.ReduceOp.SUM, dist.ReduceOp.AVG) or async_op:
            raise ValueError(f"the point-to-point reduce-scatter sums or averages, synchronously; FSDP2 asked for {op}")
        n = dist.get_world_size(group)
        gloo_exchange.reduce_scatter(output_tensor, input_tensor, group, n, P2P_TAG, False)
        if op == dist.ReduceOp.AVG:
            output_tensor.div_(n)


def build_hsdp_prefetch(cfg, nodes: int, nproc: int):
    """FSDP2's HSDP (defaults) with explicit prefetching, one block ahead in forward and in backward
    (``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``)."""
    model = build_hsdp(cfg, nodes, nproc)
    blocks = list(model.blocks)
    for i, block in enumerate(blocks):
        if i + 1 < len(blocks):
            block.set_modules_to_forward_prefetch([blocks[i + 1]])
        if i > 0:
            block.set_modules_to_backward_prefetch([blocks[i - 1]])
    return model


def build_hsdp_p2p(cfg, nodes: int, nproc: int):
    """FSDP2's HSDP (defaults) with its all-gathers and reduce-scatters replaced by flatshard's gloo
    exchanges (``set_custom_all_gather`` / ``set_custom_reduce_scatter``): not a configuration a user
    runs, the measure of what gloo's own collectives cost FSDP2."""
    model = build_hsdp(cfg, nodes, nproc)
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_custom_all_gather(_P2PAllGather())
            module.set_custom_reduce_scatter(_P2PReduceScatter())
    return model


def builders(gpt, cfg, nodes: int, nproc: int) -> dict:
    """name -> a function building that system (each called after the same seed)."""
    fs = compare.build_flatshard
    return {
        "flatshard FULL_SHARD": lambda: fs(gpt, cfg, False, "FULL_SHARD"),
        f"flatshard HYBRID_SHARD F={nproc}": lambda: fs(gpt, cfg, False, "HYBRID_SHARD", sharding_factor=nproc),
        "flatshard SHARD_GRAD_OP": lambda: fs(gpt, cfg, False, "SHARD_GRAD_OP"),
        "flatshard NO_SHARD": lambda: fs(gpt, cfg, False, "NO_SHARD"),
        "DDP": lambda: compare.build_ddp(gpt, cfg),
        "FSDP2 FULL_SHARD": lambda: compare.build_fsdp2(gpt, cfg, False),
        f"FSDP2 HSDP ({nodes}x{nproc})": lambda: build_hsdp(cfg, nodes, nproc),
        FLOOR: lambda: gpt.GPT(cfg),
    }


@dataclasses.dataclass
class ComputeFloor(compare.System):
    """The system with no communication, its step timed in two parts: forward + backward, then the
    optimizer. Interleaved with the others, it is the compute calibration ([Note: cluster calibration])."""

    parts: list = dataclasses.field(default_factory=list)  # (forward + backward s, optimizer s) per step

    def step(self, x, y) -> torch.Tensor:
        t0 = time.perf_counter()
        loss = F.cross_entropy(self.model(x).flatten(0, 1), y.flatten())
        loss.backward()
        t1 = time.perf_counter()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.parts.append((t1 - t0, time.perf_counter() - t1))
        return loss.detach()


def link_builders(gpt, cfg, nodes: int, nproc: int) -> dict:
    """``--set link``: flatshard's slow-link settings, before (in flight off) and after, and int8."""
    fs = compare.build_flatshard
    out = {}
    for strategy, kw, variants in [
        (f"HYBRID_SHARD F={nproc}", {"sharding_factor": nproc}, ("off", "on", "int8", "pieces")),
        (f"_HYBRID_SHARD_ZERO2 F={nproc}", {"sharding_factor": nproc}, ("on", "int8")),  # no gathers in backward
        ("FULL_SHARD", {}, ("off", "on", "int8")),
        ("NO_SHARD", {}, ("off", "on")),  # int8 over all W ranks sends more than hybrid's: not run
    ]:
        name, base = f"flatshard {strategy}", strategy.split()[0]
        settings = {
            "off": (f"{name}, in flight off", {"inter_node_in_flight": False}),
            "on": (name, {}),
            "int8": (f"{name}, int8", {"compress_inter_node": "int8"}),
            "pieces": (f"{name}, {PIECES}", {"shard_optimizer_across_replicas": True}),
        }
        for variant in variants:
            label, extra = settings[variant]
            out[label] = lambda b=base, kw={**kw, **extra}: fs(gpt, cfg, False, b, **kw)
    out["DDP"] = lambda: compare.build_ddp(gpt, cfg)
    out[f"FSDP2 HSDP ({nodes}x{nproc})"] = lambda: build_hsdp(cfg, nodes, nproc)
    out[FLOOR] = lambda: gpt.GPT(cfg)
    return out


def hsdp_builders(gpt, cfg, nodes: int, nproc: int) -> dict:
    """``--set hsdp``: FSDP2's HSDP as a user would configure it, its variants, and flatshard's hybrid."""
    fs = compare.build_flatshard
    return {
        f"flatshard HYBRID_SHARD F={nproc}": lambda: fs(gpt, cfg, False, "HYBRID_SHARD", sharding_factor=nproc),
        f"flatshard _HYBRID_SHARD_ZERO2 F={nproc}": lambda: fs(
            gpt, cfg, False, "_HYBRID_SHARD_ZERO2", sharding_factor=nproc
        ),
        f"FSDP2 HSDP ({nodes}x{nproc})": lambda: build_hsdp(cfg, nodes, nproc),
        f"FSDP2 HSDP ({nodes}x{nproc}), torchtitan's wrapping": lambda: build_hsdp_torchtitan(cfg, nodes, nproc),
        f"FSDP2 HSDP ({nodes}x{nproc}), reshard_after_forward=False": lambda: build_hsdp(
            cfg, nodes, nproc, reshard_after_forward=False
        ),
        f"FSDP2 HSDP ({nodes}x{nproc}), explicit prefetch": lambda: build_hsdp_prefetch(cfg, nodes, nproc),
        f"FSDP2 HSDP ({nodes}x{nproc}), point-to-point gloo collectives": lambda: build_hsdp_p2p(cfg, nodes, nproc),
        "FSDP2 FULL_SHARD": lambda: compare.build_fsdp2(gpt, cfg, False),
        FLOOR: lambda: gpt.GPT(cfg),
    }


SETS = {"strategies": builders, "link": link_builders, "hsdp": hsdp_builders}
PIECES = "optimizer across replicas"  # shard_optimizer_across_replicas=True (runtime/across_replicas.py)


def make_systems(
    gpt, cfg, nodes: int, nproc: int, seed: int, only: list[str] | None, which: str = "strategies"
) -> list[compare.System]:
    """The systems (those named in ``only``, and always the compute floor), each from the same seed."""
    systems = []
    for name, build in SETS[which](gpt, cfg, nodes, nproc).items():
        floor = name == FLOOR
        if only and not floor and not any(o in name for o in only):
            continue
        torch.manual_seed(seed)
        model = build()
        kind = ComputeFloor if floor else compare.System
        systems.append(kind(name, model, torch.optim.AdamW(model.parameters(), lr=1e-3)))
    return systems


def compute_figures(systems, warmup: int) -> dict:
    """Median over measured steps of the slowest rank's forward + backward and optimizer step (the floor)."""
    floor = next(s for s in systems if isinstance(s, ComputeFloor))
    fwd_bwd = calibrate.slowest([a for a, _ in floor.parts[warmup:]])
    opt = calibrate.slowest([b for _, b in floor.parts[warmup:]])
    return {
        "forward_backward_s": statistics.median(fwd_bwd),
        "optimizer_step_s": statistics.median(opt),
        "source": f"the '{FLOOR}' system, interleaved with the others",
    }


def _link_counter(local_rank: int) -> int:
    """Bytes this node's link interface has sent so far (read by local rank 0; 0 elsewhere or off-cluster)."""
    if local_rank != 0 or not LINK_STATS.exists():
        return 0
    return int((LINK_STATS / "tx_bytes").read_text())


def run_systems(systems, data_batches, warmup: int, local_rank: int) -> dict[str, list[int]]:
    """Interleaved steps (the order rotated every step), each between barriers; link bytes per step."""
    link = {s.name: [] for s in systems}
    for i, (x, y) in enumerate(data_batches):
        k = i % len(systems)
        for system in systems[k:] + systems[:k]:
            dist.barrier()
            before = _link_counter(local_rank)
            t0 = time.perf_counter()
            system.losses.append(system.step(x, y))
            elapsed = time.perf_counter() - t0
            dist.barrier()
            if i >= warmup:
                system.times.append(elapsed)
                link[system.name].append(_link_counter(local_rank) - before)
    return link


def gather_link_bytes(link: dict[str, list[int]], nproc: int) -> dict[str, list[float]]:
    """Per system, the median bytes per step each node's link sent (from every node's local rank 0)."""
    world = dist.get_world_size()
    out = {}
    for name, values in link.items():
        mine = torch.tensor([statistics.median(values) if values else 0.0], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        out[name] = [every[r].item() for r in range(0, world, nproc)]
    return out


def shard_groups(systems) -> dict[str, list[int]]:
    """This rank's shard group per flatshard system (which ranks share its parameters)."""
    return {s.name: list(flatshard.units(s.model)[0].shard_group_ranks) for s in systems if "flatshard" in s.name}


# ---- the job -------------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.cluster.worker", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True, help="where rank 0 writes the JSON")
    p.add_argument("--size", default="3M", choices=["tiny", "3M", "30M"], help="bench/compare.py's GPT sizes")
    p.add_argument("--steps", type=int, default=8, help="measured steps per system")
    p.add_argument("--warmup", type=int, default=2, help="steps per system run first and discarded")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--systems", nargs="*", help="only the systems whose names contain one of these")
    p.add_argument(
        "--set",
        default="strategies",
        choices=sorted(SETS),
        help="link: bench/cluster/slow_link.py's systems; hsdp: FSDP2 HSDP's configurations",
    )
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    nproc, local_rank = int(os.environ["LOCAL_WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    nodes = world // nproc
    gpt, cfg = compare.load_gpt_module(), compare.sizes()[args.size]
    data = compare.load_corpus()
    steps = args.warmup + args.steps
    data_batches = compare.batches(data, steps, args.batch_size, cfg.block_size, rank, world, args.seed)

    started = time.perf_counter()
    calibration = {}
    if args.set == "strategies":
        calibration["links"] = calibrate.calibrate_links(nodes, nproc)
        unit = sum(p.numel() for p in gpt.Block(cfg).parameters())
        calibration["collectives"] = {
            "unit_numel": unit,
            "seconds": calibrate.calibrate_collectives(unit, nodes, nproc),
        }
    calibration["seconds"] = time.perf_counter() - started

    systems = make_systems(gpt, cfg, nodes, nproc, args.seed, args.systems, args.set)
    link = run_systems(systems, data_batches, args.warmup, local_rank)
    calibration["compute"] = compute_figures(systems, args.warmup)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    result = compare.gather_results(systems, n_params, world)
    result["link_tx_bytes_per_step_per_node"] = gather_link_bytes(link, nproc)
    groups = shard_groups(systems)
    every_groups = [None] * world
    dist.all_gather_object(every_groups, groups)
    if rank == 0:
        result.update(
            size=args.size,
            batch_size=args.batch_size,
            block_size=cfg.block_size,
            steps=args.steps,
            warmup=args.warmup,
            nodes=nodes,
            nproc=nproc,
            calibration=calibration,
            shard_groups_per_rank=every_groups,
        )
        args.out.write_text(json.dumps(result))
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    gc.collect()  # the models and their gloo groups go now, not in finalization ([Note: process groups at exit])
    sys.exit(code)
