"""When ranks disagree, every rank says so: models that differ, units run in different orders or skipped,
timeouts that name the unit, a rank stopped by SIGSTOP at W = 4 (each of the three others
raises within the collective timeout + 2 s), NaN through every norm of clip_grad_norm_, requires_grad changed after
wrapping, optimizers that are not element-wise, and messages for common mistakes.

Every case runs on all ranks and returns its error message, so the parent checks that each rank raised
the same clear error (never a hang, never a rank aborted inside gloo, never silently mixed parameters).
Cases that could block use a process group with a short timeout of their own."""

from __future__ import annotations

import datetime
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers.cases import PER_RANK, build, make_optimizer
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, OddMLP, TinyGPT
from tests.helpers.util import assert_params_match

SHORT = datetime.timedelta(seconds=6)


def _error(fn) -> str:
    try:
        fn()
    except Exception as e:  # the message is returned so the parent checks it on every rank
        return f"{type(e).__name__}: {e}"
    return "no error"


class Two(nn.Module):
    """Two units of equal size; ``order`` says which runs first."""

    def __init__(self, shapes=((6, 6), (6, 6)), dtype=torch.float32, extra=False):
        super().__init__()
        self.a = nn.Linear(*shapes[0], dtype=dtype)
        self.b = nn.Linear(*shapes[1])
        self.c = nn.Linear(6, 6) if extra else None
        self.order = ("a", "b")

    def forward(self, x):
        for name in self.order:
            x = torch.tanh(getattr(self, name)(x))
        return x


def _wrap(model, **kw):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    return FSDP(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), **kw)


# ---- 1. ranks built different models -----------------------------------------------------------
def fingerprint_worker(rank: int, world: int) -> dict:
    other = rank == world - 1
    cases = {
        "extra_layer": lambda: Two(extra=other),
        "shape": lambda: Two(shapes=((6, 6), (6, 7) if other else (6, 6))),
        "dtype": lambda: Two(dtype=torch.float64 if other else torch.float32),
        "swapped_equal_numel": lambda: Two(shapes=((4, 5), (5, 6)) if other else ((5, 4), (4, 6))),
    }
    out = {name: _error(lambda make=make: _wrap(make())) for name, make in cases.items()}
    # an extra unit: the same modules, but one rank's policy makes one more of them a unit
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import lambda_auto_wrap_policy

    policy = lambda m: isinstance(m, nn.Linear) and (other or m.out_features == 15)  # noqa: E731
    out["extra_unit"] = _error(
        lambda: FSDP(OddMLP(), auto_wrap_policy=lambda m, recurse, n: lambda_auto_wrap_policy(m, recurse, n, policy))
    )
    # keywords that decide what crosses a node: ranks that disagree would send different bytes
    out["ranks_per_node"] = _error(lambda: _wrap(Two(), ranks_per_node=1 if other else world))
    out["compress"] = _error(lambda: _wrap(Two(), ranks_per_node=1, compress_inter_node="int8" if other else None))
    out["same"] = _error(lambda: _wrap(Two()))
    return out


def test_ranks_that_built_different_models_fail_alike_at_wrap():
    results = run_distributed(fingerprint_worker, 2, timeout=120)
    for rank, out in enumerate(results):
        assert out.pop("same") == "no error"
        for case, message in out.items():
            assert message.startswith("ValueError: ranks built different models"), (rank, case, message)
            assert "rank 0" in message and "rank 1" in message, (case, message)
        assert "b.weight" in out["shape"] and "(7, 6)" in out["shape"], out["shape"]
        assert "float64" in out["dtype"], out["dtype"]
        assert "(4, 5)" in out["swapped_equal_numel"] and "(5, 4)" in out["swapped_equal_numel"]
        assert "ranks_per_node=1" in out["ranks_per_node"], out["ranks_per_node"]
        assert "compress_inter_node='int8'" in out["compress"], out["compress"]
    assert results[0] == results[1], "every rank raises the same error"


# ---- 2. units run in different orders, skipped, unused ---------------------------------------------
def order_worker(rank: int, world: int) -> dict:
    group = dist.new_group(list(range(world)), timeout=SHORT)
    out = {}
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(0))

    model = _wrap(Two(), process_group=group)
    model.module.order = ("a", "b") if rank == 0 else ("b", "a")  # equal numel: the sizes cannot tell
    out["reordered"] = _error(lambda: model(x).sum().backward())

    model = _wrap(Two(), process_group=group)
    model.module.order = ("a", "b") if rank == 0 else ("b",)
    out["skipped"] = _error(lambda: model(x).sum().backward())

    class Unused(nn.Module):  # both units run; one rank's loss ignores one of them
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

        def forward(self, x):
            ya, yb = self.a(x), self.b(x)
            return ya.sum() + (yb.sum() if rank == 0 else 0)

    model = _wrap(Unused(), process_group=group)
    out["unused"] = _error(lambda: model(x).backward())
    return out


def test_units_in_different_orders_or_skipped_fail_alike_on_the_first_step():
    results = run_distributed(order_worker, 2, timeout=120, fresh=True)
    for out in results:
        for case in ("reordered", "skipped", "unused"):
            message = out[case]
            assert message.startswith("RuntimeError: ranks ran different units"), (case, message)
            assert "rank 0" in message and "rank 1" in message, (case, message)
        assert "'a'" in out["reordered"] and "'b'" in out["reordered"], out["reordered"]
    assert results[0] == results[1]


def late_skip_worker(rank: int, world: int) -> str:
    """After the first step (no checks any more), a rank skips a unit: the collective times out, and the
    error names the rank, the unit, the phase and the collective."""
    group = dist.new_group(list(range(world)), timeout=SHORT)
    model = _wrap(Two(), process_group=group)
    x = torch.randn(3, 6)
    model(x).sum().backward()
    model.module.order = ("a", "b") if rank == 0 else ("b",)
    return _error(lambda: model(x).sum().backward())


def clip_skip_worker(rank: int, world: int) -> str:
    """One rank skips clip_grad_norm_ and steps on: its peer's norm all-reduce times out with an error
    naming the rank, the collective and the phase."""
    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=2))
    model = _wrap(Two(), process_group=group)
    model(torch.randn(3, 6)).sum().backward()
    return _error(lambda: model.clip_grad_norm_(1.0)) if rank == 0 else "skipped"


def test_a_unit_skipped_later_times_out_with_a_message_naming_it():
    (clip, _), *_ = [run_distributed(clip_skip_worker, 2, timeout=120, fresh=True)]
    assert clip.startswith("RuntimeError: flatshard: rank 0: the clip_grad_norm_ all_reduce"), clip
    assert "optimizer" in clip and "timed out" in clip.lower(), clip
    messages = run_distributed(late_skip_worker, 2, timeout=120, fresh=True)
    for rank, message in enumerate(messages):
        assert message.startswith(f"RuntimeError: flatshard: rank {rank}: the "), message
        assert "unit 'a'" in message or "unit 'b'" in message, message
        assert "forward" in message and ("all_gather" in message or "reduce_scatter" in message), message
        # gloo closes a pair whose receive timed out, so the rank that waited less (it reached the
        # collective later, as on a loaded machine) may see its peer close the connection first
        assert "timed out" in message.lower() or "connection closed by peer" in message.lower(), message
    assert any("timed out" in m.lower() for m in messages), messages


# [Note: the stopped rank's bound]
# A rank stopped by SIGSTOP (hung: alive, its sockets open, never answering) must make every other rank
# raise within the collective timeout. The others reach the collective that waits for it within a few
# milliseconds of the stop (a tiny model, nothing between), and each gives up TIMEOUT after it began to
# wait, or sooner when a peer that gave up first closes its connection; so from the stop, each raises
# after at most TIMEOUT plus the time to reach the collective and to build the error. MARGIN allows 2 s
# for that: a rank of this test is a process on a shared machine of 2 cores, which the scheduler may
# leave waiting that long, and nothing in flatshard is allowed more.
STOP_TIMEOUT = datetime.timedelta(seconds=4)
MARGIN = 2.0


class Stopped(Exception):
    pass


def stop_worker(rank: int, world: int) -> tuple:
    """W = 4: the last rank stops itself (SIGSTOP) at the start of the second step's backward; every other
    rank returns the error it raised and when. A child process continues the stopped rank once the others
    are done (after TIMEOUT + MARGIN + 1 s), so it returns too, with the time it stopped."""
    group = dist.new_group(list(range(world)), timeout=STOP_TIMEOUT)
    model = _wrap(Two(), process_group=group)
    x = torch.randn(3, 6, generator=torch.Generator().manual_seed(rank))
    model(x).sum().backward()  # a first step: the checks of the first step are behind us
    stopped_at = []

    def stop(grad):
        resume = STOP_TIMEOUT.total_seconds() + MARGIN + 1.0  # after every other rank raised, or failed the test
        code = f"import os, signal, time; time.sleep({resume}); os.kill({os.getpid()}, signal.SIGCONT)"
        subprocess.Popen([sys.executable, "-c", code])
        stopped_at.append(time.time())
        os.kill(os.getpid(), signal.SIGSTOP)
        raise Stopped

    loss = model(x).sum()
    if rank == world - 1:
        loss.register_hook(stop)
    message = _error(lambda: loss.backward())
    if stopped_at:
        return "stopped", stopped_at[0]
    return message, time.time()


def test_a_stopped_rank_makes_every_other_rank_raise_within_the_timeout():
    results = run_distributed(stop_worker, 4, timeout=60, fresh=True)
    (what, stopped_at), others = results[-1], results[:-1]
    assert what == "stopped", results
    timeout = STOP_TIMEOUT.total_seconds()
    for rank, (message, raised_at) in enumerate(others):
        assert message.startswith(f"RuntimeError: flatshard: rank {rank}: the "), message
        assert "in backward" in message and "unit " in message, message
        assert "timed out" in message.lower() or "connection closed by peer" in message.lower(), message
        # [Note: the stopped rank's bound]
        assert 0 < raised_at - stopped_at <= timeout + MARGIN, (rank, raised_at - stopped_at, message)
    assert any("timed out" in m.lower() for m, _ in others), others


# ---- 3. groups flatshard creates inherit the timeout ---------------------------------------------
def timeout_worker(rank: int, world: int) -> list:
    from flatshard import ShardingStrategy, testing

    group = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=11))
    model = _wrap(Two(), process_group=group, sharding_strategy=ShardingStrategy.HYBRID_SHARD, sharding_factor=2)
    return [t.total_seconds() for t in testing.group_timeouts(model)]


def test_groups_flatshard_creates_inherit_the_timeout():
    for timeouts in run_distributed(timeout_worker, 4, timeout=120):
        assert timeouts == [11.0, 11.0], timeouts  # the shard group and the replicate group


# ---- 4. non-finite gradients -------------------------------------------------------------------
def nan_worker(rank: int, world: int) -> dict:
    out = {}
    for norm_type in (math.inf, 2.0, 1.0):
        ref, model, batch, loss_fn = build("gpt_tie_in_root", "FULL_SHARD")
        x, y = batch(0, world * PER_RANK)
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        loss_fn(model(x[local]), y[local]).backward()
        loss_fn(ref(x), y).backward()
        grads = [p.grad for p in model.parameters() if p.grad is not None and p.grad.numel()]
        if rank == world - 1:
            grads[0].view(-1)[0] = float("nan")  # one element of one rank's shard
        next(p for p in ref.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5, norm_type)
        norm = model.clip_grad_norm_(0.5, norm_type)
        out[str(norm_type)] = (float(norm), float(ref_norm))
        out[f"raise {norm_type}"] = _error(lambda nt=norm_type: model.clip_grad_norm_(0.5, nt, error_if_nonfinite=True))
    return out


def test_nan_in_one_rank_propagates_through_every_norm():
    for out in run_distributed(nan_worker, 2, timeout=120):
        for norm_type in ("inf", "2.0", "1.0"):
            norm, ref_norm = out[norm_type]
            assert math.isnan(ref_norm) and math.isnan(norm), (norm_type, norm, ref_norm)
            message = out[f"raise {norm_type}"]
            assert message.startswith("RuntimeError: The total norm of order"), message
            assert "error_if_nonfinite=False" in message, message


# ---- 5. requires_grad changed after wrapping ----------------------------------------------------
class Partly(nn.Module):
    """A unit frozen whole (``frozen``), a unit with one frozen parameter (``mixed``), and the root."""

    def __init__(self):
        super().__init__()
        self.frozen = nn.Linear(5, 7)
        self.mixed = nn.Linear(7, 3)
        self.scale = nn.Parameter(torch.ones(3))
        self.frozen.requires_grad_(False)
        self.mixed.bias.requires_grad_(False)

    def forward(self, x):
        return self.mixed(torch.tanh(self.frozen(x))) * self.scale


def unfreeze_worker(rank: int, world: int) -> int:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = Partly()
    torch.manual_seed(0)
    model = FSDP(Partly(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    steps = 0
    for step in range(4):
        if step == 1:  # unfreeze everything, on every rank, after wrapping
            for m in (ref, model):
                m.requires_grad_(True)
        ref_opt = torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1, momentum=0.9)
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * PER_RANK, 5, generator=g), torch.randn(world * PER_RANK, 3, generator=g)
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(model(x[local]), y[local]).backward()
        ref_opt.step(), opt.step(), ref_opt.zero_grad(), opt.zero_grad()
        assert_params_match(model, ref, f"unfreeze step {step}")
        steps += 1
    return steps


def test_requires_grad_changed_after_wrapping_is_honoured():
    assert run_distributed(unfreeze_worker, 2, timeout=120) == [4, 4]


# ---- 6. optimizers that are not element-wise ---------------------------------------------------------
def optimizer_worker(rank: int, world: int) -> dict:
    out = {}
    _, model, _, _ = build("odd_mlp", "FULL_SHARD")
    matrices = [p for p in model.parameters() if len(p.orig_shape) == 2]
    out["Muon at construction"] = _error(lambda: torch.optim.Muon(matrices, lr=0.01))  # torch checks p.ndim itself
    for name in ("Adafactor", "LBFGS"):
        _, model, batch, loss_fn = build("odd_mlp", "FULL_SHARD")
        opt = getattr(torch.optim, name)(model.parameters(), lr=0.01)
        x, y = batch(0, PER_RANK)

        def closure():
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            return loss

        out[name] = _error(lambda: (closure(), opt.step(closure)))
    _, model, batch, loss_fn = build("odd_mlp", "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    x, y = batch(0, PER_RANK)
    loss_fn(model(x), y).backward()
    out["adamw"] = _error(opt.step)
    return out


def test_optimizers_that_need_whole_tensors_fail_alike_at_their_first_step():
    results = run_distributed(optimizer_worker, 2, timeout=120)
    for out in results:
        assert out.pop("adamw") == "no error"
        muon = out.pop("Muon at construction")
        assert muon.startswith("ValueError: Muon only supports 2D parameters"), muon
        for name, message in out.items():
            assert message.startswith(f"NotBuiltError: torch.optim.{name} "), (name, message)
            assert "element-wise" in message, message
    assert results[0] == results[1]


# ---- 8. messages --------------------------------------------------------------------------------
def messages_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    return {
        "class_as_policy": _error(lambda: FSDP(TinyGPT(), auto_wrap_policy=nn.Linear)),
        "block_class": _error(lambda: FSDP(TinyGPT(), auto_wrap_policy=Block)),
        "mixed_dtypes": _error(lambda: FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))),
    }


def test_common_mistakes_get_messages_that_say_what_to_do():
    for out in run_distributed(messages_worker, 2, timeout=60):
        for key in ("class_as_policy", "block_class"):
            assert out[key].startswith("TypeError: auto_wrap_policy="), out[key]
            assert "ModuleWrapPolicy({" in out[key], out[key]
        assert "0.weight" in out["mixed_dtypes"] and "1.weight" in out["mixed_dtypes"], out["mixed_dtypes"]
        assert "torch.float64" in out["mixed_dtypes"], out["mixed_dtypes"]


def test_the_failures_guide_says_the_bound_the_stop_test_asserts():
    page = " ".join((Path(__file__).resolve().parents[1] / "docs" / "how-to" / "failures.md").read_text().split())
    assert f"at W = 4 in the suite each of the three other ranks raises within the timeout plus {MARGIN:g} s" in page
