"""What several test files train and compare: the parity cases (a wrapped model beside its unwrapped
reference, the optimizers, the checked loop), the state-dict and checkpoint loops and comparisons, the
planner's measured step, and the FSDP2 pair of ``fully_shard`` models."""

from __future__ import annotations

import contextlib
import copy
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tests.helpers.models import Block, FrozenTrunk, OddMLP, TinyGPT
from tests.helpers.util import assert_grads_match, assert_params_match

# ---- parity with a single-process reference -------------------------------------------------------
# [Note: five steps]
# Five steps: every moment of AdamW and the momentum of SGD are past their first update (the steps where a
# bias correction, a state created lazily or a buffer reused shows), every step checked. Ten cost twice
# the collectives, and on 2 cores these tests wait on each other's ranks more than they compute: in a
# profile of the W = 3 parity sweep, 60% of a rank's time was spent in collective waits.
STEPS = 5
PER_RANK = 3  # odd micro-batch


def build(kind: str, strategy: str, **fsdp_kwargs):
    """(reference, wrapped, batch(step, global_size) -> (inputs, targets), loss_fn).

    ``fsdp_kwargs`` go to every FullyShardedDataParallel call (groups, sharding_factor, ...)."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy
    from flatshard.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    strat = ShardingStrategy[strategy]
    FSDP = functools.partial(FSDP, **fsdp_kwargs)
    torch.manual_seed(0)
    make = {"odd_mlp": OddMLP, "frozen_nested_manual": FrozenTrunk}.get(kind, TinyGPT)
    ref = make()
    torch.manual_seed(0)
    model = make()
    if kind == "odd_mlp":
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: m is model.fc1)
        wrapped = FSDP(model, sharding_strategy=strat, auto_wrap_policy=policy)
    elif kind == "gpt_tie_in_root":
        wrapped = FSDP(model, sharding_strategy=strat, auto_wrap_policy=ModuleWrapPolicy({Block}))
    elif kind == "gpt_tie_across_units":
        # the embedding and the head become units of their own: their shared weight goes to the root
        wrapped = FSDP(
            model, sharding_strategy=strat, auto_wrap_policy=ModuleWrapPolicy({Block, nn.Embedding, nn.Linear})
        )
    else:  # manual nested wrapping: a frozen unit, and a unit whose module runs twice per forward
        model.trunk = FSDP(model.trunk, sharding_strategy=strat)
        model.shared = FSDP(model.shared, sharding_strategy=strat)
        wrapped = FSDP(model, sharding_strategy=strat)

    def batch(step: int, n: int):
        g = torch.Generator().manual_seed(1000 + step)
        if make is TinyGPT:
            return torch.randint(0, 37, (n, 8), generator=g), torch.randint(0, 37, (n, 8), generator=g)
        d_in, d_out = (7, 3) if make is OddMLP else (5, 2)
        return torch.randn(n, d_in, generator=g), torch.randn(n, d_out, generator=g)

    def loss_fn(out, target):
        if make is TinyGPT:
            return F.cross_entropy(out.flatten(0, 1), target.flatten())
        return F.mse_loss(out, target)

    return ref, wrapped, batch, loss_fn


def make_optimizer(kind: str, model: nn.Module):
    from flatshard import param_groups

    if kind == "sgd_momentum":
        return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=1e-2)


# [Note: one reference per trajectory]
# The reference run_case trains depends only on the model kind, the optimizer and the world size (its
# global batch): not on the strategy or any other keyword of the wrapped model. A worker that runs many
# cases (every strategy, every way to name the groups, every boundary mode) trains each reference once
# inside ``shared_references()``; later cases compare with the recorded outputs, gradients and parameters
# of every step. The comparison is the same; what is saved is the reference's global-batch forward and
# backward, most of a case's time on W ranks of 2 cores.
_REFERENCES: dict | None = None


@contextlib.contextmanager
def shared_references():
    """Inside: run_case records each (kind, optimizer, world) reference's steps once and reuses them."""
    global _REFERENCES
    _REFERENCES = {}
    try:
        yield
    finally:
        _REFERENCES = None


class _Recorded(nn.Module):
    """A reference's parameters (and gradients) at one point of its training, as pairs() reads a module."""

    def __init__(self, ref: nn.Module, grads: bool):
        super().__init__()
        self._named = []
        for name, p in ref.named_parameters():
            q = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            q.grad = None if not grads or p.grad is None else p.grad.detach().clone()
            self._named.append((name, q))

    def named_parameters(self, *args, **kwargs):  # noqa: ARG002 - pairs() asks for all of them
        yield from self._named


def _reference_steps(kind: str, opt_kind: str, world: int, ref: nn.Module, batch, loss_fn):
    """Per step: (the reference's output, it after backward with its gradients, it after the step), trained
    now or, inside shared_references(), recorded by the first case of the same trajectory."""
    key = (kind, opt_kind, world, STEPS)
    if _REFERENCES is not None and key in _REFERENCES:
        yield from _REFERENCES[key]
        return
    shared, ref_opt, recorded = _REFERENCES, make_optimizer(opt_kind, ref), []
    for step in range(STEPS):
        x, y = batch(step, world * PER_RANK)
        ref_out = ref(x)
        loss_fn(ref_out, y).backward()
        after_backward = ref if shared is None else _Recorded(ref, grads=True)  # unshared: read before zero_grad
        ref_opt.step()
        after_step = ref if shared is None else _Recorded(ref, grads=False)
        recorded.append((ref_out.detach(), after_backward, after_step))
        yield recorded[-1]
        ref_opt.zero_grad()
    if shared is not None:
        shared[key] = recorded


def run_case(rank: int, world: int, kind: str, strategy: str, opt_kind: str, **fsdp_kwargs) -> nn.Module:
    """Train ``kind`` for STEPS steps beside its reference, checking every step; returns the wrapped model."""
    ref, model, batch, loss_fn = build(kind, strategy, **fsdp_kwargs)
    frozen_before = {n: p.detach().clone() for n, p in model.named_parameters() if not p.requires_grad}
    opt = make_optimizer(opt_kind, model)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    references = _reference_steps(kind, opt_kind, world, ref, batch, loss_fn)
    for step in range(STEPS):
        what = f"{kind}/{strategy}/{opt_kind} {fsdp_kwargs} W={world} step {step}"
        x, y = batch(step, world * PER_RANK)
        ref_out, ref_after_backward, ref_after_step = next(references)
        out = model(x[local])
        torch.testing.assert_close(out, ref_out[local], msg=lambda m: f"{what}: forward output: {m}")
        loss_fn(out, y[local]).backward()
        assert_grads_match(model, ref_after_backward, what)
        opt.step()
        assert_params_match(model, ref_after_step, what)
        opt.zero_grad()
    for _ in references:  # the reference's last zero_grad, and its recording when shared
        pass
    for n, p in model.named_parameters():
        if not p.requires_grad:
            assert torch.equal(p.detach(), frozen_before[n]), f"{kind}: frozen {n} changed"
            assert p not in opt.state, f"{kind}: frozen {n} has optimizer state"
    for p in opt.state:
        local_numel = p.numel()
        for v in opt.state[p].values():
            if torch.is_tensor(v) and v.dim() > 0:
                assert v.numel() == local_numel, "optimizer state must be shard-sized"
    return model


# ---- state dicts ---------------------------------------------------------------------------------
def train_rank_batches(model, opt, batch, loss_fn, rank, world, steps, start=0, ref=None, ref_opt=None):
    """Steps ``start``.. with each rank on its PER_RANK samples of the global batch (and ``ref`` on all of
    it, when given); returns this rank's losses."""
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, world * PER_RANK)
        loss = loss_fn(model(x[local]), y[local])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if ref is not None:
            loss_fn(ref(x), y).backward()
            ref_opt.step()
            ref_opt.zero_grad()
    return losses


def full_sd(model):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return model.state_dict()


def full_osd(model, opt):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return FSDP.optim_state_dict(model, opt)


def assert_state_equal(a, b, what):
    assert list(a) == list(b), f"{what}: keys differ\n{list(a)}\n{list(b)}"
    for k in a:
        if isinstance(a[k], dict):
            assert_state_equal(a[k], b[k], f"{what}/{k}")
        elif torch.is_tensor(a[k]):
            assert torch.equal(a[k], b[k]), f"{what}: {k} differs"
        else:
            assert a[k] == b[k], f"{what}: {k}: {a[k]} != {b[k]}"


# ---- checkpoints ---------------------------------------------------------------------------------
CHECKPOINT_KIND = "gpt_tie_in_root"
GLOBAL = 12  # samples per step, split evenly over 1, 2, 3 or 4 ranks


def train_global_batch(model, opt, batch, loss_fn, start, steps, group=None):
    """Steps ``start``.. on the global batch split over ``group``; returns the global mean losses."""
    n, rank = dist.get_world_size(group), dist.get_rank(group)
    per = GLOBAL // n
    losses = []
    for step in range(start, start + steps):
        x, y = batch(step, GLOBAL)
        loss = loss_fn(model(x[rank * per : (rank + 1) * per]), y[rank * per : (rank + 1) * per])
        loss.backward()
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean, group=group)
        losses.append(mean.item() / n)
    return losses


def fresh(strategy="FULL_SHARD", **kw):
    """The checkpoint model and its AdamW, initialised differently on every rank: loading must overwrite
    it all."""
    torch.manual_seed(1234 + dist.get_rank())
    _, model, _, _ = build(CHECKPOINT_KIND, strategy, **kw)
    return model, make_optimizer("adamw", model)


def checkpoint_error(fn) -> str:
    """The message of the CheckpointError that calling ``fn`` raises (anything else fails)."""
    from flatshard import CheckpointError

    try:
        fn()
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("expected a CheckpointError")


# ---- the planner against the engine ----------------------------------------------------------------
def third_step(model, rank: int, events: bool = False):
    """Three AdamW steps of the GPT on this rank's batches (zero_grad(set_to_none=False)), measuring the
    third, when gradients and optimizer state exist: (memory recorder, its last sample, comms recorder)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x, y = torch.randint(0, 61, (2, 8), generator=g), torch.randint(0, 61, (2, 8), generator=g)
        opt.zero_grad(set_to_none=False)
        with model.record_memory(opt) as mem, model.record_comms(events=events) as rec:
            mem.reset_peak()
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
            opt.step()
            now = mem.sample()
    return mem, now, rec


# ---- fully_shard against PyTorch's FSDP2 -----------------------------------------------------------
def fsdp2_pair(mesh=None, mp=None, seed=0):
    """(PyTorch FSDP2's model, flatshard's), from the same initial weights, one unit per block and the root."""
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    torch.manual_seed(seed)
    base = TinyGPT()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    for model, shard, policy in (
        (theirs, torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy),
        (ours, flatshard.fully_shard, flatshard.MixedPrecisionPolicy),
    ):
        kw = {"mesh": mesh} if mesh is not None else {}
        if mp is not None:
            kw["mp_policy"] = policy(param_dtype=mp, reduce_dtype=torch.float32)
        for block in model.blocks:
            shard(block, **kw)
        shard(model, **kw)
    return theirs, ours


def token_loss(model, x):
    """Cross-entropy of the GPT predicting its own input tokens, in fp32 whatever the compute dtype."""
    return F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())
