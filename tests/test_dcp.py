"""SHARDED state dicts through torch.distributed.checkpoint (DCP), as PyTorch FSDP users write it.

Saved at W = 2 (FULL_SHARD, after AdamW steps), loaded at W = 3 (SHARD_GRAD_OP and NO_SHARD): the
model's and the optimizer's full state equal the saved ones bitwise. Every SHARDED value is a
ShardedTensor whose boxes, over all ranks, cover each parameter exactly once; each rank's local
boxes hold its own elements; a ShardedTensor sharded by columns is refused on every rank alike.
Then the same checkpoint loads, in this process without
torch.distributed, into a plain unwrapped model's state dict of full tensors.
"""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from tests.helpers.cases import assert_state_equal, build, full_osd, full_sd, make_optimizer, train_rank_batches
from tests.helpers.dist import run_distributed
from tests.helpers.models import OddMLP, TinyGPT

CASES = {"odd_mlp": "SHARD_GRAD_OP", "gpt_tie_across_units": "NO_SHARD"}  # model -> strategy loaded into at W = 3


def sharded(model, opt):
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}


def sharded_tensors(sd):
    """(name, ShardedTensor) for every ShardedTensor in a nested state dict."""
    from torch.distributed._shard.sharded_tensor import ShardedTensor

    for key, value in sd.items():
        if isinstance(value, ShardedTensor):
            yield key, value
        elif isinstance(value, dict):
            yield from ((f"{key}/{k}", v) for k, v in sharded_tensors(value))


def check_boxes(sd, want_model, want_optim, group_size):
    """Point 2: the global metadata's boxes cover each tensor exactly once; this rank's local shards are
    the boxes placed on it and hold the full tensor's values there."""
    me = dist.get_rank()
    for name, st in sharded_tensors(sd):
        shape = st.size()
        count = torch.zeros(shape, dtype=torch.int64)
        metas = st.metadata().shards_metadata
        for md in metas:
            count[tuple(slice(o, o + z) for o, z in zip(md.shard_offsets, md.shard_sizes))] += 1
        assert bool((count == 1).all()), f"{name}: boxes overlap or leave a gap: {metas}"
        assert len({md.placement.rank() for md in metas}) <= group_size, name
        local = st.local_shards()
        assert [s.metadata for s in local] == [md for md in metas if md.placement.rank() == me], name
        top, _, rest = name.partition("/")
        full = want_model[rest] if top == "model" else want_optim["state"][rest.split("/")[1]][rest.split("/")[2]]
        for s in local:
            box = tuple(slice(o, o + z) for o, z in zip(s.metadata.shard_offsets, s.metadata.shard_sizes))
            assert torch.equal(s.tensor, full[box]), f"{name}: local box {s.metadata.shard_offsets} holds other values"


def save_worker(rank, world, root):
    import torch.distributed.checkpoint as dcp

    out = {}
    for kind in CASES:
        _, model, batch, loss_fn = build(kind, "FULL_SHARD")
        opt = make_optimizer("adamw", model)
        train_rank_batches(model, opt, batch, loss_fn, rank, world, 2)
        want, want_o = full_sd(model), full_osd(model, opt)
        sd = sharded(model, opt)
        check_boxes(sd, want, want_o, world)
        dcp.save(sd, checkpoint_id=f"{root}/{kind}")
        out[kind] = (want, want_o)
    return out


def load_worker(rank, world, root, saved):
    import torch.distributed.checkpoint as dcp

    in_place = {}
    for kind, strategy in CASES.items():
        want, want_o = saved[kind]
        torch.manual_seed(100 + rank)
        _, model, batch, loss_fn = build(kind, strategy)
        opt = make_optimizer("adamw", model)
        train_rank_batches(model, opt, batch, loss_fn, rank, world, 1, start=5)  # the optimizer has state to load into
        sd = sharded(model, opt)
        dcp.load(sd, checkpoint_id=f"{root}/{kind}")
        # the local boxes are views of the flat shards: DCP has written the parameters already
        in_place[kind] = all(torch.equal(a, want[k]) for k, a in full_sd(model).items())
        from flatshard import FullyShardedDataParallel as FSDP
        from flatshard import StateDictType

        with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(FSDP.optim_state_dict_to_load(model, opt, sd["optim"]))
        assert_state_equal(full_sd(model), want, f"{kind}: model after DCP load at W={world} {strategy}")
        assert_state_equal(full_osd(model, opt), want_o, f"{kind}: optimizer after DCP load at W={world} {strategy}")
        check_boxes(sharded(model, opt), want, want_o, world if strategy != "NO_SHARD" else 1)
    return in_place, column_sharded_error(rank, model)


def column_sharded_error(rank, model) -> str:
    """A ShardedTensor sharded by columns (on rank 1 only) cannot become flat ranges: every rank raises."""
    from torch.distributed._shard.sharded_tensor import (
        Shard,
        ShardedTensor,
        ShardedTensorMetadata,
        ShardMetadata,
        TensorProperties,
    )

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        if rank == 1:
            metas = [ShardMetadata([0, 0], [15, 3], "rank:1/cpu"), ShardMetadata([0, 3], [15, 4], "rank:0/cpu")]
            sd["fc1.weight"] = ShardedTensor._init_from_local_shards_and_global_metadata(
                [Shard(torch.zeros(15, 3), metas[0])],
                ShardedTensorMetadata(metas, torch.Size([15, 7]), TensorProperties()),
            )
        try:
            model.load_state_dict(sd)
        except RuntimeError as exc:
            return str(exc)
    raise AssertionError("a column-sharded ShardedTensor loaded")


def test_dcp_save_w2_load_w3_and_plain(tmp_path: pathlib.Path):
    import torch.distributed.checkpoint as dcp

    saved = run_distributed(save_worker, 2, str(tmp_path), timeout=120)[0]
    results = run_distributed(load_worker, 3, str(tmp_path), saved, timeout=120)
    in_place = [r[0] for r in results]
    assert all(all(r.values()) for r in in_place), f"dcp.load fills the SHARDED boxes in place: {in_place}"
    errors = {r[1] for r in results}
    assert len(errors) == 1 and "not a run of consecutive elements" in errors.pop(), results
    # point 3: the checkpoint loads into a plain model's state dict of full tensors, no torch.distributed
    assert not dist.is_initialized()
    for kind in CASES:
        want = saved[kind][0]
        plain = OddMLP() if kind == "odd_mlp" else TinyGPT()
        sd = {k: torch.zeros_like(v) for k, v in plain.state_dict().items()}
        dcp.load({"model": sd}, checkpoint_id=f"{tmp_path}/{kind}")
        plain.load_state_dict(sd, strict=True)
        assert_state_equal(plain.state_dict(), want, f"{kind}: plain model from the DCP checkpoint")


def zero_dim_worker(rank, world, root):
    """A 0-D parameter (a logit scale): its one element sits on one rank. FULL and SHARDED (through DCP)
    optimizer state load so that the next step runs, into an optimizer with state and without."""
    import torch.distributed.checkpoint as dcp
    from torch import nn

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import StateDictType

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(5, 7)
            self.scale = nn.Parameter(torch.tensor(0.5))

        def forward(self, x):
            return self.fc(x) * self.scale

    def make(seed, steps):
        torch.manual_seed(seed)
        model = FSDP(Scaled())
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        for _ in range(steps):
            model(torch.randn(2, 5)).sum().backward()
            opt.step()
            opt.zero_grad()
        return model, opt

    model, opt = make(0, 2)
    want, want_o = full_sd(model), full_osd(model, opt)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        sd = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, opt)}
        assert isinstance(sd["model"]["scale"], torch.Tensor) and sd["model"]["scale"].shape == ()
        dcp.save(sd, checkpoint_id=f"{root}/zero_dim")
    full = FSDP.optim_state_dict(model, opt)  # FULL, the default
    for kind, steps in (("full", 0), ("full", 1), ("sharded", 1)):  # steps: state in the optimizer before loading
        other, other_opt = make(7, steps)
        if kind == "full":
            other.load_state_dict(want)
            other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, full))
        else:
            with FSDP.state_dict_type(other, StateDictType.SHARDED_STATE_DICT):
                sd = {"model": other.state_dict(), "optim": FSDP.optim_state_dict(other, other_opt)}
                dcp.load(sd, checkpoint_id=f"{root}/zero_dim")
                other.load_state_dict(sd["model"])
                other_opt.load_state_dict(FSDP.optim_state_dict_to_load(other, other_opt, sd["optim"]))
        assert_state_equal(full_sd(other), want, f"{kind} model, {steps} steps before loading")
        assert_state_equal(full_osd(other, other_opt), want_o, f"{kind} optimizer, {steps} steps before loading")
        other(torch.randn(2, 5)).sum().backward()
        other_opt.step()  # per-element state is the shard view's shape, step a scalar
    return True


def test_dcp_zero_dim_parameter(tmp_path: pathlib.Path):
    assert run_distributed(zero_dim_worker, 3, str(tmp_path), timeout=120) == [True] * 3
