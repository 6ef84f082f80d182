"""flatshard against PyTorch FSDP2 and DDP, side by side: ``python -m bench.compare`` (``make bench``).

    python -m bench.compare                       # 3M and 30M GPT, W = 2 and 4, fp32 and bf16, + ablation
    python -m bench.compare --quick               # 3M only, W = 2, fewer steps (about 30 s)
    python -m bench.compare --sizes 30M --world 2 --dtypes bf16 --steps 12 --no-ablation

For each world size W the command starts W local processes through torchrun's own machinery
(``torch.distributed.run``, gloo on CPU, every socket on 127.0.0.1), as examples/train_gpt.py does. In the ranks,
for each size and dtype, the same GPT (examples/gpt.py: same seed, so the same initial weights; the same
batches on each rank) is built three ways:

* **flatshard** FULL_SHARD, one unit per ``Block`` and the root;
* **FSDP2** — PyTorch's ``fully_shard`` on each ``Block``, then on the root (the same units);
* **DDP** — ``DistributedDataParallel`` (every rank holds everything, one all-reduce of the gradients).

Then the *compiled rows* (``--no-compile`` skips them): the two flatshard front ends and FSDP2 again, each
``Block`` compiled with inductor (``block.compile()``): before auto-wrap for the FSDP1 wrapper, after
sharding for ``fully_shard`` and FSDP2 (torchtitan's order). The warmup steps include the compilation.

bf16 means ``param_dtype=bf16, reduce_dtype=fp32`` for both FSDPs (``MixedPrecision`` /
``MixedPrecisionPolicy``) and ``torch.autocast("cpu", bf16)`` for DDP, which has no such policy (so DDP's
bf16 losses agree only loosely: autocast keeps norms and softmax in fp32). All use AdamW(lr 1e-3).

[Note: how the figures are taken]
* Steps are *interleaved*: step i of every system runs back to back (the order rotated every step), each
  after a barrier, so a noisy shared machine slows all systems alike. The first ``--warmup`` steps are
  discarded. A step's time is the slowest rank's; the figure is the median over the measured steps.
* Peak memory per rank comes from one extra step per system under ``StoragePeak`` below, the same
  tracker for all three: every storage the step creates or touches (parameters, gradients, optimizer
  state, gathered parameters, activations, temporaries), its size read live after every operator (so
  ``UntypedStorage.resize_``, which both FSDPs use to free gathered parameters, is seen). Memory that
  never passes through an operator (gloo's internal buffers, DDP's gradient buckets until a gradient is
  copied in) is not seen, alike for all.
* Bytes per step: the same tracked step counts every c10d collective operator it sees (both FSDPs),
  with ring figures (all-gather and reduce-scatter (n-1)·shard bytes, all-reduce 2(n-1)/n·bytes, as
  flatshard's own recorder does; flatshard's recorder is reported beside it as a cross-check, by kind).
  flatshard's all-gathers and reduce-scatters on gloo are point-to-point sends: those are counted as
  "send" with the bytes of each tensor sent, which add up to the same (n-1)·shard bytes. DDP
  all-reduces from C++ where no dispatch mode sees it, so its bytes are the formula 2·(W-1)/W·4·P.
* Losses: every rank's loss of every step (tracked step included), compared across systems after the
  run; fp32 must agree within 1e-4 relative, bf16 FSDP2 within 2e-2, DDP-autocast within 5e-2.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import sys
import sysconfig
import tempfile
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from bench import provenance

ROOT = Path(__file__).resolve().parents[1]  # the repository: examples/gpt.py is the model measured
DEFAULT_JSON = ROOT / "bench" / "results" / "bench.json"
QUICK_JSON = ROOT / "bench" / "results" / "quick.json"
FP32_RTOL, BF16_RTOL, AUTOCAST_RTOL = 1e-4, 2e-2, 5e-2
ABLATION = {  # name -> flatshard keywords (FULL_SHARD unless said); the first is the baseline of the ratios
    "BACKWARD_PRE (default)": dict(backward_prefetch="BACKWARD_PRE"),
    "BACKWARD_POST": dict(backward_prefetch="BACKWARD_POST"),
    "backward_prefetch=None": dict(backward_prefetch=None),
    "BACKWARD_PRE + forward_prefetch": dict(backward_prefetch="BACKWARD_PRE", forward_prefetch=True),
    "BACKWARD_PRE, limit_all_gathers=False": dict(backward_prefetch="BACKWARD_PRE", limit_all_gathers=False),
    "NO_SHARD": dict(backward_prefetch="BACKWARD_PRE", strategy="NO_SHARD"),
    'shard_boundaries="rows"': dict(backward_prefetch="BACKWARD_PRE", shard_boundaries="rows"),
    'shard_boundaries="params"': dict(backward_prefetch="BACKWARD_PRE", shard_boundaries="params"),
}


def load_gpt_module():
    """examples/gpt.py, the project's example model (the benchmark builds exactly that GPT)."""
    from examples import gpt

    return gpt


def sizes():
    GPTConfig = load_gpt_module().GPTConfig
    return {
        "tiny": GPTConfig(layers=2, dim=32, heads=2, block_size=32),  # the smoke test's
        "3M": GPTConfig(layers=4, dim=256, heads=4, block_size=64),  # 3.23M parameters
        "30M": GPTConfig(layers=6, dim=640, heads=10, block_size=64),  # 29.7M parameters
    }


# ---- the trackers -----------------------------------------------------------------------------------
C10D_KINDS = {
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "broadcast_": "broadcast",
    "send": "send",
}  # flatshard's point-to-point all-gathers and reduce-scatters on gloo (comm/collectives.py)


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tree_flatten(tensors)[0] if isinstance(t, torch.Tensor))


class StoragePeak(TorchDispatchMode):
    """Peak bytes of the storages a step creates or touches, and the collectives it issues (one rank).

    Every storage seen as an input or output of an operator (and those given at the start) is kept by
    weak reference; after every operator the live storages' current sizes are summed. Counting is by
    storage, so views and aliases count once. Also counts c10d collective operators by kind with their
    ring bytes for a group of ``world`` ranks."""

    def __init__(self, start_tensors, world: int):
        super().__init__()
        self.world = world
        self._live: dict[int, weakref.ref] = {}
        for t in start_tensors:
            self._add(t)
        self.peak = self.now()
        self.peak_at = "start"  # the operator after which the peak was seen, and its index in the step
        self._ops = 0
        self.comm: dict[str, dict] = {}

    def _add(self, t: torch.Tensor) -> None:
        t = getattr(t, "_local_tensor", t)  # a DTensor (FSDP2's parameters): its local shard
        if t.device.type == "meta" or _is_wrapper(t):
            return
        st = t.untyped_storage()
        key = id(st)
        if key not in self._live:
            self._live[key] = weakref.ref(st, lambda _, k=key: self._live.pop(k, None))

    def now(self) -> int:
        seen, total = set(), 0
        for ref in list(self._live.values()):
            st = ref()
            if st is not None and st.nbytes() and st.data_ptr() not in seen:
                seen.add(st.data_ptr())
                total += st.nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        kind = C10D_KINDS.get(func.__name__.split(".")[0]) if func.namespace == "c10d" else None
        if kind is not None:
            self._count(kind, args)
        for t in tree_flatten((args, kwargs, out))[0]:
            if isinstance(t, torch.Tensor):
                self._add(t)
        self._ops += 1
        now = self.now()
        if now > self.peak:
            self.peak, self.peak_at = now, f"{func.__name__} (op {self._ops})"
        return out

    def _count(self, kind: str, args) -> None:
        n = self.world
        if kind == "all_gather":  # (output(s), input(s), group, ...): each rank sends its input n-1 times
            wire = (n - 1) * _nbytes(args[1])
        elif kind == "reduce_scatter":  # (output(s), input(s), ...): n-1 chunks of the output's size
            wire = (n - 1) * _nbytes(args[0])
        elif kind == "all_reduce":
            wire = 2 * (n - 1) / n * _nbytes(args[0])
        else:
            wire = _nbytes(args[0])
        row = self.comm.setdefault(kind, {"count": 0, "wire_bytes": 0.0})
        row["count"] += 1
        row["wire_bytes"] += wire


def _is_wrapper(t: torch.Tensor) -> bool:
    """A tensor subclass without storage of its own (DTensor, FakeTensor, ...)."""
    return type(t) is not torch.Tensor and not isinstance(t, torch.nn.Parameter)


# ---- data -------------------------------------------------------------------------------------------
def load_corpus() -> torch.Tensor:
    """The top-level ``*.py`` files of the standard library, in sorted order, as one tensor of bytes."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    return torch.frombuffer(bytearray(b"".join(f.read_bytes() for f in files)), dtype=torch.uint8)


def batches(data, steps, batch, block, rank, world, seed):
    """``steps`` batches for this rank: rows of a global batch of ``world·batch`` random windows."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(len(data) - block - 1, (world * batch,), generator=gen)[
            rank * batch : (rank + 1) * batch
        ]
        windows = data[starts[:, None] + torch.arange(block + 1)].long()
        out.append((windows[:, :-1], windows[:, 1:]))
    return out


# ---- the systems ------------------------------------------------------------------------------------
@dataclasses.dataclass
class System:
    name: str
    model: torch.nn.Module
    opt: torch.optim.Optimizer
    autocast: bool = False  # DDP's bf16
    times: list = dataclasses.field(default_factory=list)
    losses: list = dataclasses.field(default_factory=list)
    peak: int = 0
    peak_at: str = ""
    comm: dict = dataclasses.field(default_factory=dict)
    recorder_comm: float | None = None  # flatshard's own recorder, bytes per step
    recorder_by_kind: dict = dataclasses.field(default_factory=dict)

    def step(self, x, y) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.autocast):
            logits = self.model(x)
        loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten())
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return loss.detach()


def build_flatshard(gpt, cfg, bf16: bool, strategy="FULL_SHARD", backward_prefetch="BACKWARD_PRE", **kw):
    from flatshard import BackwardPrefetch, MixedPrecision, ShardingStrategy
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
    prefetch = None if backward_prefetch is None else BackwardPrefetch[backward_prefetch]
    return FSDP(
        gpt.GPT(cfg),
        sharding_strategy=ShardingStrategy[strategy],
        auto_wrap_policy=ModuleWrapPolicy({gpt.Block}),
        mixed_precision=mp,
        backward_prefetch=prefetch,
        **kw,
    )


def build_fully_shard(gpt, cfg, bf16: bool):
    """flatshard's FSDP2 front end, built exactly as bench/fsdp2_reference.py builds PyTorch's."""
    import flatshard

    mp = flatshard.MixedPrecisionPolicy(torch.bfloat16, torch.float32) if bf16 else flatshard.MixedPrecisionPolicy()
    model = gpt.GPT(cfg)
    for block in model.blocks:
        flatshard.fully_shard(block, mp_policy=mp)
    return flatshard.fully_shard(model, mp_policy=mp)


def build_fsdp2(gpt, cfg, bf16: bool):
    # PyTorch's FSDP2 is the reference the benchmark measures flatshard against; the package never
    # imports it: the builder lives in bench/fsdp2_reference.py.
    from bench import fsdp2_reference

    return fsdp2_reference.build(gpt, cfg, bf16)


def build_ddp(gpt, cfg):
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(gpt.GPT(cfg))


def compile_blocks(model: torch.nn.Module) -> torch.nn.Module:
    """``block.compile()`` (inductor) on every Block under ``model``, in place: the per-block pattern."""
    for module in model.modules():
        if type(module).__name__ == "Block" or type(getattr(module, "module", None)).__name__ == "Block":
            module.compile()
    return model


def build_compiled(gpt, cfg, bf16: bool, system: str) -> torch.nn.Module:
    """The compiled rows: each system's blocks compiled as its users do it. The FSDP1 wrapper's
    blocks before auto-wrap (the wrap policy finds them by class); fully_shard's and FSDP2's after
    sharding, as torchtitan does. The same inductor graphs for all three."""
    if system == "flatshard":
        from flatshard import FullyShardedDataParallel as FSDP
        from flatshard import MixedPrecision
        from flatshard.wrap import ModuleWrapPolicy

        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
        model = gpt.GPT(cfg)
        compile_blocks(model)
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}), mixed_precision=mp)
    model = build_fully_shard(gpt, cfg, bf16) if system == "flatshard fully_shard" else build_fsdp2(gpt, cfg, bf16)
    return compile_blocks(model)


def make_systems(gpt, cfg, bf16: bool, seed: int, variants: dict | None, compiled: bool = False) -> list[System]:
    """The systems of one comparison, each from the same seed (the same initial weights)."""
    builders = {}
    if compiled:
        for name in ("flatshard", "flatshard fully_shard", "FSDP2"):
            builders[name] = lambda name=name: build_compiled(gpt, cfg, bf16, name)
    elif variants is None:
        builders["flatshard"] = lambda: build_flatshard(gpt, cfg, bf16)
        builders["flatshard fully_shard"] = lambda: build_fully_shard(gpt, cfg, bf16)
        builders["FSDP2"] = lambda: build_fsdp2(gpt, cfg, bf16)
        builders["DDP"] = lambda: build_ddp(gpt, cfg)
    else:
        for name, kw in variants.items():
            builders[name] = lambda kw=kw: build_flatshard(gpt, cfg, bf16, **kw)
    systems = []
    for name, build in builders.items():
        torch.manual_seed(seed)
        model = build()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        systems.append(System(name, model, opt, autocast=bf16 and name == "DDP"))
    return systems


# ---- one comparison, in the ranks -------------------------------------------------------------------
def tracked_step(system: System, x, y, world: int) -> None:
    """One more training step under StoragePeak (and flatshard's recorder): peak bytes and collectives."""
    start = [*system.model.parameters(), *system.model.buffers()]
    start += [v for st in system.opt.state.values() for v in st.values() if torch.is_tensor(v)]
    tracker = StoragePeak(start, world)
    recorder = system.model.record_comms(events=True) if hasattr(system.model, "record_comms") else None
    rec = recorder.__enter__() if recorder is not None else None
    try:
        with tracker:
            system.losses.append(system.step(x, y))
    finally:
        if recorder is not None:
            recorder.__exit__(None, None, None)
    system.peak, system.peak_at = tracker.peak, f"{tracker.peak_at} of {tracker._ops}"
    system.comm = tracker.comm
    if rec is not None:
        system.recorder_comm = rec.wire_bytes()
        system.recorder_by_kind = {e.kind: rec.wire_bytes(kind=e.kind) for e in rec.events}


def compare(gpt, cfg, bf16: bool, args, data, variants=None, compiled: bool = False) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    systems = make_systems(gpt, cfg, bf16, args.seed, variants, compiled)
    n_params = sum(p.numel() for p in gpt.GPT(cfg).parameters())
    steps = args.warmup + args.steps
    data_batches = batches(data, steps + 1, args.batch_size, cfg.block_size, rank, world, args.seed)
    for i, (x, y) in enumerate(data_batches[:steps]):
        k = i % len(systems)
        for system in systems[k:] + systems[:k]:  # rotated: no system always runs first
            dist.barrier()
            t0 = time.perf_counter()
            system.losses.append(system.step(x, y))
            if i >= args.warmup:
                system.times.append(time.perf_counter() - t0)
    x, y = data_batches[steps]
    for system in systems:
        dist.barrier()
        tracked_step(system, x, y, world)
    return gather_results(systems, n_params, world)


def gather_results(systems, n_params: int, world: int) -> dict:
    """Every rank's times, losses and peaks (one all_gather each); figures per system."""
    out = {"P": n_params, "systems": {}}
    for s in systems:
        mine = torch.tensor([*s.times, *[float(v) for v in s.losses], float(s.peak)], dtype=torch.float64)
        every = [torch.zeros_like(mine) for _ in range(world)]
        dist.all_gather(every, mine)
        n_t, n_l = len(s.times), len(s.losses)
        times = [max(e[i].item() for e in every) for i in range(n_t)]  # a step lasts as long as its slowest rank
        comm = {k: dict(v) for k, v in s.comm.items()}
        if s.name == "DDP":  # all-reduced in C++, out of any dispatch mode's sight: the formula
            comm = {"all_reduce (formula)": {"count": None, "wire_bytes": 2 * (world - 1) / world * 4 * n_params}}
        out["systems"][s.name] = {
            "step_s_median": statistics.median(times) if times else None,
            "step_s": times,
            "losses_per_rank": [e[n_t : n_t + n_l].tolist() for e in every],
            "peak_bytes_per_rank": [int(e[-1].item()) for e in every],
            "peak_at_rank0": s.peak_at,
            "comm_per_step": comm,
            "bytes_per_step": sum(v["wire_bytes"] for v in comm.values()),
            "recorder_bytes_per_step": s.recorder_comm,
            "recorder_bytes_per_step_by_kind": s.recorder_by_kind,
        }
    return out


def losses_agree(result: dict, bf16: bool) -> dict:
    """Max relative difference of every other system's per-rank losses to the first system's, and verdicts."""
    names = list(result["systems"])
    ref = torch.tensor(result["systems"][names[0]]["losses_per_rank"])
    out = {}
    for name in names[1:]:
        other = torch.tensor(result["systems"][name]["losses_per_rank"])
        rel = ((other - ref).abs() / ref.abs()).max().item()
        tol = FP32_RTOL if not bf16 else (AUTOCAST_RTOL if name == "DDP" else BF16_RTOL)
        out[name] = {"max_rel_diff": rel, "rtol": tol, "agree": rel <= tol}
    return out


def add_ratios(result: dict, base: str) -> None:
    b = result["systems"][base]["step_s_median"]
    for fig in result["systems"].values():
        fig["ratio_to_" + base] = fig["step_s_median"] / b if b else None


def worker(args) -> int:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    gpt, table = load_gpt_module(), sizes()
    data = load_corpus()
    results = []
    for size in args.sizes:
        for dtype in args.dtypes:
            for compiled in (False, True) if args.compile and dtype in args.compile_dtypes else (False,):
                bf16 = dtype == "bf16"
                res = compare(gpt, table[size], bf16, args, data, compiled=compiled)
                kind = "compiled" if compiled else "comparison"
                res.update(kind=kind, size=size, world=world, dtype=dtype, agree=losses_agree(res, bf16))
                for name in ("FSDP2", "DDP"):
                    if name in res["systems"]:
                        res[f"flatshard/{name}"] = (
                            res["systems"]["flatshard"]["step_s_median"] / res["systems"][name]["step_s_median"]
                        )
                res["fully_shard/FSDP2"] = (
                    res["systems"]["flatshard fully_shard"]["step_s_median"] / res["systems"]["FSDP2"]["step_s_median"]
                )
                for name in ("flatshard", "flatshard fully_shard"):  # peak over FSDP2's, max over ranks
                    res[f"{name} peak/FSDP2"] = max(res["systems"][name]["peak_bytes_per_rank"]) / max(
                        res["systems"]["FSDP2"]["peak_bytes_per_rank"]
                    )
                results.append(res)
                if rank == 0:
                    ddp = f"flatshard/DDP {res['flatshard/DDP']:.3f}  " if "flatshard/DDP" in res else ""
                    print(
                        f"[W={world} {size} {dtype}{' compiled' if compiled else ''}] "
                        f"flatshard/FSDP2 {res['flatshard/FSDP2']:.3f}  {ddp}"
                        f"fully_shard/FSDP2 {res['fully_shard/FSDP2']:.3f}",
                        flush=True,
                    )
    if args.ablation and world == args.ablation_world:
        res = compare(gpt, table[args.ablation_size], False, args, data, variants=ABLATION)
        base = next(iter(ABLATION))
        add_ratios(res, base)
        res.update(kind="ablation", size=args.ablation_size, world=world, dtype="fp32", agree=losses_agree(res, False))
        res["FULL_SHARD/NO_SHARD"] = res["systems"][base]["step_s_median"] / res["systems"]["NO_SHARD"]["step_s_median"]
        for mode in ("rows", "params"):  # against the default "flat"
            name = f'shard_boundaries="{mode}"'
            res[f"{mode}/flat"] = res["systems"][name]["step_s_median"] / res["systems"][base]["step_s_median"]
        results.append(res)
    if rank == 0:
        Path(args._out).write_text(json.dumps(results))
    dist.barrier()  # every rank is done with the group before any tears it down
    dist.destroy_process_group()
    return 0


# ---- the launcher and the report (one process) -----------------------------------------------------
def launch(world: int, argv: list[str], out: Path) -> list[dict]:
    """Run the worker on ``world`` local ranks through torchrun's machinery, every socket of the job on
    127.0.0.1 (examples/local_launch.py); its results."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from examples.local_launch import run_local

    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // world))
    try:
        run_local(world, "bench.compare", [*argv, "--_worker", "--_out", str(out)], module=True)
    except ChildFailedError as err:
        raise SystemExit(f"the benchmark's ranks failed at W={world} (torchrun printed why above)") from err
    return json.loads(out.read_text())


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.compare", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", nargs="+", default=["3M", "30M"], choices=["tiny", "3M", "30M"])
    p.add_argument("--world", nargs="+", type=int, default=[2, 4], help="world sizes W (local processes)")
    p.add_argument("--dtypes", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    p.add_argument("--steps", type=int, default=8, help="measured steps per system (after the warmup)")
    p.add_argument("--warmup", type=int, default=2, help="steps per system run first and discarded")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per rank per step (context = block size)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--no-ablation", dest="ablation", action="store_false", help="skip flatshard's prefetch ablation")
    p.add_argument(
        "--no-compile",
        dest="compile",
        action="store_false",
        help="skip the compiled rows (each Block compiled with inductor, beside FSDP2 compiled alike)",
    )
    p.add_argument(
        "--compile-dtypes",
        nargs="+",
        default=["fp32", "bf16"],
        choices=["fp32", "bf16"],
        help="dtypes with compiled rows",
    )
    p.add_argument("--ablation-size", default="30M", choices=["tiny", "3M", "30M"])
    p.add_argument("--ablation-world", type=int, default=2)
    p.add_argument(
        "--quick", action="store_true", help="3M only, W=2, fp32 and bf16, 4 steps, ablation on 3M (about 30 s)"
    )
    p.add_argument("--json", type=Path, help=f"where to write the results (default {DEFAULT_JSON.relative_to(ROOT)})")
    p.add_argument("--_worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--_out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.quick:
        args.sizes, args.world, args.steps, args.warmup, args.ablation_size = ["3M"], [2], 4, 1, "3M"
    if args.steps < 1 or args.warmup < 0 or min(args.world) < 1:
        p.error("--steps must be at least 1, --warmup at least 0 and every --world at least 1")
    return args


def worker_argv(args) -> list[str]:
    argv = [
        "--sizes",
        *args.sizes,
        "--dtypes",
        *args.dtypes,
        "--steps",
        str(args.steps),
        "--warmup",
        str(args.warmup),
        "--batch-size",
        str(args.batch_size),
        "--seed",
        str(args.seed),
        "--ablation-size",
        args.ablation_size,
        "--ablation-world",
        str(args.ablation_world),
    ]
    argv += ["--compile-dtypes", *args.compile_dtypes]
    return argv + ([] if args.ablation else ["--no-ablation"]) + ([] if args.compile else ["--no-compile"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args._worker:
        return worker(args)
    started, load_before = time.time(), os.getloadavg()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for world in args.world:
            results += launch(world, worker_argv(args), Path(tmp) / f"w{world}.json")
    out = args.json or (QUICK_JSON if args.quick else DEFAULT_JSON)
    out.parent.mkdir(parents=True, exist_ok=True)
    report = {
        "command": "python -m bench.compare " + " ".join(sys.argv[1:] if argv is None else argv),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        "seconds": time.time() - started,
        "steps": args.steps,
        "warmup": args.warmup,
        "batch_size": args.batch_size,
        "results": results,
    }
    out.write_text(json.dumps(provenance.stamp(report), indent=1))
    print_report(report)
    print(f"results written to {out}")
    return 0 if all(a["agree"] for r in results for a in r["agree"].values()) else 1


def mib(n) -> str:
    return f"{n / 2**20:,.1f}"


def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=150)
    t = Table(title="flatshard FULL_SHARD vs FSDP2 vs DDP (median step, interleaved; peak = max over ranks)")
    for col in (
        "model",
        "W",
        "dtype",
        "system",
        "step ms",
        "flatshard/x",
        "peak MiB/rank",
        "MiB sent/step/rank",
        "loss Δ (rel)",
    ):
        t.add_column(col, justify="right")
    for r in (r for r in report["results"] if r["kind"] in ("comparison", "compiled")):
        flat = r["systems"]["flatshard"]["step_s_median"]
        for name, fig in r["systems"].items():
            ratio = "" if name == "flatshard" else f"{flat / fig['step_s_median']:.2f}"
            agree = r["agree"].get(name)
            loss = "ref" if agree is None else f"{agree['max_rel_diff']:.1e} {'ok' if agree['agree'] else 'NO'}"
            t.add_row(
                f"{r['size']} ({r['P'] / 1e6:.1f}M)",
                str(r["world"]),
                r["dtype"],
                name + (" compiled" if r["kind"] == "compiled" else ""),
                f"{fig['step_s_median'] * 1e3:,.0f}",
                ratio,
                mib(max(fig["peak_bytes_per_rank"])),
                mib(fig["bytes_per_step"]),
                loss,
            )
        t.add_section()
    console.print(t)
    for r in (r for r in report["results"] if r["kind"] == "ablation"):
        a = Table(title=f"flatshard ablation: {r['size']}, W={r['world']}, fp32 (median step, interleaved)")
        for col in ("variant", "step ms", "ratio to default", "peak MiB/rank", "loss Δ (rel)"):
            a.add_column(col, justify="right")
        base = next(iter(r["systems"]))
        for name, fig in r["systems"].items():
            agree = r["agree"].get(name)
            loss = "ref" if agree is None else f"{agree['max_rel_diff']:.1e} {'ok' if agree['agree'] else 'NO'}"
            a.add_row(
                name,
                f"{fig['step_s_median'] * 1e3:,.0f}",
                f"{fig['ratio_to_' + base]:.2f}",
                mib(max(fig["peak_bytes_per_rank"])),
                loss,
            )
        console.print(a)
        console.print(f"FULL_SHARD / NO_SHARD step time: {r['FULL_SHARD/NO_SHARD']:.2f}")
        console.print(f"shard_boundaries rows / flat: {r['rows/flat']:.2f}, params / flat: {r['params/flat']:.2f}")


if __name__ == "__main__":
    code = main()
    # the wrapped model is garbage in reference cycles and holds the process groups: collected here, they
    # are destroyed and gloo's threads joined before the interpreter finalizes, or a rank can abort at exit
    # ([Note: process groups at exit] in examples/local_launch.py)
    gc.collect()
    sys.exit(code)
