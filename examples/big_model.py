"""A GPT bigger than one process may hold, trained by W processes that each live under a memory cap.

    python examples/big_model.py                 # W=4 ranks, 1.5 GiB cap each, a 202M-parameter GPT
    python examples/big_model.py --plot mem.png  # and the per-rank memory of one step, by category
    python examples/big_model.py --world 4 --cap 1GiB --layers 9 --dim 1120 --steps 1   # smaller, faster

The operating system enforces the cap: each process runs in its own cgroup (v1 ``memory.limit_in_bytes``
or v2 ``memory.max``; this needs root), so a process that needs more memory is killed by the kernel.
The model's full training state with AdamW, 16·P bytes (fp32 parameters, gradients and two moments),
is at least twice the cap, so no single process could hold it; flatshard holds 16·P/W per rank plus
one gathered unit at a time. The model is built on the meta device and materialised unit by unit
(``param_init_fn``; [Note: deferred initialisation] in src/flatshard/deferred.py), every block is
activation-checkpointed, and the same model without flatshard, in one process under the same cap,
runs afterwards to show that it is killed.

Reads top to bottom: config → cgroups → launcher → one rank (dist init → model on meta → wrap →
optimizer → steps, one of them recorded by category) → the run without flatshard → figures and plot.
Each rank prints nothing; the launcher prints the table (``--json`` writes the figures).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

GiB = 1 << 30
MiB = 1 << 20


# ---- config ---------------------------------------------------------------------------------------
def parse_bytes(text: str) -> int:
    units = {"gib": GiB, "g": GiB, "gb": 10**9, "mib": MiB, "m": MiB, "mb": 10**6, "": 1}
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    if t[len(num) :] not in units:
        raise argparse.ArgumentTypeError(f"unknown size suffix in {text!r}; use e.g. 1.5GiB or 800MiB")
    return int(float(num) * units[t[len(num) :]])


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--world", type=int, default=4, help="ranks W (default 4)")
    p.add_argument(
        "--cap", type=parse_bytes, default=parse_bytes("1.5GiB"), help="memory cap per process (default 1.5GiB)"
    )
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--block-size", type=int, default=64, help="context length")
    p.add_argument("--batch-size", type=int, default=1, help="sequences per rank per step")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-baseline", action="store_true", help="skip the run without flatshard")
    p.add_argument("--allow-small", action="store_true", help="run even if 16·P < 2 × cap (no proof then)")
    p.add_argument("--plot", type=Path, help="write the memory of one step, per rank and category, as a PNG")
    p.add_argument("--json", type=Path, help="write the figures to this file")
    p.add_argument("--worker", choices=["flatshard", "baseline"], help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def model_config(args):
    from gpt import GPTConfig

    if args.dim % args.heads:
        raise SystemExit(f"--dim ({args.dim}) must be a multiple of --heads ({args.heads})")
    return GPTConfig(layers=args.layers, dim=args.dim, heads=args.heads, block_size=args.block_size)


def count_params(cfg) -> int:
    """P for examples/gpt.py's GPT (the head is tied to the token embedding)."""
    d = cfg.dim
    block = 2 * 2 * d + (3 * d * d + 3 * d) + (d * d + d) + (4 * d * d + 4 * d) + (4 * d * d + d)
    return cfg.layers * block + (cfg.vocab + cfg.block_size) * d + 2 * d


# ---- cgroups: one per process, the cap enforced by the kernel --------------------------------------
class MemoryCap:
    """A fresh memory cgroup with a limit; ``join`` (in the child, before exec) moves the process in."""

    V1, V2 = Path("/sys/fs/cgroup/memory"), Path("/sys/fs/cgroup")

    def __init__(self, name: str, limit: int):
        if (self.V2 / "cgroup.controllers").exists() and "memory" in (self.V2 / "cgroup.controllers").read_text():
            self.path, self.v2 = self.V2 / name, True
        elif (self.V1 / "memory.limit_in_bytes").exists():
            self.path, self.v2 = self.V1 / name, False
        else:
            raise RuntimeError(unavailable_reason() or "no memory cgroup controller")
        self.path.mkdir()
        if self.v2:
            (self.path / "memory.max").write_text(str(limit))
            if (self.path / "memory.swap.max").exists():
                (self.path / "memory.swap.max").write_text("0")
        else:
            (self.path / "memory.limit_in_bytes").write_text(str(limit))
            if (self.path / "memory.memsw.limit_in_bytes").exists():  # no escape into swap
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
        self.limit = limit

    def join(self) -> None:
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def peak(self) -> int:
        """Most memory the group was charged (anonymous memory plus page cache), in bytes."""
        name = "memory.peak" if self.v2 else "memory.max_usage_in_bytes"
        f = self.path / name
        return int(f.read_text()) if f.exists() else -1

    def oom_kills(self) -> int:
        f = self.path / ("memory.events" if self.v2 else "memory.oom_control")
        for line in f.read_text().splitlines() if f.exists() else []:
            key, _, value = line.partition(" ")
            if key == "oom_kill":
                return int(value)
        return -1

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:
            pass


def unavailable_reason() -> str | None:
    """Why per-process memory caps cannot be set here, or None if they can."""
    v2 = MemoryCap.V2 / "cgroup.controllers"
    if not (v2.exists() and "memory" in v2.read_text()) and not (MemoryCap.V1 / "memory.limit_in_bytes").exists():
        return "no memory cgroup controller is mounted (neither cgroup v2 with 'memory' nor v1 /sys/fs/cgroup/memory)"
    if os.geteuid() != 0:
        return "creating a cgroup needs root"
    return None


# ---- launcher -------------------------------------------------------------------------------------
def run_capped(name: str, cap: int, argv: list[str], env: dict, count: int) -> tuple[list[int], list[MemoryCap], float]:
    """Start ``count`` copies of this script (``env`` + RANK) each in its own cgroup; wait for all."""
    caps = [MemoryCap(f"{name}-r{r}", cap) for r in range(count)]
    t0 = time.perf_counter()
    procs = []
    for r, c in enumerate(caps):
        procs.append(
            subprocess.Popen(
                [sys.executable, os.path.abspath(__file__), *argv], env={**env, "RANK": str(r)}, preexec_fn=c.join
            )
        )
    codes = []
    for p in procs:
        codes.append(p.wait())
        if codes[-1] != 0:  # a rank killed: its peers may wait in a collective forever
            for q in procs:
                if q.poll() is None:
                    q.kill()
    return codes, caps, time.perf_counter() - t0


def launch(args) -> int:
    reason = unavailable_reason()
    if reason:
        raise SystemExit(f"cannot cap memory per process: {reason}")
    cfg = model_config(args)
    P = count_params(cfg)
    if 16 * P < 2 * args.cap and not args.allow_small:
        raise SystemExit(
            f"16·P = {16 * P / GiB:.2f} GiB is less than twice the cap ({args.cap / GiB:.2f} GiB): "
            "raise --layers/--dim or lower --cap (or pass --allow-small)"
        )
    from local_launch import LOOPBACK, loopback_env, loopback_store

    forwarded = [a for a in sys.argv[1:] if a not in ("--no-baseline",)]
    tag = f"flatshard-big-{os.getpid()}"
    # The ranks' store, hosted here on 127.0.0.1 only, and their gloo sockets on the loopback interface
    # ([Note: loopback-only local launch] in local_launch.py): nothing of the job listens elsewhere.
    store, port = loopback_store()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "figures.json"
        env = {
            **os.environ,
            **loopback_env(),
            "MASTER_ADDR": LOOPBACK,
            "MASTER_PORT": str(port),
            "WORLD_SIZE": str(args.world),
            "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 1) // args.world)),
        }
        # A hidden cost: glibc serves blocks under its mmap threshold from its heap, and raises that threshold
        # (up to 32 MiB) each time a larger block is freed. A unit's unsharded flat, freed and gathered again
        # every pass, then stays in a heap that fragments, and a rank's resident memory creeps up by hundreds
        # of MiB. A fixed threshold (which turns the raising off) returns every large block to the system.
        env.setdefault("MALLOC_MMAP_THRESHOLD_", str(1 * MiB))
        codes, caps, wall = run_capped(
            tag, args.cap, [*forwarded, "--worker", "flatshard", "--out", str(out)], env, args.world
        )
        figures = json.loads(out.read_text()) if out.exists() else {"ranks": []}
        figures.update(
            P=P,
            world=args.world,
            cap=args.cap,
            wall_s=wall,
            exit_codes=codes,
            cgroup_peak=[c.peak() for c in caps],
            oom_kills=[c.oom_kills() for c in caps],
        )
        for c in caps:
            c.remove()
        if not args.no_baseline:
            base_out = Path(tmp) / "baseline.json"
            env1 = {**env, "WORLD_SIZE": "1", "OMP_NUM_THREADS": str(os.cpu_count() or 1)}
            bcodes, bcaps, bwall = run_capped(
                tag + "-baseline", args.cap, [*forwarded, "--worker", "baseline", "--out", str(base_out)], env1, 1
            )
            reached = json.loads(base_out.read_text()) if base_out.exists() else {}
            figures["baseline"] = {
                "exit_code": bcodes[0],
                "oom_kills": bcaps[0].oom_kills(),
                "cgroup_peak": bcaps[0].peak(),
                "wall_s": bwall,
                **reached,
            }
            bcaps[0].remove()
    print_figures(figures, cfg)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=1))
    if args.plot and figures["ranks"]:
        plot_timelines(
            figures["ranks"],
            args.plot,
            f"one training step, {P / 1e6:.0f}M parameters, W={args.world}, cap {args.cap / GiB:.2f} GiB per process",
        )
        print(f"plot: {args.plot}")
    return 0 if all(c == 0 for c in codes) else 1


# ---- one rank -------------------------------------------------------------------------------------
def gpt_init_fn(model, cfg):
    """examples/gpt.py's initialisation as a param_init_fn: it touches only the module's own parameters."""
    from torch import nn

    residual = {id(m) for b in model.blocks for m in (b.proj, b.out)}  # scaled down with depth, as in GPT-2

    def init(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            std = 0.02 / (2 * cfg.layers) ** 0.5 if id(module) in residual else 0.02
            nn.init.normal_(module.weight, std=std)
            if getattr(module, "bias", None) is not None:
                nn.init.zeros_(module.bias)
        else:
            module.reset_parameters()

    return init


def batches(cfg, args, rank: int, world: int):
    """Random windows of the Python standard library's source (as examples/train_gpt.py reads it: step
    k's batch drawn from the seed plus k)."""
    from train_gpt import get_batch, load_corpus

    data, step = load_corpus(), 0
    while True:
        yield get_batch(data, args.seed + step, args.batch_size, cfg.block_size, rank, world)
        step += 1


def rank_main(args) -> int:
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from gpt import GPT, Block
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import param_groups
    from flatshard.wrap import ModuleWrapPolicy

    # a client of the store the launcher hosts on 127.0.0.1 (a rank that hosted it would listen everywhere)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
    dist.init_process_group("gloo", store=store, rank=int(os.environ["RANK"]), world_size=int(os.environ["WORLD_SIZE"]))
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg = model_config(args)
    t0 = time.perf_counter()
    torch.manual_seed(args.seed)
    with torch.device("meta"):  # shapes only: no memory
        model = GPT(cfg)
    # Memory first: no backward prefetch, so one unit is gathered at a time beside the root (prefetch would
    # hold the next unit too, and keep full-size gradients while their reductions are in flight).
    model = FSDP(
        model, auto_wrap_policy=ModuleWrapPolicy({Block}), param_init_fn=gpt_init_fn(model, cfg), backward_prefetch=None
    )
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    init_s = time.perf_counter() - t0
    rss_after_init = peak_rss()
    opt = torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=args.lr)
    data = batches(cfg, args, rank, world)
    losses, step_s = [], []
    with model.record_memory(opt, timeline=True) as mem:  # the plot needs the samples of one step
        for step in range(args.steps):
            recorded = step == args.steps - 1  # the last step, with optimizer state, is the one plotted
            x, y = next(data)
            if recorded:
                mem.reset_peak()
                mem.reset_timeline()
            t = time.perf_counter()
            # forward and backward only: the optimizer's first step creates its state, which would count as
            # activations until the next sample
            with mem.tracking_activations() if recorded else _nothing():
                loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
                mem.sample()
                loss.backward()
            opt.step()
            opt.zero_grad()
            mem.sample()
            step_s.append(time.perf_counter() - t)
            losses.append(loss.item())
    mine = {
        "rank": rank,
        "peak_rss": peak_rss(),
        "rss_after_init": rss_after_init,
        "init_s": init_s,
        "step_s": step_s,
        "losses": losses,
        "peak": mem.peak,
        "peak_total": mem.peak_total,
        "timeline": mem.timeline,
    }
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    if rank == 0:
        args.out.write_text(json.dumps({"ranks": everyone}))
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    return 0


def baseline_main(args) -> int:
    """The same model, initialisation and step without flatshard, in one process: 16·P bytes needed."""
    import torch
    import torch.nn.functional as F
    from gpt import GPT

    cfg = model_config(args)
    reached = []

    def note(what: str) -> None:  # written as we go: the kernel may kill us at any line
        reached.append((what, peak_rss()))
        args.out.write_text(json.dumps({"reached": reached}))

    torch.manual_seed(args.seed)
    with torch.device("meta"):
        model = GPT(cfg)
    model.to_empty(device="cpu")
    model.head.weight = model.wte.weight  # to_empty unties shared weights
    init = gpt_init_fn(model, cfg)
    for m in model.modules():
        if any(True for _ in m.parameters(recurse=False)) or any(True for _ in m.buffers(recurse=False)):
            init(m)
    note("parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    x, y = next(batches(cfg, args, 0, 1))
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    note("gradients")
    opt.step()
    note("optimizer step")
    return 0


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


# ---- figures --------------------------------------------------------------------------------------
def print_figures(fig: dict, cfg) -> None:
    P, W, cap = fig["P"], fig["world"], fig["cap"]
    print(
        f"model: GPT {cfg.layers} layers × {cfg.dim} wide, P = {P:,} parameters; 16·P = {16 * P / GiB:.2f} GiB "
        f"= {16 * P / cap:.2f} × the cap"
    )
    print(
        f"flatshard: W = {W} ranks, each capped at {cap / GiB:.2f} GiB (cgroup); 16·P/W = {16 * P / W / GiB:.2f} GiB; "
        f"exit codes {fig['exit_codes']}, OOM kills {fig['oom_kills']}"
    )
    for r in fig["ranks"]:
        steps = r["step_s"][1:-1] or r["step_s"]  # not the first (allocations) nor the recorded one (tracing)
        pk = r["peak"]
        print(
            f"  rank {r['rank']}: peak RSS {r['peak_rss'] / GiB:.2f} GiB ({r['peak_rss'] / cap:.0%} of cap), "
            f"cgroup peak {fig['cgroup_peak'][r['rank']] / GiB:.2f} GiB; init {r['init_s']:.1f} s; "
            f"{sum(steps) / len(steps):.1f} s/step; loss {' '.join(f'{v:.2f}' for v in r['losses'])}"
        )
        print(
            "          peak by category (recorded step): "
            + ", ".join(
                f"{c} {pk.get(c, 0) / MiB:.0f} MiB" for c in ("params", "grads", "optimizer", "gathered", "activations")
            )
        )
    base = fig.get("baseline")
    if base:
        code = base["exit_code"]
        how = "killed by the kernel (cgroup OOM)" if code in (-9, 137) or base["oom_kills"] > 0 else f"exit code {code}"
        last = base.get("reached", [])
        got = (
            f"; got as far as: {last[-1][0]} ({last[-1][1] / GiB:.2f} GiB RSS)"
            if last
            else "; before the parameters were initialised"
        )
        print(f"without flatshard, 1 process under the same cap: {how}{got}")


def plot_timelines(ranks: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cats = ("params", "grads", "optimizer", "gathered", "activations")
    fig, axes = plt.subplots(len(ranks), 1, figsize=(9, 2.6 * len(ranks)), sharex=True, squeeze=False)
    for ax, r in zip(axes[:, 0], ranks):
        times = [t for t, _ in r["timeline"]]
        for c in cats:
            ax.plot(times, [now.get(c, 0) / MiB for _, now in r["timeline"]], label=c, marker=".", markersize=3)
        ax.plot(times, [sum(now.values()) / MiB for _, now in r["timeline"]], label="total", color="black", linewidth=1)
        ax.set_ylabel(f"rank {r['rank']}\nMiB")
        ax.grid(alpha=0.3)
    axes[0, 0].legend(loc="upper right", fontsize=7, ncol=3)
    axes[0, 0].set_title(title, fontsize=9)
    axes[-1, 0].set_xlabel("seconds into the step (samples at unit transitions)")
    fig.tight_layout()
    fig.savefig(path, dpi=80)


def main(argv=None) -> int:
    args = parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # gpt.py, train_gpt.py
    if args.worker == "flatshard":
        return rank_main(args)
    if args.worker == "baseline":
        return baseline_main(args)
    return launch(args)


if __name__ == "__main__":
    code = main()
    # the wrapped model is garbage in reference cycles and holds the process groups: collected here, they
    # are destroyed and gloo's threads joined before the interpreter finalizes, or a rank can abort at exit
    # ([Note: process groups at exit] in examples/local_launch.py)
    gc.collect()
    sys.exit(code)
