"""The GPU check's comparisons with PyTorch's FSDP2 (bench/gpu/check.py runs them):

  fronts_eager     flatshard's FSDP1 wrapper, flatshard's fully_shard and PyTorch's FSDP2 on the same GPT,
                   same batches: losses agree (fp32: 1e-4 relative), step time each, ratios to FSDP2
  fronts_compiled  the same with every Block compiled (inductor; before auto-wrap for the FSDP1 wrapper,
                   after sharding for fully_shard and FSDP2): losses agree with the eager FSDP2's within
                   2e-3 relative, no graph compiled after the first step, step times and ratios
  overlap          (CUDA, W >= 2) a torch.profiler trace of steps of each system: the fraction of the
                   collective kernels' time that runs under compute kernels (hidden), per system

On the GPU the model is examples/gpt.py's 30M GPT; in the CPU dry run the tiny one.
"""

from __future__ import annotations

import statistics

import torch
import torch.distributed as dist
import torch.nn.functional as F

SYSTEMS = ("flatshard", "flatshard fully_shard", "FSDP2")
FP32_RTOL, COMPILED_RTOL = 1e-4, 2e-3


def _config(cuda: bool):
    from examples import gpt

    if cuda:
        return gpt, gpt.GPTConfig(layers=6, dim=640, heads=10, block_size=64)
    return gpt, gpt.GPTConfig(layers=2, dim=32, heads=2, block_size=32)


def _build(system: str, compiled: bool, device: torch.device, cuda: bool):
    """One system on ``device``, from seed 0 (the same initial weights for all)."""
    import flatshard
    from bench import fsdp2_reference
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    gpt, cfg = _config(cuda)
    torch.manual_seed(0)
    model = gpt.GPT(cfg)
    blocks = list(model.blocks)
    if system == "flatshard":
        if compiled:
            for block in blocks:
                block.compile()
        return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({gpt.Block}), device_id=device if cuda else None)
    model = model.to(device)
    if system == "flatshard fully_shard":
        for block in blocks:
            flatshard.fully_shard(block)
        flatshard.fully_shard(model)
    else:
        model = fsdp2_reference.build_from(model)
    if compiled:
        for block in blocks:
            block.compile()
    return model


def _batches(steps: int, rank: int, device: torch.device, cuda: bool):
    _gpt, cfg = _config(cuda)
    g = torch.Generator().manual_seed(7)
    out = []
    for _ in range(steps):
        x = torch.randint(0, cfg.vocab, (4, cfg.block_size), generator=g)
        out.append(x.roll(rank, 0).to(device))  # each rank its own rows
    return out


def _step(model, opt, x) -> torch.Tensor:
    loss = F.cross_entropy(model(x[:, :-1]).float().flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.detach()


def run_fronts(ctx, timed, Result, compiled: bool) -> list:
    """Each system trained on the same batches, steps interleaved; losses compared, times measured."""
    from torch._dynamo.utils import counters

    steps = max(ctx.steps, 4)
    systems = {name: _build(name, compiled, ctx.device, ctx.cuda) for name in SYSTEMS}
    opts = {name: torch.optim.AdamW(m.parameters(), lr=1e-3) for name, m in systems.items()}
    losses = {name: [] for name in SYSTEMS}
    times = {name: [] for name in SYSTEMS}
    graphs = []
    for i, x in enumerate(_batches(steps, ctx.rank, ctx.device, ctx.cuda)):
        for name in SYSTEMS[i % 3 :] + SYSTEMS[: i % 3]:  # rotated: no system always first
            dist.barrier()
            out = []
            seconds = timed(lambda name=name, x=x, out=out: out.append(_step(systems[name], opts[name], x)), ctx)
            losses[name].append(float(out[0]))
            if i > 0:  # the first step compiles and warms up
                times[name].append(seconds)
        graphs.append(counters["stats"]["unique_graphs"])
    reference = torch.tensor(losses["FSDP2"])
    figures = {"steps": steps, "graphs_after_each_step": graphs}
    ok = True
    for name in SYSTEMS:
        rel = float(((torch.tensor(losses[name]) - reference).abs() / reference.abs()).max())
        figures[name] = {"step_ms_median": 1e3 * statistics.median(times[name]), "max_rel_loss_diff_to_fsdp2": rel}
        ok &= rel <= (COMPILED_RTOL if compiled else FP32_RTOL)
    for name in SYSTEMS[:2]:
        figures[f"{name}/FSDP2"] = figures[name]["step_ms_median"] / figures["FSDP2"]["step_ms_median"]
    recompiled = compiled and graphs[-1] != graphs[0]
    ok &= not recompiled
    summary = ", ".join(f"{n}/FSDP2 {figures[f'{n}/FSDP2']:.2f}" for n in SYSTEMS[:2]) + (
        "; losses agree" if ok else "; LOSSES DIFFER" if not recompiled else "; RECOMPILED after the first step"
    )
    return [Result("fronts_compiled" if compiled else "fronts_eager", "PASS" if ok else "FAIL", summary, figures)]


def check_fronts_eager(ctx, timed, Result) -> list:
    return run_fronts(ctx, timed, Result, compiled=False)


def check_fronts_compiled(ctx, timed, Result) -> list:
    return run_fronts(ctx, timed, Result, compiled=True)


def _intervals(events, pick) -> list[tuple[float, float]]:
    spans = sorted((e.time_range.start, e.time_range.end) for e in events if pick(e))
    merged: list[list[float]] = []
    for start, end in spans:
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _overlap(a: list, b: list) -> float:
    total, j = 0.0, 0
    for start, end in a:
        while j < len(b) and b[j][1] <= start:
            j += 1
        k = j
        while k < len(b) and b[k][0] < end:
            total += max(0.0, min(end, b[k][1]) - max(start, b[k][0]))
            k += 1
    return total


def check_overlap(ctx, timed, Result) -> list:
    """How much of each system's collective time runs under its compute, from the device's own trace."""
    del timed
    if not ctx.cuda or ctx.world < 2:
        return [Result("overlap", "NOT RUN", "needs CUDA and at least 2 GPUs")]
    from torch.profiler import ProfilerActivity, profile

    figures, ok = {}, True
    for name in SYSTEMS:
        model = _build(name, False, ctx.device, True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = _batches(4, ctx.rank, ctx.device, True)
        _step(model, opt, batches[0])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for x in batches[1:]:
                _step(model, opt, x)
            torch.cuda.synchronize()
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        comm = _intervals(kernels, lambda e: "nccl" in e.name.lower())
        compute = _intervals(kernels, lambda e: "nccl" not in e.name.lower())
        comm_us = sum(b - a for a, b in comm)
        hidden = _overlap(comm, compute) / comm_us if comm_us else 0.0
        figures[name] = {"collective_us": comm_us, "hidden_fraction": hidden}
        ok &= comm_us > 0
        del model, opt
    summary = ", ".join(f"{n} {figures[n]['hidden_fraction']:.0%} hidden" for n in SYSTEMS)
    return [Result("overlap", "PASS" if ok else "FAIL", summary, figures)]
