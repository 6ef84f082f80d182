"""FSDP2's all-gather extensions on ``flatshard.fully_shard`` ([Note: parameters that gather themselves],
fsdp2/extensions.py): parameters of a tensor subclass whose ``fsdp_pre_all_gather`` /
``fsdp_post_all_gather`` say how they are gathered, trained side by side with PyTorch's FSDP2 on the same
data, every step; the collectives they add, counted against the formula; and the mistakes, raised on
every rank."""

from __future__ import annotations

import copy
import functools
import math

import pytest
import torch
from torch import nn
from torch.autograd.grad_mode import _unsafe_preserve_version_counter
from torch.testing._internal.two_tensor import TwoTensor

from bench.fuzz.gathers import GathersItself  # the fuzzer's wrapper subclass
from tests.helpers.dist import raised, run_distributed


# ---- two extensions: each inner tensor gathered (TwoTensor), and a bf16 gather of an fp32 weight --------
def _padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.size(0) == rows:
        return t
    out = t.new_zeros((rows, *t.shape[1:]))
    out[: t.size(0)].copy_(t)
    return out


def _two_pre(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ARG001 - FSDP2's signature
    rows = -(-outer_size[0] // mesh.size())
    return (_padded(self.a, rows), _padded(self.b, rows)), None


def _two_post(self, outputs, metadata, param_dtype, *, out=None):  # noqa: ARG001 - FSDP2's signature
    a, b = outputs
    if out is not None:
        if a.dtype != param_dtype:
            out.a.copy_(a)
            out.b.copy_(b)
        return None
    return TwoTensor(a, b).to(param_dtype), (a, b)


class Bf16Gathered(GathersItself):
    """An fp32 weight that is all-gathered in bf16 and computes in fp32 (what float8 training does with
    another dtype): bench/fuzz/gathers.py's wrapper subclass, with another gather."""

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ARG002
        rows = -(-outer_size[0] // mesh.size())
        return (_padded(self._data.to(torch.bfloat16), rows),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):  # noqa: ARG002
        (gathered,) = outputs
        if out is not None:  # ``out``: the parameter's rows, without the padding
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(gathered[: out.size(0)])
            return None
        upcast = gathered.to(param_dtype)
        return upcast, (gathered, upcast)


def _block(kind: str) -> nn.Sequential:
    """Linear(15, 7) whose weight (7 x 15: padded at W = 2 and 3) gathers itself, and a plain Linear."""
    block = nn.Sequential(nn.Linear(15, 7), nn.ReLU(), nn.Linear(7, 15))
    w = block[0].weight.detach()
    block[0].weight = nn.Parameter(TwoTensor(w, w.clone()) if kind == "two" else Bf16Gathered(w.clone()))
    return block


def _model(kind: str) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(_block(kind), _block(kind))


def _shard(model: nn.Module, fully_shard, reshard_after_forward: bool, mesh=None) -> None:
    for block in model:
        fully_shard(block, reshard_after_forward=reshard_after_forward, mesh=mesh)
    fully_shard(model, reshard_after_forward=reshard_after_forward, mesh=mesh)


def _plain(t: torch.Tensor) -> torch.Tensor:
    """The values of a local tensor or gradient, as a plain tensor (a TwoTensor's ``b``, its ``a`` being equal)."""
    local = t._local_tensor if hasattr(t, "_local_tensor") else t
    if isinstance(local, TwoTensor):
        assert torch.equal(local.a, local.b)
        return local.b.clone()
    if isinstance(local, Bf16Gathered):
        return local._data.clone()
    return local.detach().clone()


def _hooks_on_two_tensor(on: bool) -> None:
    if on:
        TwoTensor.fsdp_pre_all_gather = _two_pre
        TwoTensor.fsdp_post_all_gather = _two_post
    else:
        for name in ("fsdp_pre_all_gather", "fsdp_post_all_gather"):
            if name in TwoTensor.__dict__:
                delattr(TwoTensor, name)


def parity_worker(rank: int, world: int, kind: str, optim: str, hsdp: bool) -> dict:
    """PyTorch's FSDP2 and flatshard, each over the same model, trained on the same batches: step 1
    accumulates two micro-batches under set_requires_gradient_sync(False). Every step, losses,
    parameters and gradients are compared (PyTorch's default fp32 tolerances; how many were bitwise is
    returned); the last step's collectives are recorded. ``hsdp``: a (2, W/2) mesh, replicate x shard."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import flatshard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    shard_size = world // 2 if hsdp else world

    _hooks_on_two_tensor(kind == "two")
    try:
        out = {"bitwise steps": 0, "steps": 0}
        for reshard in (True, False):
            base = _model(kind)
            theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
            _shard(theirs, torch_fully_shard, reshard, mesh)
            _shard(ours, flatshard.fully_shard, reshard, mesh)
            make = (
                (lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9))
                if optim == "sgd"
                else (lambda ps: torch.optim.AdamW(ps, lr=1e-2, foreach=True))
            )
            opts = [make(m.parameters()) for m in (theirs, ours)]
            for step in range(3):
                gen = torch.Generator().manual_seed(100 * step + rank)
                batches = [torch.randn(3, 15, generator=gen) for _ in range(2 if step == 1 else 1)]
                losses = []
                for model in (theirs, ours):
                    total = 0.0
                    for i, x in enumerate(batches):
                        model.set_requires_gradient_sync(i == len(batches) - 1)
                        if model is ours and step == 2:
                            with ours.record_comms(events=True) as rec:
                                loss = model(x).square().mean()
                                loss.backward()
                        else:
                            loss = model(x).square().mean()
                            loss.backward()
                        total += loss.item()
                    losses.append(total)
                t_grads = [_plain(p.grad) for p in theirs.parameters()]
                o_grads = [_plain(p.grad) for p in ours.parameters()]
                for opt in opts:
                    opt.step()
                    opt.zero_grad()
                t_params = [_plain(p) for p in theirs.parameters()]
                o_params = [_plain(p) for p in ours.parameters()]
                for a, b in zip(t_grads + t_params, o_grads + o_params):
                    torch.testing.assert_close(b, a)
                assert math.isclose(losses[0], losses[1], rel_tol=1.3e-6), losses
                out["steps"] += 1
                out["bitwise steps"] += losses[0] == losses[1] and all(
                    map(torch.equal, t_grads + t_params, o_grads + o_params)
                )
            assert all(
                type(p._local_tensor) is type(q._local_tensor) for p, q in zip(theirs.parameters(), ours.parameters())
            )
        out["comms"] = _comms(rec, shard_size, kind)
        return out
    finally:
        _hooks_on_two_tensor(False)


def _comms(rec, world: int, kind: str) -> dict:
    """The recorded collectives of the extension, next to the formula: per block and pass one all-gather
    of [16-byte status | each input, padded to 16 bytes] per rank, and one reduce-scatter of the padded
    weight gradient in fp32."""
    rows = -(-7 // world)
    inputs = [rows * 15 * (4 if kind == "two" else 2)] * (2 if kind == "two" else 1)
    per_rank = 16 + sum(-(-n // 16) * 16 for n in inputs)
    gathers = [e for e in rec.events if e.kind == "all_gather" and e.tensor_bytes == world * per_rank]
    scatters = [e for e in rec.events if e.kind == "reduce_scatter" and e.tensor_bytes == world * rows * 15 * 4]
    return {
        "forward gathers": sum(e.phase == "forward" for e in gathers),
        "backward gathers": sum(e.phase == "backward" for e in gathers),
        "reduce-scatters": len(scatters),
    }


@pytest.mark.parametrize(
    ("world", "kind", "optim", "hsdp"),
    [(2, "two", "adamw", False), (3, "bf16", "sgd", False), (4, "bf16", "adamw", True)],
)
def test_extensions_train_as_pytorch_fsdp2(world, kind, optim, hsdp):
    for out in run_distributed(parity_worker, world, kind, optim, hsdp, timeout=300):
        assert out["steps"] == 6, out
        if world == 2:  # a sum of two gradients has one order: every step equals FSDP2's to the bit
            assert out["bitwise steps"] == 6, out
        # the last run keeps every block gathered from forward to backward (reshard_after_forward=False):
        # each block's extension is gathered once, in forward, and its gradient reduced once
        assert out["comms"]["forward gathers"] == 2 and out["comms"]["backward gathers"] == 0, out
        assert out["comms"]["reduce-scatters"] == 2, out


def gathers_per_pass_worker(rank: int, world: int) -> dict:  # noqa: ARG001
    """With reshard_after_forward=True each block's extension is gathered in forward and again in backward."""
    import flatshard

    model = _model("bf16")
    _shard(model, flatshard.fully_shard, True)
    x = torch.randn(3, 15)
    model(x).sum().backward()  # the first step records the order
    with model.record_comms(events=True) as rec:
        model(x).sum().backward()
    return _comms(rec, world, "bf16")


def test_a_resharded_extension_is_gathered_again_in_backward():
    for out in run_distributed(gathers_per_pass_worker, 2):
        # the root (the model) holds no parameters; each of the two blocks gathers in both passes
        assert (out["forward gathers"], out["backward gathers"], out["reduce-scatters"]) == (2, 2, 2), out


# ---- mistakes, raised on every rank ------------------------------------------------------------------
def _unpadded_pre(self, mesh, outer_size, outer_stride, module, mp_policy):  # noqa: ARG001
    return (self.a, self.b), None


def mistakes_worker(rank: int, world: int) -> dict:  # noqa: ARG001
    import flatshard

    out = {}
    TwoTensor.fsdp_pre_all_gather = _unpadded_pre
    TwoTensor.fsdp_post_all_gather = _two_post
    try:
        model = _model("two")
        _shard(model, flatshard.fully_shard, True)
        out["unpadded"] = raised(lambda: model(torch.randn(3, 15)))
    finally:
        _hooks_on_two_tensor(False)
    bare = _model("two")  # a tensor subclass whose class has no extension
    _shard(bare, flatshard.fully_shard, True)
    out["no extension"] = raised(lambda: bare(torch.randn(3, 15)))
    plain = nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 5))
    flatshard.fully_shard(plain)
    local = plain[2].weight._local_tensor
    local.fsdp_pre_all_gather = Bf16Gathered.fsdp_pre_all_gather.__get__(local)
    out["set on a plain parameter's local tensor"] = raised(lambda: plain(torch.randn(2, 5)))
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    along_dim_1 = functools.partial(
        flatshard.fully_shard, shard_placement_fn=lambda p: Shard(1) if p.ndim > 1 else None
    )
    out["Shard(1)"] = raised(lambda: along_dim_1(_model("bf16")[0]))
    unnamed = init_device_mesh("cpu", (1, world))
    out["2-D mesh without names"] = raised(lambda: flatshard.fully_shard(_model("bf16")[0], mesh=unnamed))
    return out


def test_mistakes_raise_on_every_rank():
    outs = run_distributed(mistakes_worker, 3)
    for out in outs:
        # at W = 3 only rank 2's shard of the 7 rows is short; every rank raises, naming it
        assert out["unpadded"].startswith("ValueError") and "rank(s) [2]" in out["unpadded"], out
        assert "padded shard size (3, 15)" in out["unpadded"], out
        assert out["no extension"].startswith("NotBuiltError") and "TwoTensor" in out["no extension"], out
        assert "fsdp_pre_all_gather" in out["no extension"], out
        bad = out["set on a plain parameter's local tensor"]
        assert bad.startswith("NotBuiltError") and "2.weight" in bad and "plain parameter" in bad, out
        assert out["Shard(1)"].startswith("NotBuiltError") and "0.weight" in out["Shard(1)"], out
        assert (
            out["2-D mesh without names"].startswith("NotBuiltError")
            and "mesh_dim_names" in out["2-D mesh without names"]
        )


# ---- a step that raised ------------------------------------------------------------------------------
class _Boom(nn.Module):
    """Raises in forward (after the first block gathered its extension) or in backward, when armed."""

    def __init__(self):
        super().__init__()
        self.armed = None

    def forward(self, x):
        if self.armed == "forward":
            raise RuntimeError("boom in forward")
        if self.armed == "backward":
            return _RaiseInBackward.apply(x)
        return x


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):  # noqa: ARG004
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # noqa: ARG004
        raise RuntimeError("boom in backward")


def raised_step_worker(rank: int, world: int, where: str) -> dict:  # noqa: ARG001
    """A loop that catches an exception in step 1 and goes on (zero_grad, next batch) equals, every step
    after, a run that skipped that batch; the extension's parameters are back on the modules. What step 1
    raised comes back as (step, phase, message), forward and backward caught apart: the injected fault, or
    anything else that raised in its place."""
    import flatshard

    runs = []
    caught = []
    for skip in (False, True):
        model = _model("bf16")
        model.insert(1, _Boom())
        _shard(model, flatshard.fully_shard, True)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        for step in range(4):
            x = torch.randn(3, 15, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 1:
                if skip:
                    continue
                model[1].armed = where
                try:
                    y = model(x)
                except RuntimeError as e:
                    caught.append((step, "forward", str(e)))
                else:
                    try:
                        y.sum().backward()
                    except RuntimeError as e:
                        caught.append((step, "backward", str(e)))
                    del y  # as the one-line loop drops it: nothing holds the failed step's graph
                model[1].armed = None
                opt.zero_grad()
                continue
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        registered = all(isinstance(p, torch.distributed.tensor.DTensor) for p in model.parameters())
        runs.append(([_plain(p) for p in model.parameters()], registered))
    (after, registered), (skipped, _) = runs
    return {"equal": all(map(torch.equal, after, skipped)), "registered": registered, "caught": caught}


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_a_step_that_raised_is_skipped(where):
    for out in run_distributed(raised_step_worker, 2, where):
        # the fault fired once, in step 1, in the phase it was armed for, with its own message (the other
        # steps run outside any try: an exception there fails the rank)
        assert out.pop("caught") == [(1, where, f"boom in {where}")], out
        assert out == {"equal": True, "registered": True}, out


def memory_worker(rank: int, world: int) -> dict:  # noqa: ARG001
    """memory_bytes() counts what the extension holds: after a forward that keeps every block gathered,
    each block's flat and its bf16 gather with the fp32 copy made of it; nothing gathered after backward."""
    import flatshard

    model = _model("bf16")
    _shard(model, flatshard.fully_shard, False)
    model(torch.randn(3, 15)).sum().backward()  # the first step gathers and records the order
    loss = model(torch.randn(3, 15)).sum()
    after_forward = model.memory_bytes()["gathered"]
    loss.backward()
    after_backward = model.memory_bytes()["gathered"]
    rows = -(-7 // world)
    flats = sum(u.padded_numel * 4 for u in flatshard.units(model))
    return {"after forward": after_forward == flats + 2 * world * rows * 15 * (2 + 4), "after backward": after_backward}


def test_memory_bytes_counts_what_the_extension_holds():
    for out in run_distributed(memory_worker, 3):
        assert out == {"after forward": True, "after backward": 0}, out


def window_given_up_worker(rank: int, world: int, set_to_none: bool) -> dict:  # noqa: ARG001
    """Step 1 accumulates micro-batch 0 unreduced (set_requires_gradient_sync(False)), then the loop skips
    micro-batch 1 (a non-finite loss: no backward), calls zero_grad and gives the step up: the steps after
    equal a run that never saw step 1, as on an unwrapped model ([Note: an open accumulation window])."""
    import flatshard

    runs = []
    for skip in (False, True):
        model = _model("bf16")
        _shard(model, flatshard.fully_shard, True)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        for step in range(4):
            x = torch.randn(3, 15, generator=torch.Generator().manual_seed(10 * step + rank))
            if step == 1:
                if skip:
                    continue
                model.set_requires_gradient_sync(False)
                model(x).square().mean().backward()
                model.set_requires_gradient_sync(True)
                opt.zero_grad(set_to_none=set_to_none)  # micro-batch 1's loss was not finite: given up
                continue
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        runs.append([_plain(p) for p in model.parameters()])
    return {"equal": all(map(torch.equal, *runs))}


@pytest.mark.parametrize("set_to_none", [True, False])
def test_an_accumulation_window_given_up_follows_the_loops_zero_grad(set_to_none):
    for out in run_distributed(window_given_up_worker, 2, set_to_none):
        assert out == {"equal": True}, out
