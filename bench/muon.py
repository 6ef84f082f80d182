"""Muon on a GPT: flatshard's whole matrices against the way FSDP2 users run Muon today.

    python -m bench.muon                                   # 30M GPT, W = 2 and 4, writes bench/results/muon.json
    python -m bench.muon --size 3M --world 2 --steps 2     # a quick look (--json FILE, or --no-json)
    python -m bench.muon --table                           # the committed file's table, as the docs quote it

Two systems in the same W processes, their steps interleaved (A, B, A, B, ...), gloo on CPU (or one GPU
per rank where there are enough, NCCL):

* ``flatshard``: ``fully_shard(..., shard_boundaries="params")``; an unmodified ``torch.optim.Muon`` on
  this rank's whole matrices, ``AdamW`` on its other parameters: ``optimizer.step()`` communicates nothing.
* ``fsdp2_full_tensor``: PyTorch's ``fully_shard`` (Shard(0) chunks); for every matrix each rank keeps
  Muon's momentum on its chunk, gathers the whole momentum-updated gradient with ``full_tensor()``, runs
  Newton-Schulz on it (every rank on every matrix), and applies its own chunk of the update; AdamW on
  the rest. Same coefficients, steps and learning-rate scale as ``torch.optim.Muon``.

Printed per W: optimizer-step time, whole step time (forward, backward, optimizer), peak memory on an
accelerator (``max_memory_allocated``; not measured on CPU), and the ratios flatshard / FSDP2.
Figures only: nothing here asserts a time.
"""

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
from torch.optim._muon import _zeropower_via_newtonschulz  # torch.optim.Muon's own Newton-Schulz

from bench import provenance
from examples.gpt import GPT, GPTConfig

SIZES = {
    "3M": GPTConfig(layers=4, dim=256, heads=4, block_size=64),
    "30M": GPTConfig(layers=6, dim=640, heads=10, block_size=64),  # 29.7M parameters
}
LR, MOMENTUM, NS = 0.02, 0.95, (3.4445, -4.775, 2.0315)
RESULT = Path("bench/results/muon.json")


def _flatshard(cfg: GPTConfig, device):
    import flatshard

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        flatshard.fully_shard(block, shard_boundaries="params")
    flatshard.fully_shard(model, shard_boundaries="params")
    owned = [p for _, p in flatshard.owned_named_parameters(model)]
    matrices = [p for p in owned if p.ndim == 2]
    rest = [p for p in owned if p.ndim != 2]
    opts = [torch.optim.Muon(matrices, lr=LR, momentum=MOMENTUM, weight_decay=0.0)] if matrices else []
    opts += [torch.optim.AdamW(rest, lr=1e-3)] if rest else []

    def step():
        for o in opts:
            o.step()
            o.zero_grad()

    return model, step


def _fsdp2(cfg: GPTConfig, device):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    matrices = [p for p in model.parameters() if p.ndim == 2]
    rest = [p for p in model.parameters() if p.ndim != 2]
    adamw = torch.optim.AdamW(rest, lr=1e-3)
    bufs = {p: torch.zeros_like(p.to_local()) for p in matrices}

    @torch.no_grad()
    def step():
        for p in matrices:  # the common recipe: whole gradient on every rank, Newton-Schulz on every matrix
            buf = bufs[p]
            grad = p.grad.to_local()
            buf.lerp_(grad, 1 - MOMENTUM)
            update = grad.lerp(buf, MOMENTUM)  # Nesterov, as torch.optim.Muon
            full = torch.distributed.tensor.DTensor.from_local(
                update, p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
            ).full_tensor()
            ortho = _zeropower_via_newtonschulz(full, NS, 5, 1e-7)
            scale = LR * max(1.0, p.shape[0] / p.shape[1]) ** 0.5
            rank, world = p.device_mesh.get_local_rank(), p.device_mesh.size()
            rows = -(-p.shape[0] // world)
            local = p.to_local()
            local.add_(ortho[rank * rows : rank * rows + local.shape[0]], alpha=-scale)
            p.grad = None
        adamw.step()
        adamw.zero_grad()

    return model, step


def _worker(rank: int, world: int, args, store_path: str, out_path: str) -> None:
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= world
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    store = dist.FileStore(store_path, world)
    dist.init_process_group("nccl" if cuda else "gloo", store=store, rank=rank, world_size=world)
    cfg = SIZES[args.size]
    systems = {"flatshard": _flatshard(cfg, device), "fsdp2_full_tensor": _fsdp2(cfg, device)}
    times: dict = {name: {"optimizer": [], "step": []} for name in systems}
    peaks: dict = dict.fromkeys(systems, 0)
    g = torch.Generator().manual_seed(rank)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()

    for i in range(args.warmup + args.steps):
        for name, (model, opt_step) in systems.items():  # interleaved: A, B, A, B
            x = torch.randint(0, cfg.vocab, (args.batch, cfg.block_size), generator=g).to(device)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            sync()
            t0 = time.perf_counter()
            loss = torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten())
            loss.backward()
            sync()
            t1 = time.perf_counter()
            opt_step()
            sync()
            t2 = time.perf_counter()
            if i >= args.warmup:
                times[name]["optimizer"].append(t2 - t1)
                times[name]["step"].append(t2 - t0)
                if cuda:
                    peaks[name] = max(peaks[name], torch.cuda.max_memory_allocated())
    if rank == 0:
        out = {
            name: {
                "optimizer_step_s": statistics.median(t["optimizer"]),
                "step_s": statistics.median(t["step"]),
                "peak_bytes": peaks[name] if cuda else None,
            }
            for name, t in times.items()
        }
        out["device"] = "cuda" if cuda else "cpu"
        Path(out_path).write_text(json.dumps(out))
    dist.destroy_process_group()


def run(args, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out_path = os.path.join(tmp, "out.json")
        mp.spawn(_worker, args=(world, args, os.path.join(tmp, "store"), out_path), nprocs=world)
        return json.loads(Path(out_path).read_text())


def _ratios(r: dict) -> dict:
    a, b = r["flatshard"], r["fsdp2_full_tensor"]
    out = {"optimizer_step": a["optimizer_step_s"] / b["optimizer_step_s"], "step": a["step_s"] / b["step_s"]}
    if a["peak_bytes"] and b["peak_bytes"]:
        out["peak"] = a["peak_bytes"] / b["peak_bytes"]
    return out


def table(report: dict) -> list[str]:
    """The committed run as docs/how-to/whole-matrix-optimizers.md quotes it (times are medians per rank 0)."""

    def ms(seconds: float) -> str:
        return f"{seconds * 1e3:,.0f}"

    rows = [
        "| W | optimizer step, flatshard ms | optimizer step, FSDP2 + full_tensor() ms | ratio | whole step, "
        "flatshard ms | whole step, FSDP2 + full_tensor() ms | ratio | peak ratio |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for world, r in sorted(report["runs"].items(), key=lambda kv: int(kv[0])):
        a, b, q = r["flatshard"], r["fsdp2_full_tensor"], r["ratios"]
        peak = f"{q['peak']:.2f}" if "peak" in q else f"not measured ({r['device']})"
        rows.append(
            f"| {world} | {ms(a['optimizer_step_s'])} | {ms(b['optimizer_step_s'])} | {q['optimizer_step']:.2f} | "
            f"{ms(a['step_s'])} | {ms(b['step_s'])} | {q['step']:.2f} | {peak} |"
        )
    return rows


def write_json(path: Path, report: dict) -> None:
    """The one place this tool writes its result file."""
    path.write_text(json.dumps(provenance.stamp(report), indent=1) + "\n")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="30M")
    parser.add_argument("--world", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=2, help="sequences per rank")
    parser.add_argument("--json", type=Path, default=RESULT)
    parser.add_argument("--no-json", action="store_true")
    parser.add_argument("--table", action="store_true", help="print --json's table (as the docs quote it), run nothing")
    args = parser.parse_args(argv)
    if args.table:
        from bench.tables import measured_at

        report = json.loads(args.json.read_text())
        print(measured_at(report))
        print(
            f"Muon on a {report['size']} GPT, {report['steps']} steps of {report['batch_per_rank']} sequences per rank:"
        )
        print("\n".join(table(report)))
        return
    report: dict = {"size": args.size, "steps": args.steps, "batch_per_rank": args.batch, "runs": {}}
    print(f"Muon on a {args.size} GPT: flatshard whole matrices / FSDP2 + full_tensor() (ratios < 1: flatshard faster)")
    print(f"{'W':>3} {'opt flatshard':>14} {'opt fsdp2':>10} {'opt ratio':>10} {'step ratio':>11} {'peak ratio':>11}")
    for world in args.world:
        r = run(args, world)
        r["ratios"] = _ratios(r)
        report["runs"][str(world)] = r
        a, b, q = r["flatshard"], r["fsdp2_full_tensor"], r["ratios"]
        peak = f"{q['peak']:.2f}" if "peak" in q else "n/a (cpu)"
        print(
            f"{world:>3} {a['optimizer_step_s'] * 1e3:>12.1f}ms {b['optimizer_step_s'] * 1e3:>8.1f}ms "
            f"{q['optimizer_step']:>10.2f} {q['step']:>11.2f} {peak:>11}"
        )
    if not args.no_json:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
