"""The loops people really write: a step that raises and is skipped, fused and foreach optimizers, edits of
the parameters between steps, long gradient accumulation in low precision, clipping beside ignored
parameters, fp16 reductions over many ranks.

Each case trains beside a single-process reference that does what the loop does (skips the same batch,
makes the same edit) and compares every step: losses, gradients and parameters at PyTorch's default fp32
tolerances; after every step no unit is left gathered."""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import raised, run_distributed
from tests.helpers.models import Block, TinyGPT

PER_RANK = 2
STEPS = 4


class Boom(Exception):
    """What the injected fault raises; the loop catches it and skips the batch."""


class Fault:
    """Raises once, in the forward or the backward of one module, when armed."""

    def __init__(self, module: nn.Module, phase: str):
        self.armed = False
        self.phase = phase
        module.register_forward_hook(self._forward)

    def _forward(self, _module, _args, output):
        if self.phase == "forward" and self.armed:
            self.armed = False
            raise Boom("forward")
        if self.phase == "backward" and torch.is_grad_enabled():
            output.register_hook(self._backward)
        return output

    def _backward(self, grad):
        if self.armed:
            self.armed = False
            raise Boom("backward")
        return grad


def _gpt(layers: int = 3) -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(layers=layers)


def _wrap(model: nn.Module, front: str, strategy: str, prefetch: bool, ranks_per_node):
    """The model under one front end. ``ranks_per_node=1`` puts every rank on a node of its own, so the
    reductions that cross nodes are left in flight ([Note: reductions in flight])."""
    from flatshard import BackwardPrefetch, ShardingStrategy, fully_shard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    if front == "fsdp1":
        return FSDP(
            model,
            sharding_strategy=ShardingStrategy[strategy],
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            backward_prefetch=BackwardPrefetch.BACKWARD_PRE if prefetch else None,
            forward_prefetch=prefetch,
            ranks_per_node=ranks_per_node,
        )
    if ranks_per_node is not None:
        os.environ["LOCAL_WORLD_SIZE"] = str(ranks_per_node)  # the pool restores the environment after the task
    reshard = strategy != "SHARD_GRAD_OP"
    for block in model.blocks:
        fully_shard(block, reshard_after_forward=reshard)
    fully_shard(model, reshard_after_forward=reshard)
    if prefetch:
        blocks = list(model.blocks)
        for a, b in zip(blocks, blocks[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def _compare(model: nn.Module, ref: nn.Module, what: str, grads: bool) -> None:
    """Every parameter (and gradient) this rank holds against its slice of the reference's."""
    from flatshard.testing import shard_ranges

    ranges = shard_ranges(model)
    refp = dict(ref.named_parameters())
    for name, p in model.named_parameters():
        full = refp[name.replace("_checkpoint_wrapped_module.", "")]  # fully_shard keeps the wrapper's name
        a, b = ranges[id(p)]
        mine = _local(p.grad if grads else p.detach()) if (p.grad is not None or not grads) else None
        theirs = full.grad if grads else full.detach()
        if grads and (theirs is None or mine is None):
            assert (theirs is None) == (mine is None), f"{what}: {name}: gradient {mine} vs reference {theirs}"
            continue
        expect = theirs.reshape(-1)[a:b].view(mine.shape)
        torch.testing.assert_close(
            mine, expect, msg=lambda m, n=name: f"{what}: {'grad' if grads else 'param'} {n}: {m}"
        )


def _batch(step: int, world: int):
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randint(0, 37, (world * PER_RANK, 8), generator=g)
    return x, torch.randint(0, 37, (world * PER_RANK, 8), generator=g)


def _loss(out, y):
    return F.cross_entropy(out.flatten(0, 1), y.flatten())


def _assert_nothing_gathered(model: nn.Module, what: str) -> None:
    held = model.memory_bytes()["gathered"]  # unsharded flats, gradients and buffers in flight, kept pieces
    assert held == 0, f"{what}: {held} bytes left gathered or in flight after the step"


def _optimizer(kind: str, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)


# ---- 1. a step that raises, caught by the loop, the batch skipped --------------------------------------
WHERE = ("blocks.0", "blocks.1", "blocks.2", "ln_f")  # the first, a middle and the last block; the root's own


def _reference_trajectory(world: int, bad_step: int, opt_kind: str, shared: dict) -> dict:
    """step -> (the reference after backward, with its gradients; after its optimizer step), for a run that
    skips ``bad_step``'s batch. Recorded once per (bad_step, optimizer) in ``shared``: every fault case with
    those two trains the same reference ([Note: one reference per trajectory], tests/helpers/cases.py)."""
    from tests.helpers.cases import _Recorded

    key = (bad_step, opt_kind)
    if key not in shared:
        ref = _gpt()
        ref_opt, recorded = _optimizer(opt_kind, ref.parameters()), {}
        for step in range(STEPS):
            if step == bad_step:
                continue
            x, y = _batch(step, world)
            _loss(ref(x), y).backward()
            after_backward = _Recorded(ref, grads=True)
            ref_opt.step()
            recorded[step] = (after_backward, _Recorded(ref, grads=False))
            ref_opt.zero_grad()
        shared[key] = recorded
    return shared[key]


def run_fault_case(rank, world, front, strategy, prefetch, ranks_per_node, phase, where, bad_step, opt_kind, shared):
    model = _gpt()
    fault = Fault(model.get_submodule(where), phase)
    model = _wrap(model, front, strategy, prefetch, ranks_per_node)
    opt = _optimizer(opt_kind, model.parameters())
    reference = _reference_trajectory(world, bad_step, opt_kind, shared)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    what = (
        f"{front} {strategy} prefetch={prefetch} ranks_per_node={ranks_per_node} {phase} in {where} at step {bad_step}"
    )
    for step in range(STEPS):
        x, y = _batch(step, world)
        if step == bad_step:  # the loop's guard: catch, drop the batch's gradients, go on
            fault.armed = True
            with pytest.raises(Boom):
                _loss(model(x[local]), y[local]).backward()
            assert not fault.armed, f"{what}: the fault did not fire"
            if phase == "forward":  # every unit resharded as the exception left the forward
                _assert_nothing_gathered(model, f"{what}, right after the forward raised")
            elif front == "fully_shard" and bad_step == 0:  # FSDP2's explicit reset frees at once too
                model.reset_iter_state()
                _assert_nothing_gathered(model, f"{what}, after reset_iter_state()")
            opt.zero_grad()
            continue
        ref_after_backward, ref_after_step = reference[step]
        loss = _loss(model(x[local]), y[local])
        loss.backward()
        _compare(model, ref_after_backward, f"{what}, step {step}", grads=True)
        opt.step()
        _compare(model, ref_after_step, f"{what}, step {step}", grads=False)
        opt.zero_grad()
        _assert_nothing_gathered(model, f"{what}, step {step}")
    return 1


SETTINGS = [  # (strategy, prefetch, ranks_per_node): prefetch on and off, reductions left in flight or not
    ("FULL_SHARD", True, None),
    ("FULL_SHARD", False, 1),
    ("SHARD_GRAD_OP", True, None),
    ("NO_SHARD", False, 1),
]


def fault_worker(rank: int, world: int, front: str) -> int:
    done, shared = 0, {}
    cases = itertools.product(SETTINGS, ("forward", "backward"), WHERE)
    for i, ((strategy, prefetch, per_node), phase, where) in enumerate(cases):
        if front == "fully_shard" and strategy == "NO_SHARD":
            continue  # fully_shard shards over its mesh; NO_SHARD is the FSDP1 wrapper's
        bad_step = i % 2  # the first step (order checks on) and a later one
        opt_kind = ("sgd", "adamw")[i % 2]
        done += run_fault_case(
            rank, world, front, strategy, prefetch, per_node, phase, where, bad_step, opt_kind, shared
        )
    return done


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_a_step_that_raises_is_skipped_and_training_goes_on(front):
    """A forward or backward that raises at the first, a middle or the last unit, caught by the loop: the
    next steps equal the reference that skipped the same batch, every rank, and no unit stays gathered."""
    counts = run_distributed(fault_worker, 2, front, timeout=400)
    assert counts[0] == counts[1] > 0


def accumulation_fault_worker(rank: int, world: int, front: str, phase: str) -> int:
    """Two micro-batches accumulate unreduced, the third raises: the window is lost (the loop zero_grads,
    as the reference does), and the next window's step equals the reference's."""
    from flatshard import FullyShardedDataParallel as FSDP

    ref, model = _gpt(2), _gpt(2)
    fault = Fault(model.get_submodule("blocks.0"), phase)
    model = _wrap(model, front, "SHARD_GRAD_OP", True, None)
    ref_opt, opt = _optimizer("adamw", ref.parameters()), _optimizer("adamw", model.parameters())
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)

    def micro(k: int, sync: bool, model_only: bool = False):
        x, y = _batch(k, world)
        if not model_only:
            (_loss(ref(x), y) / 3).backward()
        if isinstance(model, FSDP) and not sync:
            with model.no_sync():
                (_loss(model(x[local]), y[local]) / 3).backward()
            return
        if not isinstance(model, FSDP):
            model.set_requires_gradient_sync(sync)
        (_loss(model(x[local]), y[local]) / 3).backward()

    micro(0, False, model_only=True)  # the lost window: the reference never sees it
    micro(1, False, model_only=True)
    fault.armed = True
    with pytest.raises(Boom):
        micro(2, True, model_only=True)
    opt.zero_grad()
    _close_window(micro, model, ref, opt, ref_opt, f"{front}: {phase} raised at the end of an accumulation window")
    return 1


def _close_window(micro, model, ref, opt, ref_opt, what: str) -> None:
    """Micro-batches 3 and 4 unsynced, 5 synced, on both models; then both step: gradients and parameters
    compared with the reference's."""
    for k in (3, 4, 5):
        micro(k, k == 5)
    _compare(model, ref, what, grads=True)
    ref_opt.step()
    opt.step()
    _compare(model, ref, what, grads=False)


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_an_accumulation_window_that_raised_is_dropped_whole(front):
    for phase in ("forward", "backward"):
        assert run_distributed(accumulation_fault_worker, 2, front, phase, timeout=200) == [1, 1]


# ---- 2. fused, foreach and for-loop optimizers; the user's own edits between steps ----------------------
OPTIMIZERS = [
    (cls, flags) for cls in ("SGD", "AdamW") for flags in ({"foreach": False}, {"foreach": True}, {"fused": True})
]
STRATEGIES_KEEPING_STATE = [  # (strategy, extra keywords): F < W keeps replicas; pieces keep other replicas' parts
    ("FULL_SHARD", {}),
    ("SHARD_GRAD_OP", {}),
    ("NO_SHARD", {}),
    ("HYBRID_SHARD", {"sharding_factor": 2}),
    ("_HYBRID_SHARD_ZERO2", {"sharding_factor": 2}),
    ("HYBRID_SHARD", {"sharding_factor": 2, "shard_optimizer_across_replicas": True}),
    ("_HYBRID_SHARD_ZERO2", {"sharding_factor": 2, "shard_optimizer_across_replicas": True}),
]


# every optimizer on the strategies whose state outside the parameters the optimizer can leave stale (the
# replicas' pieces), fused AdamW and foreach SGD on the others
CASES_KEEPING_STATE = [
    (s, o)
    for s in STRATEGIES_KEEPING_STATE
    for o in OPTIMIZERS
    if s[1].get("shard_optimizer_across_replicas") or o in (("AdamW", {"fused": True}), ("SGD", {"foreach": True}))
]


def _edit(model: nn.Module, ref: nn.Module, step: int) -> None:
    """The user's own in-place edits between steps, the same element-wise map on both models: through
    ``torch.no_grad()`` (which bumps the version counter) and through ``p.data`` (which does not)."""
    refp = dict(ref.named_parameters())
    for i, (name, p) in enumerate(model.named_parameters()):
        full = refp[name]
        if (i + step) % 2:
            with torch.no_grad():
                p.mul_(0.5).add_(0.01)
                full.mul_(0.5).add_(0.01)
        else:
            p.data.copy_(p.detach() * 0.75 - 0.02)
            full.data.copy_(full.detach() * 0.75 - 0.02)


def optimizer_worker(rank: int, world: int) -> int:
    from tests.helpers.cases import build
    from tests.helpers.util import assert_grads_match, assert_params_match

    done = 0
    for (strategy, kwargs), (cls, flags) in CASES_KEEPING_STATE:
        ref, model, batch, loss_fn = build("gpt_tie_in_root", strategy, **kwargs)
        make = functools.partial(getattr(torch.optim, cls), lr=0.02, **flags)
        ref_opt = make(ref.parameters(), **({"momentum": 0.9} if cls == "SGD" else {}))
        opt = make(model.parameters(), **({"momentum": 0.9} if cls == "SGD" else {}))
        local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
        for step in range(3):
            what = f"{strategy} {kwargs} {cls} {flags} step {step}"
            x, y = batch(step, world * PER_RANK)
            loss_fn(ref(x), y).backward()
            loss_fn(model(x[local]), y[local]).backward()
            assert_grads_match(model, ref, what)
            ref_opt.step()
            opt.step()
            assert_params_match(model, ref, what)
            ref_opt.zero_grad()
            opt.zero_grad()
            if step == 1:
                _edit(model, ref, step)
                assert_params_match(model, ref, what + ", edited")
        # evaluation forwards, each after an edit with no backward in between (the second long after the
        # last optimizer step): what each computes with is the edited model
        for k in (3, 4):
            _edit(model, ref, k)
            x, _y = batch(9 + k, world * PER_RANK)
            with torch.no_grad():
                out, expect = model(x[local]), ref(x)[local]
            torch.testing.assert_close(out, expect, msg=lambda m, w=what, k=k: f"{w}, eval after edit {k}: {m}")
        done += 1
    return done


def test_fused_and_foreach_optimizers_and_edits_between_steps():
    """Every strategy that keeps parameters outside the shard views the optimizer steps (replicas, the
    optimizer across replicas' pieces), with SGD and AdamW for-loop, foreach and fused, and the user's own
    in-place edits: every step equals the reference's."""
    counts = run_distributed(optimizer_worker, 4, timeout=400)
    assert counts == [len(CASES_KEEPING_STATE)] * 4


# ---- 3. long accumulation in low precision ---------------------------------------------------------------
def _grads_full(model) -> list[torch.Tensor]:
    return [p.grad.full_tensor().float() for p in model.parameters()]


def _relative_error(grads: list[torch.Tensor], ref: list[torch.Tensor]) -> float:
    num = sum(float((g - r).pow(2).sum()) for g, r in zip(grads, ref))
    return (num / sum(float(r.pow(2).sum()) for r in ref)) ** 0.5


def accumulation_precision_worker(rank: int, world: int, n: int) -> dict:
    """``n`` micro-batches accumulated under set_requires_gradient_sync(False) with bf16 parameters and an fp32
    reduce dtype, beside PyTorch's FSDP2 and the fp32 single-process reference."""
    import copy

    from tests.helpers.cases import fsdp2_pair, token_loss

    theirs, ours = fsdp2_pair(mp=torch.bfloat16)
    torch.manual_seed(0)
    ref = copy.deepcopy(TinyGPT())
    micro = [torch.randint(0, 37, (world, 8), generator=torch.Generator().manual_seed(k)) for k in range(n)]
    for x in micro:
        (token_loss(ref, x) / n).backward()
    for model in (theirs, ours):
        for k, x in enumerate(micro):
            model.set_requires_gradient_sync(k == n - 1)
            (token_loss(model, x[rank : rank + 1]) / n).backward()
    exact = [p.grad.float() for p in ref.parameters()]
    a, b = _grads_full(theirs), _grads_full(ours)
    return {
        "fsdp2": _relative_error(a, exact),
        "flatshard": _relative_error(b, exact),
        "between": _relative_error(b, a),
    }


@pytest.mark.parametrize("n", [64, pytest.param(256, marks=pytest.mark.slow)])  # 256: [Note: two tiers] (conftest.py)
def test_fully_shard_accumulates_unreduced_gradients_in_the_reduce_dtype(n):
    """As FSDP2 does: the first unsynced micro-batch's gradient is cast to the reduce dtype (fp32) and the
    next ones are added to it there, not summed in bf16 on the gathered parameters. Its error against the
    fp32 reference is then FSDP2's (bf16 accumulation made it 2.5x at 64 micro-batches, 7x at 256)."""
    for out in run_distributed(accumulation_precision_worker, 2, n, timeout=300):
        print(f"{n} micro-batches, relative gradient error against fp32: {out}")
        assert out["flatshard"] <= 1.05 * out["fsdp2"], out
        assert out["between"] == 0.0, f"the gradients equal FSDP2's to the bit: {out}"


def fsdp1_accumulation_worker(rank: int, world: int, n: int) -> bool:
    """The FSDP1 wrapper keeps PyTorch FSDP1's behaviour: no_sync accumulates the unsharded gradient in the
    parameter dtype (FSDP1's flat parameter's .grad, bf16 here), cast to the reduce dtype at the synchronised
    backward. On a group of one rank (nothing summed across ranks) its gradient equals, to the bit, an
    unwrapped bf16 copy's accumulated .grad cast to fp32, and differs from an fp32 accumulation of the same
    bf16 micro-batch gradients."""
    import copy

    import torch.distributed as dist

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision
    from flatshard.wrap import ModuleWrapPolicy

    alone = None
    for r in range(world):  # new_group is collective: every rank makes every singleton group
        group = dist.new_group([r])
        if r == rank:
            alone = group
    base = _gpt(2)
    sim = copy.deepcopy(base).to(torch.bfloat16)
    mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = FSDP(base, process_group=alone, mixed_precision=mp, auto_wrap_policy=ModuleWrapPolicy({Block}))
    micro = [torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(k)) for k in range(n)]
    in_fp32 = [torch.zeros(p.shape) for p in sim.parameters()]
    for k, x in enumerate(micro):
        grads_before = [None if p.grad is None else p.grad.clone() for p in sim.parameters()]
        (_loss(sim(x).float(), x) / n).backward()
        for acc, p, before in zip(in_fp32, sim.parameters(), grads_before):
            acc += (p.grad - (before if before is not None else 0)).float()  # this micro-batch's bf16 gradient
        if k < n - 1:
            with model.no_sync():
                (_loss(model(x).float(), x) / n).backward()
        else:
            (_loss(model(x).float(), x) / n).backward()
    with FSDP.summon_full_params(model, with_grads=True):
        ours = {name: p.grad.clone() for name, p in model.named_parameters()}
    bf16 = {name: p.grad.float() for name, p in sim.named_parameters()}
    fp32 = dict(zip([name for name, _ in sim.named_parameters()], in_fp32))
    assert all(torch.equal(ours[k], bf16[k]) for k in bf16), "the FSDP1 wrapper accumulates in the parameter dtype"
    return not all(torch.equal(ours[k], fp32[k]) for k in fp32)


def test_the_fsdp1_wrapper_accumulates_as_pytorch_fsdp1_does():
    assert run_distributed(fsdp1_accumulation_worker, 2, 16, timeout=200) == [True, True]


# ---- 4. clip_grad_norm_ beside ignored parameters ------------------------------------------------------------
class WithIgnored(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(7, 6)
        self.kept = nn.Linear(6, 6)  # ignored: left whole, its gradient not reduced
        self.b = nn.Linear(6, 3)

    def forward(self, x):
        return self.b(torch.tanh(self.kept(torch.tanh(self.a(x)))))


def clip_ignored_worker(rank: int, world: int) -> dict:
    """Every rank's clip_grad_norm_ returns the same norm when the ignored parameters' gradients differ
    across ranks (each rank's own, unreduced): the managed shards' sum over every rank, plus the ignored
    ones' mean over the ranks; and a NaN in one rank's ignored gradient raises on every rank. Both cases
    ask for ``error_if_nonfinite``: the finite one must return its norm without raising (any exception
    fails this rank, with its traceback), the non-finite one comes back as what it raised."""
    import torch.distributed as dist

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    out = {}
    for nan in (False, True):
        torch.manual_seed(0)
        plain = WithIgnored()
        model = FSDP(plain, ignored_modules=[plain.kept], auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
        x = torch.randn(3, 7, generator=torch.Generator().manual_seed(rank))
        model(x).square().sum().backward()
        if nan and rank == world - 1:
            plain.kept.weight.grad[0, 0] = float("nan")
        ignored = sum(float(p.grad.pow(2).sum()) for p in plain.kept.parameters())
        every = [None] * world
        dist.all_gather_object(every, ignored)
        with FSDP.summon_full_params(model, with_grads=True):
            managed = sum(float(p.grad.pow(2).sum()) for n, p in model.named_parameters() if "kept" not in n)
        expect = (managed + sum(every) / world) ** 0.5
        if nan:
            out[nan] = raised(lambda: model.clip_grad_norm_(1e9, error_if_nonfinite=True))
            continue
        norm = float(model.clip_grad_norm_(1e9, error_if_nonfinite=True))
        out[nan] = norm
        torch.testing.assert_close(norm, expect, msg=lambda m: f"rank {rank}: clip_grad_norm_ {m}")
    return out


def test_clip_grad_norm_beside_ignored_parameters_agrees_on_every_rank():
    results = run_distributed(clip_ignored_worker, 2, timeout=120)
    for r in results:  # finite: a norm (each rank checked it against the formula), not an error
        assert isinstance(r[False], float) and math.isfinite(r[False]) and r[False] > 0, results
    assert results[0][False] == results[1][False], results  # the same norm, to the bit
    for r in results:  # non-finite: torch.nn.utils.clip_grad_norm_'s error, on the rank without the NaN too
        assert r[True].startswith(
            "RuntimeError/Exception/BaseException: The total norm of order 2.0 for gradients from `parameters` "
            "is non-finite"
        ), results


# ---- 5. fp16 reductions over many ranks ---------------------------------------------------------------------
def fp16_reduce_worker(rank: int, world: int, front: str) -> bool:
    """Each rank's gradient is about 3e4 (fp16 holds up to 65504): their sum over W = 4 ranks overflows
    fp16, their mean does not. Divided by a pre-factor before the reduction and the rest after (FSDP1's and
    FSDP2's split for fp16), the mean arrives finite and right."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision, MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    ref, plain = nn.Linear(4, 6), nn.Linear(4, 6)
    plain.load_state_dict(ref.state_dict())
    if front == "fsdp1":
        model = FSDP(plain, mixed_precision=MixedPrecision(reduce_dtype=torch.float16))
    else:
        model = fully_shard(plain, mp_policy=MixedPrecisionPolicy(reduce_dtype=torch.float16))
    x = torch.full((world, 4), 1.0)
    (ref(x).sum() * 3e4 / world).backward()  # the mean over ranks of each rank's loss below
    (model(x[rank : rank + 1]).sum() * 3e4).backward()
    _compare(model, ref, f"{front} fp16 reduce at W = {world}", grads=True)
    return all(bool(torch.isfinite(_local(p.grad)).all()) for p in model.parameters())


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_fp16_reductions_over_many_ranks_do_not_overflow(front):
    assert run_distributed(fp16_reduce_worker, 4, front, timeout=120) == [True] * 4


# ---- found by the fuzzer (python -m bench.fuzz) ----------------------------------------------------------------
class Scale(nn.Module):
    """A gain and a bias read by element-wise products: autograd saves the operands by whether they need a
    gradient, so a recomputation must see the parameters as the forward did."""

    def __init__(self, n: int):
        super().__init__()
        self.gain = nn.Parameter(torch.linspace(0.5, 1.5, n))
        self.bias = nn.Parameter(torch.zeros(n))

    def forward(self, x):
        return torch.tanh(x * self.gain + self.bias)


def recomputed_scale_worker(rank: int, world: int, front: str) -> int:
    """Activation checkpointing of a module inside a unit (applied after wrapping), whose forward multiplies
    by a parameter: backward recomputes it, with the unit's parameters as the forward saw them."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import fully_shard

    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 7), Scale(7), nn.Linear(7, 3))
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 7), Scale(7), nn.Linear(7, 3))
    model = FSDP(plain) if front == "fsdp1" else fully_shard(plain)
    apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Scale))
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (ref, model)]
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(world * 2, 5, generator=g), torch.randn(world * 2, 3, generator=g)
        F.mse_loss(ref(x), y).backward()
        F.mse_loss(model(x[rank * 2 : rank * 2 + 2]), y[rank * 2 : rank * 2 + 2]).backward()
        _compare(model, ref, f"{front} step {step}", grads=True)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        _compare(model, ref, f"{front} step {step}", grads=False)
    return 1


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_a_recomputed_module_inside_a_unit_sees_the_parameters_as_forward_did(front):
    assert run_distributed(recomputed_scale_worker, 2, front, timeout=120) == [1, 1]


def after_raise_worker(rank: int, world: int, front: str, path: str) -> dict:
    """Right after a caught backward exception (before any forward): the model's parameters are its shard
    views, torch's clip_grad_norm_ over them sees every one, and a checkpoint saves."""
    import flatshard

    ref, model = _gpt(2), _gpt(2)
    fault = Fault(model.get_submodule("blocks.0"), "backward")
    model = _wrap(model, front, "FULL_SHARD", False, None)
    opt = _optimizer("adamw", model.parameters())
    x, y = _batch(0, world)
    fault.armed = True
    with pytest.raises(Boom):
        _loss(model(x[rank::world]), y[rank::world]).backward()
    opt.zero_grad()
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in ref.named_parameters()], names
    out = {"params": len(list(model.parameters()))}
    if front == "fsdp1":
        flatshard.checkpoint.save(path, model, opt)
        out["saved"] = True
    else:  # torch's utility over the DTensor parameters: one norm for all, every rank alike
        out["norm"] = float(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    return out


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_right_after_a_backward_raised_the_model_is_whole(front, tmp_path):
    results = run_distributed(after_raise_worker, 2, front, str(tmp_path / "ckpt"), timeout=120)
    n = len(list(_gpt(2).parameters()))
    assert all(r["params"] == n for r in results), results
    assert all(r.get("saved") for r in results) if front == "fsdp1" else results[0]["norm"] == results[1]["norm"]


# ---- 1b. a window the loop gives up on before flatshard sees it -------------------------------------------
def abandoned_window_worker(rank: int, world: int, front: str) -> list[str]:
    """Two micro-batches accumulate unreduced; the third is given up before any unit's hook runs -- its
    backward raises in a hook on the loss, or its loss is not finite and the loop skips the backward --
    and the loop clears the gradients (``zero_grad``, either way) or, for a NaN guard that keeps the window,
    does not. Another case clears one block's parameters mid-window (``p.grad = None``). Each ends with a
    window of three micro-batches and a step, compared with the reference that ran the same loop."""
    from flatshard import FullyShardedDataParallel as FSDP

    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    done = []
    for case in ("loss hook raises", "nan skipped", "nan skipped, zeroed", "nan kept", "one block cleared"):
        ref, model = _gpt(2), _gpt(2)
        model = _wrap(model, front, "SHARD_GRAD_OP", True, None)
        ref_opt, opt = _optimizer("adamw", ref.parameters()), _optimizer("adamw", model.parameters())

        def micro(k: int, sync: bool, give_up: bool = False):
            x, y = _batch(k, world)
            for net, rows in ((ref, slice(None)), (model, local)):
                if isinstance(net, FSDP) and not sync:
                    ctx = net.no_sync()
                else:
                    ctx = contextlib.nullcontext()
                    if net is model and not isinstance(net, FSDP):
                        net.set_requires_gradient_sync(sync)
                with ctx:
                    loss = _loss(net(x[rows]), y[rows]) / 3
                    if not give_up:
                        loss.backward()
                    elif case == "loss hook raises":
                        loss.register_hook(lambda _g: (_ for _ in ()).throw(Boom("loss")))
                        with pytest.raises(Boom):
                            loss.backward()

        def clear(net, names):
            for name, p in net.named_parameters():
                if name.replace("_checkpoint_wrapped_module.", "").startswith(names):
                    p.grad = None

        micro(0, False)
        micro(1, False)
        if case == "one block cleared":
            clear(ref, "blocks.1.")
            clear(model, "blocks.1.")
        else:
            micro(2, False, give_up=True)
            if case != "nan kept":
                set_to_none = case != "nan skipped, zeroed"
                ref_opt.zero_grad(set_to_none=set_to_none)
                opt.zero_grad(set_to_none=set_to_none)
        what = f"{front}: {case}"
        _close_window(micro, model, ref, opt, ref_opt, what)
        _assert_nothing_gathered(model, what)
        done.append(case)
    return done


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_a_window_given_up_before_any_unit_follows_the_loops_zero_grad(front):
    """[Note: an open accumulation window] (grad_state.py): the loop's zero_grad drops what the window
    accumulated inside the units, as it drops an unwrapped model's ``.grad``; without it the window goes on."""
    done = run_distributed(abandoned_window_worker, 2, front, timeout=300)
    assert done[0] == done[1] and len(done[0]) == 5, done


# ---- 1c. a forward with no backward after it, then an edit --------------------------------------------
def forward_without_backward_worker(rank: int, world: int, front: str, strategy: str) -> int:
    """A forward whose backward never reaches a unit (it raises in a hook on the loss; or the loss is not
    finite and the loop skips it) leaves what that forward kept gathered (the root; SHARD_GRAD_OP's
    units). The loop then edits the parameters -- through ``p.data``, and a fused optimizer, neither of
    which bumps a version counter -- and the next forward must compute with the edited parameters."""
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    done = 0
    for case in ("loss hook raises", "nan skipped"):
        ref, model = _gpt(2), _gpt(2)
        model = _wrap(model, front, strategy, False, None)
        ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
        for step in range(3):
            x, y = _batch(step, world)
            ref_loss, loss = _loss(ref(x), y), _loss(model(x[local]), y[local])
            what = f"{front} {strategy} {case} step {step}"
            torch.testing.assert_close(loss, _loss(ref(x)[local], y[local]), msg=lambda m, w=what: f"{w}: {m}")
            if step == 0:  # given up: no gradient, the parameters edited by hand
                if case == "loss hook raises":
                    loss.register_hook(lambda _g: (_ for _ in ()).throw(Boom("loss")))
                    with pytest.raises(Boom):
                        loss.backward()
                ref_opt.zero_grad()
                opt.zero_grad()
                _edit(model, ref, 0)
                continue
            ref_loss.backward()
            loss.backward()
            ref_opt.step()
            opt.step()
            ref_opt.zero_grad()
            opt.zero_grad()
            _compare(model, ref, what, grads=False)
        done += 1
    return done


@pytest.mark.parametrize("front", ["fsdp1", "fully_shard"])
def test_a_forward_with_no_backward_then_an_edit_computes_with_the_edit(front):
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        assert run_distributed(forward_without_backward_worker, 2, front, strategy, timeout=200) == [2, 2]


def clip_in_window_worker(rank: int, world: int) -> str:
    """clip_grad_norm_ while an accumulation window is open: the window's gradients are unreduced inside
    the units, so there is nothing right to clip; every rank raises the same clear error."""
    from flatshard import FullyShardedDataParallel as FSDP

    model = _wrap(_gpt(2), "fsdp1", "FULL_SHARD", False, None)
    x, y = _batch(0, world)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    with model.no_sync():
        _loss(model(x[local]), y[local]).backward()
    assert isinstance(model, FSDP)
    with pytest.raises(RuntimeError, match="accumulation window") as info:
        model.clip_grad_norm_(1.0)
    _loss(model(x[local]), y[local]).backward()  # the synchronised backward closes it: clipping works again
    assert torch.isfinite(model.clip_grad_norm_(1.0))
    return str(info.value)


def test_clip_grad_norm_inside_an_open_window_raises_on_every_rank():
    messages = run_distributed(clip_in_window_worker, 2, timeout=120)
    assert messages[0] == messages[1] and "after the synchronised backward" in messages[0], messages
