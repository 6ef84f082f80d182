"""Checkpoint figures for the example GPT: save and load time and per-rank peak memory, and the peak
memory of `flatshard consolidate` against the largest tensor and the whole model.

    .venv/bin/python -m bench.figures.checkpoint_figures              # ~29M parameters, W = 2, FULL_SHARD
    .venv/bin/python -m bench.figures.checkpoint_figures --world 4 --layers 8

W local processes (gloo, CPU) build examples/gpt.py's GPT (the ``large`` preset with 16 blocks by
default: 28.6M parameters), wrap each Block as a unit, take one AdamW step so optimizer state exists,
then time, with every rank's resident memory sampled every 0.5 ms (peak above the resident memory
just before the call, after handing freed heap memory back to the OS; ``/proc/self/statm``):

  save (sync)          every rank writes its file, rank 0 commits
  save (async)         the call (a host copy of this rank's share) and the wait for the commit
  load, same W         every rank reads its own ranges
  load, W = 1          rank 0 alone (a subgroup) loads the W-rank checkpoint: reads every file
  consolidate          one process streams the checkpoint into one safetensors file

Times are wall-clock on this machine (shared, 2 cores): compare them with each other, not with a GPU box.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shutil
import tempfile
import threading
import time

_PAGE = os.sysconf("SC_PAGE_SIZE")


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _trim() -> None:
    """Hand freed heap memory back to the OS, so that what a call allocates shows as new resident memory
    (glibc otherwise keeps freed pages resident and reuses them unseen)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


class PeakRSS:
    """Resident-memory peak above the level at entry, sampled by a thread."""

    def __init__(self, interval: float = 0.0005):
        self.interval, self.peak, self._stop = interval, 0, threading.Event()

    def __enter__(self):
        _trim()
        self.base = rss()
        self.peak = self.base
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss())
            time.sleep(self.interval)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, rss())

    @property
    def extra(self) -> int:
        return self.peak - self.base


def measure(fn, group=None):
    import torch.distributed as dist

    dist.barrier(group)
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        out = fn()
        t1 = time.perf_counter()
    dist.barrier(group)
    return out, t1 - t0, mem.extra


def worker(rank: int, _world: int, cfg_kwargs: dict, tmp: str) -> dict:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    import flatshard
    from examples.gpt import GPT, Block, GPTConfig
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import checkpoint
    from flatshard.wrap import ModuleWrapPolicy

    cfg = GPTConfig(**cfg_kwargs)

    def build(group=None):
        torch.manual_seed(0)
        model = FSDP(GPT(cfg), auto_wrap_policy=ModuleWrapPolicy({Block}), process_group=group)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    model, opt = build()
    x = torch.randint(0, cfg.vocab, (2, 32), generator=torch.Generator().manual_seed(rank))
    F.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    share = sum(p.numel() * 4 for p in model.parameters()) + sum(
        t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
    )
    out = {"share": share, "params": sum(u.numel for u in flatshard.units(model))}
    _, out["save"], out["save_mem"] = measure(lambda: checkpoint.save(f"{tmp}/sync", model, opt, step=1))
    handle, out["async_call"], out["async_call_mem"] = measure(
        lambda: checkpoint.save(f"{tmp}/async", model, opt, step=1, async_save=True)
    )
    _, out["async_wait"], _ = measure(handle.wait)
    _, out["load"], out["load_mem"] = measure(lambda: checkpoint.load(f"{tmp}/sync", model, opt))
    del model, opt
    solo = dist.new_group([0])
    if rank == 0:
        model, opt = build(solo)
        _, out["load1"], out["load1_mem"] = measure(lambda: checkpoint.load(f"{tmp}/sync", model, opt), solo)
        out["share1"] = sum(p.numel() * 4 for p in model.parameters()) + sum(
            t.numel() * t.element_size() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)
        )
    dist.barrier()
    return out


def main() -> None:
    from examples.gpt import PRESETS

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--model", default="large", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int)
    p.add_argument("--dir", help="where to write the checkpoints (default: a temporary directory, removed after)")
    args = p.parse_args()
    overrides = {k: v for k, v in (("layers", args.layers), ("dim", args.dim)) if v is not None}
    cfg = dataclasses.replace(PRESETS[args.model], **overrides)
    tmp = args.dir or tempfile.mkdtemp(prefix="flatshard-ckpt-")
    from tests.helpers.dist import run_distributed

    try:
        results = run_distributed(worker, args.world, dataclasses.asdict(cfg), tmp, timeout=1200)
        report(args, cfg, tmp, results)
    finally:
        if not args.dir:
            shutil.rmtree(tmp, ignore_errors=True)


def report(args, cfg, tmp: str, results: list[dict]) -> None:
    from flatshard.checkpoint import read_manifest
    from flatshard.checkpoint.tools import consolidate

    MB = 1e6
    r0 = results[0]
    W = args.world
    size = sum(os.path.getsize(os.path.join(tmp, "sync", f)) for f in os.listdir(os.path.join(tmp, "sync")))
    print(
        f"GPT {args.model} with {cfg.layers} blocks, dim {cfg.dim}: {r0['params']:,} parameters; "
        f"W = {W}, FULL_SHARD, AdamW"
    )
    print(
        f"checkpoint: {size / MB:.1f} MB on disk ({W} files + manifest); each rank's share "
        f"(parameters + AdamW state) {r0['share'] / MB:.1f} MB\n"
    )
    print(f"{'':<28}{'time s':>8}   peak extra MB on " + "  ".join(f"{'rank ' + str(r):>7}" for r in range(W)))
    rows = [
        ("save (sync)", "save", "save_mem"),
        ("save (async): the call", "async_call", "async_call_mem"),
        ("save (async): wait", "async_wait", None),
        (f"load, W = {W}", "load", "load_mem"),
    ]
    pad = " " * len("   peak extra MB on ")
    for label, t, m in rows:
        mem = "  ".join(f"{r[m] / MB:7.1f}" for r in results) if m else ""
        print(f"{label:<28}{max(r[t] for r in results):>8.2f}{pad}{mem}".rstrip())
    print(
        f"{'load, W = 1 (rank 0 alone)':<28}{r0['load1']:>8.2f}{pad}{r0['load1_mem'] / MB:7.1f}"
        f"   (its share at W = 1: {r0['share1'] / MB:.1f} MB)"
    )
    print("(time: the slowest rank; peak extra: resident memory above the level before the call)")
    manifest = read_manifest(os.path.join(tmp, "sync"))
    model_bytes = sum(
        4 * int(__import__("math").prod(t["shape"])) for k, t in manifest["tensors"].items() if k.startswith("model/")
    )
    with PeakRSS() as mem:
        t0 = time.perf_counter()
        info = consolidate(os.path.join(tmp, "sync"), os.path.join(tmp, "model.safetensors"))
        took = time.perf_counter() - t0
    print(
        f"\nconsolidate: {took:.2f} s, {info['tensors']} tensors, {info['bytes'] / MB:.1f} MB written; "
        f"peak extra memory {mem.extra / MB:.1f} MB vs largest tensor {info['largest_tensor_bytes'] / MB:.1f} MB "
        f"and model {model_bytes / MB:.1f} MB"
    )


if __name__ == "__main__":
    main()
