"""The two training tests that failed once in three conformance runs, measured: their numerical margin and
their wall time, on PyTorch's FSDP2 and on flatshard, at a chosen load.

    python tests/conformance/flaky_pair.py --runs 3 --load 0 4 16

``test_1f1b_microbatching`` and ``test_register_fsdp_forward_method`` (test_fully_shard_training.py)
compare a sharded model with an unsharded copy by ``assertEqual``: fp32 within ``atol + rtol * |ref|``
(1e-5, 1.3e-6). A test of that kind fails for one of two reasons: a value past that tolerance, or the
harness's time limit (run.py's ``--timeout``). This tool tells them apart. It rebuilds each test's
scenario from its description (the same models from the wheel's ``torch.testing._internal`` helpers,
the same seeds, shapes, optimizer and calls; it is not a copy of the test file, which this repository
does not hold), and for each run reports

- the margin: the largest ``|value - ref| / (atol + rtol * |ref|)`` over every loss, parameter and
  gradient the test compares (a test fails on values when it exceeds 1; 0 means bitwise equal);
- the wall time of the run as the harness sees it: two fresh processes started, the test run, both
  ended (``--load K`` keeps K busy processes beside them, as other jobs on a shared machine do).

Each run is two gloo processes on CPU (the conformance world size), for each variant in turn. A run whose
process ends with another code than 0 is printed with the codes: -6 is the abort at exit that the shim's
[Note: a rank that passed leaves without finalizing] describes (these runs end as Python does, so they
show it).
"""

from __future__ import annotations

import argparse
import copy
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path

ATOL, RTOL = 1e-5, 1.3e-6  # assertEqual's float32 tolerances
WORLD = 2
VARIANTS = ("torch", "flatshard")
TESTS = ("test_1f1b_microbatching", "test_register_fsdp_forward_method")


def _margin(value, ref) -> float:

    value, ref = value.detach().double(), ref.detach().double()
    return float(((value - ref).abs() / (ATOL + RTOL * ref.abs())).max())


def _full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _api(variant: str):
    if variant == "flatshard":
        import flatshard

        return flatshard.fully_shard, flatshard.FSDPModule, flatshard.register_fsdp_forward_method
    from torch.distributed.fsdp import FSDPModule, fully_shard, register_fsdp_forward_method

    return fully_shard, FSDPModule, register_fsdp_forward_method


def _parity(model, ref_model) -> float:
    """check_sharded_parity's comparison, as a margin: every parameter and gradient, full tensors."""
    worst = 0.0
    for param, ref in zip(model.parameters(), ref_model.parameters(), strict=True):
        worst = max(worst, _margin(_full(param), ref))
        if ref.grad is not None:
            worst = max(worst, _margin(_full(param.grad), ref.grad))
    return worst


def one_f_one_b(variant: str, rank: int) -> float:
    """The 1f1b schedule of test_1f1b_microbatching: three micro-batches, gradients reduced on the last,
    every subtest (explicit unshard ahead, resharding after backward on or off)."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed._tensor.common_dtensor import ModelArgs, Transformer, TransformerBlock

    fully_shard, fsdp_module, _ = _api(variant)
    worst = 0.0
    for explicit_unshard in (False, True):
        for reshard_after_backward in (False, True):
            torch.manual_seed(42)
            args = ModelArgs(dropout_p=0.0)
            model = Transformer(args)
            ref_model = copy.deepcopy(model)
            ref_optim = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
            for module in model.modules():
                if isinstance(module, TransformerBlock):
                    fully_shard(module, reshard_after_forward=False)
            fully_shard(model, reshard_after_forward=False)
            optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
            torch.manual_seed(42 + rank + 1)
            inputs = [torch.randint(0, args.vocab_size, (2, 16)) for _ in range(3)]
            if explicit_unshard:
                for module in model.modules():
                    if isinstance(module, fsdp_module):
                        module.unshard(async_op=True)
            losses, ref_losses = [], []
            for index, inp in enumerate(inputs):
                last = index == len(inputs) - 1
                model.set_requires_gradient_sync(last)
                model.set_is_last_backward(last)
                if not reshard_after_backward:
                    model.set_reshard_after_backward(last)
                losses.append(model(inp).sum())
                losses[-1].backward()
                ref_losses.append(ref_model(inp).sum())
                ref_losses[-1].backward()
            for param in ref_model.parameters():
                dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
            worst = max([worst] + [_margin(a, b) for a, b in zip(losses, ref_losses, strict=True)])
            optim.step()
            ref_optim.step()
            worst = max(worst, _parity(model, ref_model))
    return worst


def register_forward_method(variant: str, rank: int) -> float:
    """test_register_fsdp_forward_method's model: a patch projection run through a method that is not
    forward (registered), a projector after it; one forward and backward against the unsharded copy."""
    import torch
    import torch.distributed as dist
    from torch import nn

    fully_shard, _, register = _api(variant)

    class Vision(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.patch_proj = nn.Conv2d(3, 1024, kernel_size=14, stride=14)

        def forward_features(self, imgs):
            return self.patch_proj(imgs).flatten(2).transpose(1, 2)

        def forward(self, imgs):
            return self.forward_features(imgs).sum(dim=1)

    class Model(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.vit, self.projector = Vision(), nn.Linear(1024, 256)

        def forward(self, imgs):
            return self.projector(self.vit.forward_features(imgs))

    torch.manual_seed(42)
    model = Model()
    ref_model = copy.deepcopy(model)
    fully_shard(model.vit)
    fully_shard(model.projector)
    fully_shard(model)
    register(model.vit, "forward_features")
    torch.manual_seed(42 + rank + 1)
    inp = torch.randn(4, 3, 224, 224)
    ref_loss = ref_model(inp).sum()
    loss = model(inp).sum()
    worst = _margin(loss, ref_loss)
    ref_loss.backward()
    loss.backward()
    for param in ref_model.parameters():
        dist.all_reduce(param.grad, op=dist.ReduceOp.AVG)
    return max(worst, _parity(model, ref_model))


SCENARIOS = {"test_1f1b_microbatching": one_f_one_b, "test_register_fsdp_forward_method": register_forward_method}


def _rank(rank: int, variant: str, test: str, store: str, out: str) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    start = time.perf_counter()
    margin = SCENARIOS[test](variant, rank)
    body = time.perf_counter() - start
    worst = torch.tensor([margin, body], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's comparisons count, as in the test
    if rank == 0:
        Path(out).write_text(json.dumps({"margin": worst[0].item(), "body_s": worst[1].item()}))
    dist.destroy_process_group()


def _busy() -> None:
    while True:
        pass


def run_once(variant: str, test: str) -> dict:
    """Two fresh processes, as FSDPTest starts them: the wall time includes their start and imports."""
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out.json")
        start = time.perf_counter()
        procs = [ctx.Process(target=_rank, args=(r, variant, test, store, out)) for r in range(WORLD)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        wall = time.perf_counter() - start
        codes = [proc.exitcode for proc in procs]
        if any(codes) or not os.path.exists(out):
            return {"wall_s": wall, "error": f"exit codes {codes}"}
        return {"wall_s": wall, **json.loads(Path(out).read_text())}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="runs of each test on each variant at each load")
    parser.add_argument("--load", type=int, nargs="+", default=[0], help="busy processes beside the runs")
    parser.add_argument("--json", type=Path, help="also write every run here")
    args = parser.parse_args()
    rows = []
    print(
        f"{'load':>4} {'test':<34} {'variant':<9} {'runs':>4} {'wall s (min-max)':>17} {'max margin':>11}"
        f" {'1-min load':>10}"
    )
    for load in args.load:
        busy = [mp.get_context("spawn").Process(target=_busy, daemon=True) for _ in range(load)]
        for proc in busy:
            proc.start()
        try:
            for test in TESTS:
                for variant in VARIANTS:
                    runs = []
                    for _ in range(args.runs):  # the variants' runs are not interleaved: each is a block
                        runs.append(run_once(variant, test))
                        rows.append(
                            {"load": load, "test": test, "variant": variant, "load1": os.getloadavg()[0], **runs[-1]}
                        )
                    walls = [r["wall_s"] for r in runs]
                    errors = [r["error"] for r in runs if "error" in r]
                    margin = max((r["margin"] for r in runs if "margin" in r), default=float("nan"))
                    note = f"  {len(errors)} failed: {errors[0]}" if errors else ""
                    print(
                        f"{load:>4} {test:<34} {variant:<9} {len(runs):>4} {min(walls):>8.1f}-{max(walls):<8.1f}"
                        f" {margin:>11.3g} {os.getloadavg()[0]:>10.1f}{note}",
                        flush=True,
                    )
        finally:
            for proc in busy:
                proc.kill()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
