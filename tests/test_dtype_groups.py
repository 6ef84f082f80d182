"""Frozen parameters of other dtypes in one ``fully_shard`` call: one flat group per dtype ([Note: a flat
group per dtype], runtime/build/grouping.py), against PyTorch's FSDP2 on the same script at W = 2 and W = 3.

Each block and the root hold trainable fp32 layers beside a frozen bf16 layer (the root a frozen bf16
embedding) and a frozen fp32 LayerNorm (held in the trainable dtype's group); a second model holds
trainable bf16 weights beside a frozen fp32 scale. Checked every step, with SGD-momentum and AdamW:
losses and every local shard equal FSDP2's (bitwise where noted), frozen parameters unchanged and of
their dtype, collectives per step equal to one all-gather per flat group per pass and one reduce-scatter
per trainable group per backward. Also: ``flatshard.units`` reports each group, trainable parameters of
two dtypes raise AssertionError on every rank as FSDP2's do, a meta-built model materialised with
``to_empty`` + ``reset_parameters`` trains, and DCP round-trips the model's state dict."""

from __future__ import annotations

import copy
import os

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.helpers.dist import raised, run_distributed

VOCAB, DIM, HIDDEN, STEPS, PER_RANK = 37, 14, 15, 3, 3


class Block(nn.Module):
    """Trainable fc1, fc2 and a frozen norm in the model's dtype; a frozen ``proj`` in ``frozen_dtype``."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.fc1 = nn.Linear(DIM, HIDDEN)
        self.fc2 = nn.Linear(HIDDEN, DIM)
        self.proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        y = self.fc2(torch.tanh(self.fc1(self.norm(x))))
        return x + y + self.proj(x.to(self.proj.weight.dtype)).to(x.dtype)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, idx):
        h = self.emb(idx).to(self.head.weight.dtype)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def frozen_low(model: Net) -> Net:
    """fp32 trainable layers; frozen bf16 ``emb`` and ``proj``s, frozen fp32 norms."""
    for m in [model.emb, *(b.proj for b in model.blocks)]:
        m.to(torch.bfloat16).requires_grad_(False)
    for b in model.blocks:
        b.norm.requires_grad_(False)
    return model


def frozen_high(model: Net) -> Net:
    """bf16 trainable layers; every block's norm frozen and kept in fp32 (its own flat group)."""
    model.to(torch.bfloat16)
    for b in model.blocks:
        b.norm.float().requires_grad_(False)
    return model


MODELS = {"frozen_low": frozen_low, "frozen_high": frozen_high}


def _shard(model: Net, shard, mp=None) -> Net:
    kw = {} if mp is None else {"mp_policy": mp}
    for block in model.blocks:
        shard(block, **kw)
    shard(model, **kw)
    return model


def _pair(kind: str, mp_dtype=None, seed: int = 0):
    """(PyTorch FSDP2's model, flatshard's), from the same initial weights."""
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    torch.manual_seed(seed)
    base = MODELS[kind](Net())
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    policies = (None, None)
    if mp_dtype is not None:
        policies = tuple(
            p(param_dtype=mp_dtype, reduce_dtype=torch.float32)
            for p in (torch_fsdp.MixedPrecisionPolicy, flatshard.MixedPrecisionPolicy)
        )
    return _shard(theirs, torch_fsdp.fully_shard, policies[0]), _shard(ours, flatshard.fully_shard, policies[1])


def _loss(model, x):
    return F.cross_entropy(model(x).flatten(0, 1).float(), x.flatten())


def _locals(model):
    return [(n, p._local_tensor.detach().clone()) for n, p in model.named_parameters()]


def _expected_comms(infos) -> dict:
    """One all-gather per flat group per pass (the root stays gathered for backward), one reduce-scatter
    per trainable group per backward, none for a frozen group."""
    return {
        "forward all_gather": sum(len(u.flat_groups) for u in infos),
        "backward all_gather": sum(len(u.flat_groups) for u in infos if not u.is_root),
        "backward reduce_scatter": sum(g.requires_grad for u in infos for g in u.flat_groups),
    }


def _comms(rec) -> dict:
    return {
        "forward all_gather": rec.count("all_gather", "forward"),
        "backward all_gather": rec.count("all_gather", "backward"),
        "backward reduce_scatter": rec.count("reduce_scatter", "backward"),
    }


def _gather_bytes(infos, world: int) -> float:
    """What one pass's all-gathers send from this rank: each group's shard, in its compute dtype, to W - 1 peers."""
    return float(sum((world - 1) * g.shard_numel * g.compute_dtype.itemsize for u in infos for g in u.flat_groups))


def parity_worker(rank: int, world: int) -> dict:
    import flatshard

    out: dict = {"bitwise": {}, "steps": 0}
    configs = [("frozen_low", None, "sgd"), ("frozen_low", None, "adamw"), ("frozen_high", None, "adamw")]
    configs.append(("frozen_low", torch.bfloat16, "adamw"))
    for kind, mp_dtype, opt_kind in configs:
        what = f"{kind} mp={mp_dtype} {opt_kind}"
        theirs, ours = _pair(kind, mp_dtype)
        infos = flatshard.units(ours)
        frozen = {n for n, p in ours.named_parameters() if not p.requires_grad}
        frozen_before = {n: t for n, t in _locals(ours) if n in frozen}
        assert len(frozen_before) == (7 if kind == "frozen_low" else 4), (what, sorted(frozen_before))

        def make(ps, opt_kind=opt_kind):
            ps = [p for p in ps if p.requires_grad]
            if opt_kind == "sgd":
                return torch.optim.SGD(ps, lr=0.05, momentum=0.9)
            return torch.optim.AdamW(ps, lr=1e-2)

        opts = make(theirs.parameters()), make(ours.parameters())
        bitwise = True
        for step in range(STEPS):
            x = torch.randint(0, VOCAB, (PER_RANK, 8), generator=torch.Generator().manual_seed(100 * step + rank))
            losses = []
            for model, opt in zip((theirs, ours), opts):
                if model is ours:
                    with ours.record_comms(events=True) as rec:
                        loss = _loss(model, x)
                        loss.backward()
                else:
                    loss = _loss(model, x)
                    loss.backward()
                losses.append(loss.item())
                opt.step()
                opt.zero_grad()
            assert _comms(rec) == _expected_comms(infos), (what, step, _comms(rec), _expected_comms(infos))
            sent = sum(e.wire_bytes for e in rec.events if e.kind == "all_gather" and e.phase == "forward")
            assert sent == _gather_bytes(infos, world), (what, sent, _gather_bytes(infos, world))
            # bf16 compute rounds gathered parameters and activations to 8 bits: AdamW moves an element by
            # about lr whatever its gradient's size, so a flipped rounding moves it by up to lr
            tol = {"rtol": 2e-2, "atol": 1.5e-2} if mp_dtype is not None or kind == "frozen_high" else {}
            torch.testing.assert_close(losses[1], losses[0], msg=lambda m: f"{what} step {step}: loss {m}", **tol)
            a, b = _locals(theirs), _locals(ours)
            assert [n for n, _ in a] == [n for n, _ in b]
            for (name, t_a), (_, t_b) in zip(a, b):
                assert t_b.dtype == t_a.dtype and t_b.shape == t_a.shape, (what, name, t_b.dtype, t_a.dtype)
                torch.testing.assert_close(t_b, t_a, msg=lambda m: f"{what} step {step}: {name} {m}", **tol)
            for name, t in b:
                if name in frozen_before:
                    assert torch.equal(t, frozen_before[name]) and t.dtype == frozen_before[name].dtype, (what, name)
            bitwise = (
                bitwise and losses[0] == losses[1] and all(torch.equal(x_a, x_b) for (_, x_a), (_, x_b) in zip(a, b))
            )
            out["steps"] += 1
        out["bitwise"][what] = bitwise
    return out


@pytest.mark.parametrize("world", [2, 3])
def test_frozen_parameters_of_another_dtype_train_as_fsdp2(world):
    for out in run_distributed(parity_worker, world, timeout=300):
        assert out["steps"] == 4 * STEPS, out
        if world == 2:  # fp32 training, the same reduction order as FSDP2's: every step equal to the bit
            assert out["bitwise"]["frozen_low mp=None sgd"] and out["bitwise"]["frozen_low mp=None adamw"], out


class Picked(nn.Module):
    """A frozen integer parameter (column indices) beside a trainable layer."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, HIDDEN)
        self.cols = nn.Parameter(torch.tensor([4, 0, 9, 2, 7]), requires_grad=False)

    def forward(self, x):
        return self.lin(x)[:, self.cols]


def units_worker(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    out = {}
    for mp_dtype in (None, torch.bfloat16):
        _, ours = _pair("frozen_low", mp_dtype)
        out[str(mp_dtype)] = flatshard.units(ours)
    # param_dtype casts floating parameters only: the integer group is gathered as it is, as in FSDP2
    torch.manual_seed(0)
    picked = Picked()
    x = torch.randn(2, DIM)
    outs = []
    for shard, policy in ((torch_fsdp.fully_shard, torch_fsdp.MixedPrecisionPolicy), (flatshard.fully_shard, None)):
        model = copy.deepcopy(picked)
        shard(model, mp_policy=(policy or flatshard.MixedPrecisionPolicy)(param_dtype=torch.bfloat16))
        outs.append(model(x))
    out["integer group"] = [(g.dtype, g.compute_dtype) for g in flatshard.units(model)[0].flat_groups]
    out["integer output"] = torch.equal(outs[0], outs[1]) and outs[1].dtype == torch.bfloat16
    return out


def test_units_report_each_flat_group():
    import flatshard

    for rank, out in enumerate(run_distributed(units_worker, 2, timeout=120)):
        plain, mixed = out["None"], out["torch.bfloat16"]
        assert [u.name for u in plain] == ["<root>", "blocks.0", "blocks.1"]
        block = plain[1]
        assert isinstance(block, flatshard.UnitInfo) and len(block.flat_groups) == 2
        first, frozen = block.flat_groups
        assert isinstance(first, flatshard.FlatGroupInfo)
        # the trainable dtype's group first, with the frozen norm of that dtype
        assert first.param_names == ("norm.weight", "norm.bias", "fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias")
        assert (first.dtype, first.compute_dtype, first.requires_grad) == (torch.float32, torch.float32, True)
        assert frozen.param_names == ("proj.weight",)
        assert (frozen.dtype, frozen.compute_dtype, frozen.requires_grad) == (torch.bfloat16, torch.bfloat16, False)
        assert frozen.numel == DIM * DIM and frozen.shard_numel == 7 * DIM  # ceil(14 / 2) rows of 14
        assert block.param_names == first.param_names + frozen.param_names
        assert (block.numel, block.shard_numel) == (first.numel + frozen.numel, first.shard_numel + frozen.shard_numel)
        assert block.shard_sizes == tuple(a + b for a, b in zip(first.shard_sizes, frozen.shard_sizes))
        assert (block.dtype, block.compute_dtype) == (torch.float32, torch.float32)
        root = plain[0]
        assert [g.param_names for g in root.flat_groups] == [("head.weight", "head.bias"), ("emb.weight",)]
        assert root.flat_groups[1].padded_numel == VOCAB * DIM, root  # 37 rows: 19 on rank 0, 18 on rank 1
        assert root.flat_groups[1].local_numel == (19 if rank == 0 else 18) * DIM
        # param_dtype=bf16 applies to every floating group: the fp32 groups gather in bf16, bf16 stays bf16
        assert [(g.dtype, g.compute_dtype) for g in mixed[1].flat_groups] == [
            (torch.float32, torch.bfloat16),
            (torch.bfloat16, torch.bfloat16),
        ]
        assert out["integer group"] == [(torch.float32, torch.bfloat16), (torch.int64, torch.int64)], out
        assert out["integer output"], out


def errors_worker(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    def two_trainable(shard):
        torch.manual_seed(0)
        model = Net()
        model.blocks[0].proj.to(torch.bfloat16)  # trainable, unlike frozen_low's
        _shard(model, shard)
        return model(torch.randint(0, VOCAB, (2, 8)))  # FSDP2 checks the dtypes at its first forward

    def fsdp1():
        torch.manual_seed(0)
        return flatshard.FullyShardedDataParallel(frozen_low(Net()))

    torch.manual_seed(0)
    mixed = _shard(frozen_low(Net()), flatshard.fully_shard)
    return {
        # flatshard's checkpoints and owned_named_parameters refuse fully_shard models in their own words,
        # also where a unit holds two flat groups
        # flatshard.checkpoint takes fully_shard models now; under a file the directory cannot be made
        "checkpoint": raised(lambda: flatshard.checkpoint.save(os.devnull + "/ckpt", mixed)),
        "owned": raised(lambda: list(flatshard.owned_named_parameters(mixed))),
        "torch": raised(lambda: two_trainable(torch_fsdp.fully_shard)),
        "ours": raised(lambda: two_trainable(flatshard.fully_shard)),
        "fsdp1": raised(fsdp1),
    }


def test_trainable_parameters_of_several_dtypes_raise_on_every_rank():
    for out in run_distributed(errors_worker, 2, timeout=120):
        assert out["torch"].startswith("AssertionError"), out
        assert "FSDP expects uniform original parameter dtype" in out["torch"], out
        assert out["ours"].startswith("MixedDtypeError/TypeError/AssertionError: FSDP expects uniform original"), out
        assert "but got {torch.bfloat16, torch.float32}: the trainable parameters of one fully_shard" in out["ours"]
        assert "(torch.bfloat16: proj.weight; torch.float32: norm.weight, norm.bias, fc1.weight," in out["ours"]
        assert "freeze those of the other dtype" in out["ours"], out
        assert out["checkpoint"].startswith("CheckpointError"), out["checkpoint"]
        assert (
            out["owned"].startswith("ValueError")
            and "['<root>', 'blocks.0', 'blocks.1'] use ['chunks']" in out["owned"]
        ), out
        # the FSDP1 wrapper's flat parameter needs one dtype, frozen or not
        assert out["fsdp1"].startswith("TypeError/") and "holds parameters of several dtypes" in out["fsdp1"], out


def meta_worker(rank: int, world: int, path: str) -> dict:
    """Built on meta, materialised by ``to_empty`` + ``reset_parameters``, three AdamW steps; then a DCP
    save and a load into a model of other weights."""
    import torch.distributed.checkpoint as dcp
    import torch.distributed.fsdp as torch_fsdp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    import flatshard

    def built(shard):
        with torch.device("meta"):
            model = _shard(frozen_low(Net()), shard)
        model.to_empty(device="cpu")
        torch.manual_seed(3)
        for m in model.modules():
            if hasattr(m, "reset_parameters"):
                m.reset_parameters()
        return model

    theirs, ours = built(torch_fsdp.fully_shard), built(flatshard.fully_shard)
    out = {"dtypes": sorted({str(p.dtype) for p in ours.parameters()})}
    out["init equal"] = all(
        torch.equal(a.full_tensor(), b.full_tensor()) for a, b in zip(theirs.parameters(), ours.parameters())
    )
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (theirs, ours)]
    losses = []
    for step in range(STEPS):
        x = torch.randint(0, VOCAB, (PER_RANK, 8), generator=torch.Generator().manual_seed(step + 7 * rank))
        for model, opt in zip((theirs, ours), opts):
            loss = _loss(model, x)
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    out["losses equal"] = losses[0::2] == losses[1::2]
    out["trained"] = all(
        torch.equal(a.to_local(), b.to_local()) for a, b in zip(theirs.parameters(), ours.parameters())
    )

    saved = {k: v.full_tensor() for k, v in get_model_state_dict(ours).items()}
    dcp.save({"model": get_model_state_dict(ours)}, checkpoint_id=path)
    torch.manual_seed(5)
    other = _shard(frozen_low(Net()), flatshard.fully_shard)  # other weights: the load must overwrite them
    sd = {"model": get_model_state_dict(other)}
    dcp.load(sd, checkpoint_id=path)
    set_model_state_dict(other, sd["model"])
    loaded = {k: v.full_tensor() for k, v in get_model_state_dict(other).items()}
    out["round trip"] = saved.keys() == loaded.keys() and all(
        torch.equal(saved[k], loaded[k]) and saved[k].dtype == loaded[k].dtype for k in saved
    )
    x = torch.randint(0, VOCAB, (PER_RANK, 8))
    out["loaded loss"] = _loss(other, x).item() == _loss(ours, x).item()
    return out


def test_meta_built_model_trains_and_round_trips_through_dcp(tmp_path):
    for out in run_distributed(meta_worker, 2, str(tmp_path / "dcp"), timeout=200):
        assert out["dtypes"] == ["torch.bfloat16", "torch.float32"], out
        assert out["init equal"] and out["losses equal"] and out["trained"], out
        assert out["round trip"] and out["loaded loss"], out
