"""``python -m bench.moe``: the MoE transformer of tests/helpers/moe.py (EP 2 x expert-FSDP 2, the dense
parameters over all 4 ranks, gloo on CPU) trained by flatshard's ``fully_shard`` and PyTorch's FSDP2 in one
run, their steps interleaved (one of each per round, the order alternating), and the bytes each holds per
rank (parameter shards, gradients, AdamW state). Prints the ratios and writes bench/results/moe.json."""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from bench import provenance

WORLD, VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, LAYERS, BATCH, SEQ = 4, 512, 128, 256, 8, 2, 4, 4, 64


def _held_bytes(model, opt) -> int:
    """This rank's parameter shards, gradients and optimizer state, in bytes."""
    total = 0
    for p in model.parameters():
        for t in (p, p.grad):
            if t is not None:
                total += t.to_local().nelement() * t.element_size()
        for s in opt.state.get(p, {}).values():
            if torch.is_tensor(s):
                local = s.to_local() if hasattr(s, "to_local") else s
                total += local.nelement() * local.element_size()
    return total


def _rank(rank: int, store_path: str, rounds: int, out_path: str) -> None:
    import torch.distributed.fsdp as torch_fsdp

    import flatshard
    from tests.helpers import moe

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=WORLD)
    torch.set_num_threads(1)
    dp, efsdp, ep_group = moe.meshes(WORLD, 2)
    models = {}
    for name, shard in (("flatshard", flatshard.fully_shard), ("fsdp2", torch_fsdp.fully_shard)):
        model = moe.build(VOCAB, DIM, HIDDEN, EXPERTS, TOP_K, LAYERS, ep_group)
        moe.shard(model, shard, dp, efsdp, EXPERTS, 2)
        models[name] = (model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    times: dict[str, list[float]] = {name: [] for name in models}
    for r in range(rounds + 1):  # round 0 warms up
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(r * WORLD + rank))
        for name in list(models)[:: 1 if r % 2 else -1]:
            model, opt = models[name]
            dist.barrier()
            start = time.perf_counter()
            F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            dist.barrier()
            if r:
                times[name].append(time.perf_counter() - start)
    held = {name: _held_bytes(m, o) for name, (m, o) in models.items()}
    gathered: list = [None] * WORLD
    dist.all_gather_object(gathered, {"times": times, "held": held})
    if rank == 0:
        Path(out_path).write_text(json.dumps(gathered))
    dist.destroy_process_group()


def write_results(path: Path, report: dict) -> None:
    """The one place bench/results/moe.json is written."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(provenance.stamp(report), indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "moe.json"))
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw.json")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args.rounds, raw), nprocs=WORLD)
        ranks = json.loads(Path(raw).read_text())
    median = {
        n: statistics.median(max(r["times"][n][i] for r in ranks) for i in range(args.rounds))
        for n in ranks[0]["times"]
    }
    report = {
        "model": {"vocab": VOCAB, "dim": DIM, "hidden": HIDDEN, "experts": EXPERTS, "top_k": TOP_K, "layers": LAYERS},
        "world": WORLD,
        "layout": "EP 2 x expert-FSDP 2; dense FSDP over 4; gloo, CPU, 1 thread per rank",
        "rounds": args.rounds,
        "step_s_median": median,
        "step_ratio_flatshard_over_fsdp2": median["flatshard"] / median["fsdp2"],
        "held_bytes_per_rank": [r["held"] for r in ranks],
    }
    write_results(Path(args.out), report)
    print(
        f"MoE step (median of {args.rounds}, slowest rank): flatshard {median['flatshard'] * 1e3:.1f} ms, "
        f"FSDP2 {median['fsdp2'] * 1e3:.1f} ms, ratio {report['step_ratio_flatshard_over_fsdp2']:.2f}"
    )
    for rank, r in enumerate(ranks):
        print(f"rank {rank}: held bytes flatshard {r['held']['flatshard']}, FSDP2 {r['held']['fsdp2']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
