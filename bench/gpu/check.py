"""GPU check: flatshard on CUDA against plain PyTorch, CPU offload, and the all-gather's bandwidth.

Started by bench/gpu/check.sh (it picks a Python with torch and launches the ranks with torchrun, as
``-m bench.gpu.check`` from the repository root):

    bash bench/gpu/check.sh          # CUDA and NCCL, one rank per visible GPU (W = 1 on one GPU)
    bash bench/gpu/check.sh --cpu    # dry run: gloo, 2 CPU ranks; checks that need CUDA say "not run"

Checks, one PASS / FAIL / NOT RUN line each, with its figures:
  parity_fp32      FULL_SHARD vs the unwrapped model on the global batch (SGD-momentum, AdamW): output,
                   loss, every gradient and parameter, every step, at torch's default fp32 tolerances
  parity_bf16      MixedPrecision(param_dtype=bf16, reduce_dtype=fp32) vs a reference that applies the
                   same casts (a bf16 copy computes, fp32 masters step), bf16 tolerances
  cpu_offload      CPUOffload(offload_params=True) (CUDA): parameters the optimizer sees are pinned CPU
                   tensors, gradients land on CPU, outputs on the GPU; equal to flatshard without offload
  cpu_offload_state_dict   FULL_STATE_DICT under offload equals the unwrapped reference's
  offload_error    (--cpu only) offload on a CPU-only run is a ValueError naming the missing accelerator
  all_gather_bw    all_gather_into_tensor of each --sizes-mib buffer: median of ITERS after WARMUP,
                   bus bandwidth as algbw * (W-1)/W; at W = 1 the figure is a local copy, not a network
  fronts_eager, fronts_compiled, overlap   beside PyTorch's FSDP2: bench/gpu/fronts.py
On a GPU every flatshard check runs with the stream discipline ([Note: stream discipline] in
src/flatshard/runtime/comm/streams.py): gathers and reductions on streams of their own, ordered by events.

Exit status 1 if any check failed. Results as JSON: --json PATH, else $OUT/gpu_check.json when OUT is
set, else bench/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]  # this working tree's flatshard, and the test models

from bench import provenance
from bench.gpu import fronts  # noqa: E402
from flatshard import CPUOffload, MixedPrecision, ShardingStrategy, param_groups  # noqa: E402
from flatshard import FullyShardedDataParallel as FSDP  # noqa: E402
from flatshard.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy  # noqa: E402
from tests.helpers.models import Block, OddMLP, TinyGPT  # noqa: E402
from tests.helpers.util import pairs  # noqa: E402

MODELS = ("odd_mlp", "tiny_gpt")  # odd element counts everywhere (padding); tied weights, attention
OPTIMIZERS = ("sgd_momentum", "adamw")
PER_RANK = 3  # odd micro-batch; the global batch is W * PER_RANK
BF16_LR = 0.05
WARMUP, ITERS = 3, 10
# all_gather_into_tensor is the collective flatshard uses and the one measured here; newer torch
# versions warn that it is deprecated on every call
warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")


@dataclass
class Ctx:
    rank: int
    world: int
    cuda: bool
    steps: int
    device: torch.device = field(init=False)

    def __post_init__(self):
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")

    @property
    def device_id(self):
        return torch.cuda.current_device() if self.cuda else None

    @property
    def local(self) -> slice:
        return slice(self.rank * PER_RANK, (self.rank + 1) * PER_RANK)


@dataclass
class Result:
    name: str
    status: str  # PASS, FAIL or NOT RUN
    summary: str
    figures: dict = field(default_factory=dict)


# ---- shared pieces -------------------------------------------------------------------------------
def build(kind: str, ctx: Ctx, **fsdp_kwargs):
    """(unwrapped reference on the device, flatshard FULL_SHARD copy of the same initial weights).

    The copy is handed over on CPU with ``device_id``: flatshard moves it (or, with offload, keeps
    its shards on CPU)."""
    torch.manual_seed(0)
    module = OddMLP() if kind == "odd_mlp" else TinyGPT()
    ref = copy.deepcopy(module).to(ctx.device)
    if kind == "odd_mlp":
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is module.fc1)
    else:
        policy = ModuleWrapPolicy({Block})
    model = FSDP(
        module,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        auto_wrap_policy=policy,
        device_id=ctx.device_id,
        **fsdp_kwargs,
    )
    return ref, model


def batch(kind: str, step: int, ctx: Ctx):
    """The global batch of ``step``, the same on every rank."""
    g = torch.Generator().manual_seed(1000 + step)
    n = ctx.world * PER_RANK
    if kind == "odd_mlp":
        x, y = torch.randn(n, 7, generator=g), torch.randn(n, 3, generator=g)
    else:
        x, y = torch.randint(0, 37, (n, 8), generator=g), torch.randint(0, 37, (n, 8), generator=g)
    return x.to(ctx.device), y.to(ctx.device)


def loss_fn(kind: str, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = out.float()
    return F.mse_loss(out, y) if kind == "odd_mlp" else F.cross_entropy(out.flatten(0, 1), y.flatten())


def make_optimizer(kind: str, model):
    if kind == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2)


def global_mean(loss: torch.Tensor, ctx: Ctx) -> torch.Tensor:
    """The mean of the ranks' micro-batch losses: the loss of the global batch."""
    t = loss.detach().clone()
    dist.all_reduce(t)
    return t / ctx.world


def agree(ok: bool, ctx: Ctx) -> bool:
    """True on every rank only if ``ok`` on every rank: the ranks stop a failing case together, so
    none is left waiting in a collective."""
    t = torch.tensor([int(ok)], device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return bool(t.item())


class Diffs:
    """Comparisons of one check on this rank: the largest absolute difference and the first failure."""

    def __init__(self):
        self.max_abs = 0.0
        self.failure: str | None = None
        self.compared = 0

    def compare(self, what: str, actual, expected, **tol) -> None:
        if actual is None or expected is None:
            return self.require(actual is None and expected is None, f"{what}: one side is None")
        self.compared += 1
        try:
            torch.testing.assert_close(actual, expected, **tol)
        except AssertionError as e:
            self.failure = self.failure or f"{what}: {e}"
        if actual.shape == expected.shape and actual.numel():
            diff = (actual.detach().double() - expected.detach().double()).abs().max().item()
            self.max_abs = max(self.max_abs, diff)

    def require(self, condition: bool, message: str) -> None:
        if not condition:
            self.failure = self.failure or message

    def result(self, name: str, ctx: Ctx, summary: str) -> Result:
        """Every rank's comparisons combined (collective)."""
        per_rank = [None] * ctx.world
        dist.all_gather_object(per_rank, (self.max_abs, self.failure, self.compared))
        max_abs = max(r[0] for r in per_rank)
        failures = {rank: r[1] for rank, r in enumerate(per_rank) if r[1]}
        figures = {"max_abs_diff": max_abs, "tensors_compared": sum(r[2] for r in per_rank)}
        if failures:
            rank, msg = next(iter(failures.items()))
            figures["failure"] = {"rank": rank, "message": msg}
            return Result(name, "FAIL", f"{summary}; rank {rank}: {one_line(msg)}", figures)
        return Result(name, "PASS", f"{summary}; max |diff| {max_abs:.2e}", figures)


# ---- check 1: parity -----------------------------------------------------------------------------
def check_parity_fp32(ctx: Ctx) -> list[Result]:
    diffs = Diffs()
    cases = [(kind, opt_kind) for kind in MODELS for opt_kind in OPTIMIZERS]
    for kind, opt_kind in cases:
        ref, model = build(kind, ctx)
        ref_opt, opt = make_optimizer(opt_kind, ref), make_optimizer(opt_kind, model)
        for step in range(ctx.steps):
            what = f"{kind}/{opt_kind} step {step}"
            x, y = batch(kind, step, ctx)
            ref_out = ref(x)
            ref_loss = loss_fn(kind, ref_out, y)
            ref_loss.backward()
            out = model(x[ctx.local])
            loss = loss_fn(kind, out, y[ctx.local])
            loss.backward()
            diffs.compare(f"{what} output", out, ref_out[ctx.local])
            diffs.compare(f"{what} loss", global_mean(loss, ctx), ref_loss.detach())
            for name, p, _, ref_grad in pairs(model, ref):
                diffs.compare(f"{what} grad {name}", p.grad, ref_grad)
            ref_opt.step()
            opt.step()
            for name, p, ref_val, _ in pairs(model, ref):
                diffs.compare(f"{what} param {name}", p.detach(), ref_val)
            ref_opt.zero_grad()
            opt.zero_grad()
            if not agree(diffs.failure is None, ctx):
                break
    summary = (
        f"W={ctx.world} {ctx.device.type}: {len(cases)} cases ({'/'.join(MODELS)} x {'/'.join(OPTIMIZERS)}) "
        f"x {ctx.steps} steps, output/loss/grads/params at fp32 default tolerances"
    )
    return [diffs.result("parity_fp32", ctx, summary)]


def check_parity_bf16(ctx: Ctx) -> list[Result]:
    """Each step restarts the reference from flatshard's parameters, so bf16 rounding does not
    compound and every step is checked on its own (plain SGD: no optimizer state to carry over)."""
    bf16 = torch.bfloat16
    diffs = Diffs()
    for kind in MODELS:
        ref, model = build(kind, ctx, mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32))
        opt = torch.optim.SGD(model.parameters(), lr=BF16_LR)
        for step in range(ctx.steps):
            what = f"{kind} bf16 step {step}"
            with FSDP.summon_full_params(model), torch.no_grad():
                full = dict(model.named_parameters())
                for n, p in ref.named_parameters():
                    p.copy_(full[n])
            x, y = batch(kind, step, ctx)
            low = copy.deepcopy(ref).to(bf16)  # the same casts: bf16 parameters and (floating) inputs
            ref_out = low(x.to(bf16) if x.is_floating_point() else x)
            ref_loss = loss_fn(kind, ref_out, y)
            ref_loss.backward()
            with torch.no_grad():
                for p, q in zip(ref.parameters(), low.parameters()):
                    p.grad = q.grad.float()
                    p.sub_(BF16_LR * p.grad)
            out = model(x[ctx.local])
            loss = loss_fn(kind, out, y[ctx.local])
            loss.backward()
            opt.step()
            diffs.require(out.dtype == bf16, f"{what}: output is {out.dtype}, not bf16")
            diffs.compare(f"{what} output", out, ref_out[ctx.local])  # bf16 default tolerances
            diffs.compare(f"{what} loss", global_mean(loss, ctx), ref_loss.detach(), rtol=1.6e-2, atol=1e-5)
            # Gradients summed over every token (norm weights) round differently when each rank reduces
            # part of the batch: 2.5x bf16's tolerance; the fp32 masters at bf16's rtol, atol lr x grads'.
            for name, p, ref_val, ref_grad in pairs(model, ref):
                diffs.require(p.grad is not None and p.grad.dtype == torch.float32, f"{what}: grad {name} not fp32")
                diffs.compare(f"{what} grad {name}", p.grad, ref_grad, rtol=4e-2, atol=5e-3)
                diffs.compare(f"{what} param {name}", p.detach(), ref_val, rtol=1.6e-2, atol=BF16_LR * 5e-3)
            opt.zero_grad()
            ref.zero_grad()
            if not agree(diffs.failure is None, ctx):
                break
    summary = (
        f"W={ctx.world} {ctx.device.type}: param bf16 / reduce fp32, {'/'.join(MODELS)} x SGD "
        f"x {ctx.steps} steps vs a bf16-cast reference, bf16 tolerances"
    )
    return [diffs.result("parity_bf16", ctx, summary)]


# ---- check 2: CPU offload ------------------------------------------------------------------------
def check_cpu_offload(ctx: Ctx) -> list[Result]:
    if not ctx.cuda:
        return [Result(name, "NOT RUN", "needs CUDA") for name in ("cpu_offload", "cpu_offload_state_dict")]
    diffs, sd_diffs = Diffs(), Diffs()
    cases = [(kind, opt_kind) for kind in MODELS for opt_kind in OPTIMIZERS]
    for kind, opt_kind in cases:
        ref, base = build(kind, ctx)  # base: flatshard without offload, on the GPU
        _, off = build(kind, ctx, cpu_offload=CPUOffload(offload_params=True))
        ref_opt, base_opt, off_opt = (make_optimizer(opt_kind, m) for m in (ref, base, off))

        pinned_on_cpu(off, diffs, f"{kind}/{opt_kind} after wrapping")
        for step in range(ctx.steps):
            what = f"{kind}/{opt_kind} step {step}"
            x, y = batch(kind, step, ctx)
            loss_fn(kind, ref(x), y).backward()
            outs, losses = [], []
            for m in (base, off):
                out = m(x[ctx.local])
                loss = loss_fn(kind, out, y[ctx.local])
                loss.backward()
                outs.append(out)
                losses.append(global_mean(loss, ctx))
            diffs.require(outs[1].device == ctx.device, f"{what}: output on {outs[1].device}, not {ctx.device}")
            diffs.compare(f"{what} output", outs[1], outs[0])
            diffs.compare(f"{what} loss", losses[1], losses[0])
            for (name, p), q in zip(off.named_parameters(), base.parameters()):
                diffs.require(
                    p.grad is not None and p.grad.device.type == "cpu",
                    f"{what}: grad of {name} on {None if p.grad is None else p.grad.device}, not cpu",
                )
                diffs.compare(f"{what} grad {name}", p.grad, q.grad.cpu())
            for o in (ref_opt, base_opt, off_opt):
                o.step()
                o.zero_grad()
            pinned_on_cpu(off, diffs, f"{what}, after the optimizer step")
            for (name, p), q in zip(off.named_parameters(), base.parameters()):
                diffs.compare(f"{what} param {name}", p.detach(), q.detach().cpu())
            if not agree(diffs.failure is None, ctx):
                break
        # FULL_STATE_DICT (the default) under offload: the unwrapped reference's keys and values
        got, want = off.state_dict(), ref.state_dict()
        sd_diffs.require(
            set(got) == set(want),
            f"{kind}/{opt_kind}: state_dict keys differ: "
            f"missing {sorted(set(want) - set(got))}, extra {sorted(set(got) - set(want))}",
        )
        for k in sorted(set(got) & set(want)):
            sd_diffs.compare(f"{kind}/{opt_kind} state_dict[{k!r}]", got[k].detach().cpu(), want[k].detach().cpu())
    summary = (
        f"W={ctx.world}: {len(cases)} cases x {ctx.steps} steps; params pinned on CPU, grads on CPU, "
        f"outputs on {ctx.device}, equal to flatshard without offload at fp32 default tolerances"
    )
    return [
        diffs.result("cpu_offload", ctx, summary),
        sd_diffs.result("cpu_offload_state_dict", ctx, f"{len(cases)} state dicts (FULL) vs the unwrapped reference's"),
    ]


def pinned_on_cpu(model, diffs: Diffs, when: str) -> None:
    """Every parameter the optimizer sees must be a pinned CPU tensor."""
    for name, p in model.named_parameters():
        diffs.require(
            p.device.type == "cpu" and p.is_pinned(), f"{when}: parameter {name} on {p.device}, pinned={p.is_pinned()}"
        )


def check_offload_error(ctx: Ctx) -> list[Result]:
    """On a CPU-only run offload has no accelerator to offload from: a ValueError, not a silent no-op."""
    expected = "offload needs an accelerator compute device"
    try:
        build("tiny_gpt", ctx, cpu_offload=CPUOffload(offload_params=True))
        return [Result("offload_error", "FAIL", "CPUOffload(offload_params=True) on CPU raised nothing")]
    except ValueError as e:
        ok, summary, message = expected in str(e), f"ValueError saying {expected!r}", str(e)
    except Exception as e:  # noqa: BLE001 - the wrong kind of error is this check's failure
        ok, summary, message = False, f"{type(e).__name__} instead of ValueError", str(e)
    if not ok:
        summary += f": {one_line(message)}"
    return [Result("offload_error", "PASS" if ok else "FAIL", summary, {"message": message})]


# ---- check 3: all-gather bandwidth ---------------------------------------------------------------
def check_all_gather(ctx: Ctx, sizes_mib: list[int]) -> list[Result]:
    rows, ok = [], True
    for mib in sizes_mib:
        numel = mib * 2**20 // 4 // ctx.world * ctx.world  # fp32 elements of the gathered (output) buffer
        nbytes = numel * 4
        out = torch.empty(numel, device=ctx.device)
        inp = torch.full((numel // ctx.world,), float(ctx.rank + 1), device=ctx.device)
        for _ in range(WARMUP):
            dist.all_gather_into_tensor(out, inp)
        expected = torch.arange(1, ctx.world + 1, dtype=out.dtype, device=ctx.device)[:, None]
        correct = agree(bool((out.view(ctx.world, -1) == expected).all()), ctx)
        times = []
        for _ in range(ITERS):
            dist.barrier()
            times.append(timed(functools.partial(dist.all_gather_into_tensor, out, inp), ctx))
        t = torch.tensor(times, dtype=torch.float64, device=ctx.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # each iteration takes as long as its slowest rank
        med = statistics.median(t.tolist())
        algbw = nbytes / med / 1e9
        busbw = algbw * (ctx.world - 1) / ctx.world
        ok = ok and correct and med > 0
        rows.append(
            {"mib": mib, "bytes": nbytes, "median_s": med, "algbw_GBps": algbw, "busbw_GBps": busbw, "correct": correct}
        )
    backend = dist.get_backend()
    figures = ", ".join(
        f"{r['mib']} MiB {r['median_s'] * 1e3:.3f} ms algbw {r['algbw_GBps']:.1f} GB/s busbw {r['busbw_GBps']:.1f} GB/s"
        for r in rows
    )
    if ctx.world == 1:
        note = "W=1: a single-rank figure (a local copy on one device), NOT a network or NVLink figure"
    else:
        note = f"W={ctx.world} ranks"
    summary = f"{backend} {ctx.device.type}, median of {ITERS} after {WARMUP} warmup: {figures}; {note}"
    if not all(r["correct"] for r in rows):
        summary += "; gathered data WRONG"
    return [
        Result(
            "all_gather_bw",
            "PASS" if ok else "FAIL",
            summary,
            {"backend": backend, "world_size": ctx.world, "single_rank": ctx.world == 1, "sizes": rows},
        )
    ]


def timed(fn, ctx: Ctx) -> float:
    """Seconds ``fn`` takes: CUDA events on a GPU, the wall clock on CPU."""
    if not ctx.cuda:
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


# ---- driver --------------------------------------------------------------------------------------
def environment(ctx: Ctx) -> dict:
    env = {
        "python": sys.executable,
        "python_version": platform.python_version(),
        "torch": torch.__version__,
        "flatshard": str(Path(sys.modules["flatshard"].__file__).parent),
        "backend": dist.get_backend(),
        "world_size": ctx.world,
        "device": str(ctx.device),
    }
    if ctx.cuda:
        env.update(
            cuda=torch.version.cuda,
            gpu=torch.cuda.get_device_name(),
            gpus_visible=torch.cuda.device_count(),
            nccl=".".join(map(str, torch.cuda.nccl.version())),
            float32_matmul_precision=torch.get_float32_matmul_precision(),
        )
    return env


class OutOfStep(Exception):
    """A check failed on some ranks only, in the middle of collectives: none after it can be trusted."""


def run_check(names: tuple[str, ...], fn, ctx: Ctx) -> list[Result]:
    """``fn``'s results (one per name); an exception on any rank makes each FAIL with that rank's error."""
    t0 = time.perf_counter()
    try:
        results, error = fn(ctx), None
    except Exception as e:  # noqa: BLE001 - any error is this check's failure, reported by every rank
        results, error = [], f"{type(e).__name__}: {e}"
    errors = [None] * ctx.world
    try:  # an error raised on every rank alike (an option not built, say) leaves the ranks in step
        dist.all_gather_object(errors, error)
    except Exception as e:  # noqa: BLE001 - whatever the broken collective raised
        raise OutOfStep(error or f"{type(e).__name__}: {e}") from None
    failed = {rank: e for rank, e in enumerate(errors) if e}
    if failed:
        rank, msg = next(iter(failed.items()))
        results = [Result(name, "FAIL", f"rank {rank} raised {one_line(msg)}", {"errors": failed}) for name in names]
    for r in results:
        r.figures["seconds"] = round(time.perf_counter() - t0, 2)
    return results


def one_line(message: str, limit: int = 300) -> str:
    return " ".join(message.split())[:limit]


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.check", description=__doc__.split("\n")[0])
    ap.add_argument("--cpu", action="store_true", help="dry run on CPU with gloo; CUDA-only checks are not run")
    ap.add_argument("--steps", type=int, default=5, help="training steps per parity case")
    ap.add_argument("--sizes-mib", default="64,256", help="all-gather output sizes in MiB, comma-separated")
    ap.add_argument("--json", default=None, help="where to write the results")
    ap.add_argument("--skip", default="", help="checks not to run (reported NOT RUN), comma-separated")
    args = ap.parse_args()
    cuda = not args.cpu
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if cuda:
        if not torch.cuda.is_available():
            print("FAIL: this torch sees no CUDA device (use --cpu for the dry run)", flush=True)
            return 2
        torch.cuda.set_device(local_rank)
        torch.set_float32_matmul_precision("highest")  # true fp32 products (no TF32) for fp32 tolerances
        dist.init_process_group(
            "nccl", timeout=datetime.timedelta(seconds=120), device_id=torch.device("cuda", local_rank)
        )
    else:
        torch.set_num_threads(1)
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    ctx = Ctx(dist.get_rank(), dist.get_world_size(), cuda, args.steps)
    sizes = [int(s) for s in args.sizes_mib.split(",") if s]
    out_dir = os.environ.get("OUT")
    path = Path(args.json or (Path(out_dir) / "gpu_check.json" if out_dir else ROOT / "bench/results/gpu_check.json"))
    report = {"mode": "cuda" if cuda else "cpu", "environment": environment(ctx), "checks": []}
    if ctx.rank == 0:
        print("environment: " + ", ".join(f"{k}={v}" for k, v in report["environment"].items()), flush=True)

    checks = [
        (("parity_fp32",), check_parity_fp32),
        (("parity_bf16",), check_parity_bf16),
        (("cpu_offload", "cpu_offload_state_dict"), check_cpu_offload),
    ]
    if not cuda:
        checks.append((("offload_error",), check_offload_error))
    checks.append((("all_gather_bw",), functools.partial(check_all_gather, sizes_mib=sizes)))
    for name, fn in (
        ("fronts_eager", fronts.check_fronts_eager),
        ("fronts_compiled", fronts.check_fronts_compiled),
        ("overlap", fronts.check_overlap),
    ):
        checks.append(((name,), functools.partial(fn, timed=timed, Result=Result)))
    in_step = True
    skip = set(filter(None, args.skip.split(",")))
    for names, fn in checks:
        if skip & set(names):
            results = [Result(name, "NOT RUN", "skipped (--skip)") for name in names]
        elif not in_step:
            results = [Result(name, "NOT RUN", "an earlier check left the ranks out of step") for name in names]
        else:
            try:
                results = run_check(names, fn, ctx)
            except OutOfStep as e:
                in_step = False
                if ctx.rank != 0:  # rank 0 may have seen only the broken connection: the cause is here
                    print(f"rank {ctx.rank}: {names[0]}: {e}", file=sys.stderr, flush=True)
                results = [
                    Result(name, "FAIL", f"failed on some ranks only, ranks out of step: {one_line(str(e))}")
                    for name in names
                ]
        for r in results:
            report["checks"].append(vars(r))
            if ctx.rank == 0:
                seconds = f" ({r.figures['seconds']:.1f} s)" if "seconds" in r.figures else ""
                print(f"{r.status:7} {r.name}: {r.summary}{seconds}", flush=True)
                path.parent.mkdir(parents=True, exist_ok=True)
                # written after each check, so a run stopped by a hang keeps what came before
                path.write_text(json.dumps(provenance.stamp(report), indent=2, default=str) + "\n")
    failed = [c["name"] for c in report["checks"] if c["status"] == "FAIL"]
    report["passed"] = not failed
    if ctx.rank == 0:
        path.write_text(json.dumps(provenance.stamp(report), indent=2, default=str) + "\n")
        counts = {s: sum(c["status"] == s for c in report["checks"]) for s in ("PASS", "FAIL", "NOT RUN")}
        which = f" ({', '.join(failed)})" if failed else ""
        print(
            f"{'FAIL' if failed else 'PASS'}: {counts['PASS']} passed, {counts['FAIL']} failed, "
            f"{counts['NOT RUN']} not run{which}; results in {path}",
            flush=True,
        )
    if in_step:  # (a process group whose ranks fell out of step may hang on the way down)
        dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
