"""The FSDP-compatible surface: keywords, names, wrap policies, errors on every rank, buffers,
ignored modules, summon_full_params, and the decay/no-decay helper."""

from __future__ import annotations

import functools

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, OddMLP, TinyGPT, WithBuffers


def _raises(fn, exc=Exception) -> str:
    try:
        fn()
    except exc as e:  # the message is returned so the parent checks it on every rank
        return f"{type(e).__name__}: {e}"
    return "no error"


def errors_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from flatshard import CPUOffload, MixedPrecision
    from flatshard import FullyShardedDataParallel as FSDP

    out = {
        "old_optim_api": "NotBuiltError: FullyShardedDataParallel.full_optim_state_dict (deprecated in PyTorch FSDP)",
        "comm_hook": "NotBuiltError: register_comm_hook is not built in flatshard",
        "foreign_ignored": _raises(lambda: FSDP(OddMLP(), ignored_states=[nn.Parameter(torch.zeros(2))])),
        "bad_prefetch": _raises(lambda: FSDP(OddMLP(), backward_prefetch="BACKWARD_PRE")),
        "cpu_offload": _raises(lambda: FSDP(OddMLP(), cpu_offload=CPUOffload(offload_params=True))),
        "param_init_fn": _raises(lambda: FSDP(OddMLP(), param_init_fn="normal")),
        "group_pair": _raises(lambda: FSDP(OddMLP(), process_group=(None, None))),
        "wrapped_twice": _raises(lambda: FSDP(FSDP(OddMLP()))),
        "mixed_dtypes": _raises(lambda: FSDP(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2).double()))),
        "bad_policy": _raises(lambda: FSDP(OddMLP(), auto_wrap_policy={nn.Linear})),
    }
    with torch.device("meta"):
        meta = OddMLP()
    out["meta"] = _raises(lambda: FSDP(meta))
    # a tied weight flattened by a unit wrapped by hand, then used outside it
    model = TinyGPT()
    model.head = FSDP(model.head)
    out["tie_into_hand_wrapped"] = _raises(lambda: FSDP(model))
    out["old_optim_api"] = _raises(lambda: FSDP.full_optim_state_dict(FSDP(OddMLP()), None))
    out["comm_hook"] = _raises(lambda: FSDP(OddMLP()).register_comm_hook(None, None))
    # accepted: the defaults spelled out, a 1-D mesh, use_orig_params either way, a no-op MixedPrecision
    ok = FSDP(
        OddMLP(),
        device_mesh=init_device_mesh("cpu", (world,)),
        use_orig_params=True,
        limit_all_gathers=True,
        cpu_offload=CPUOffload(offload_params=False),
        mixed_precision=MixedPrecision(),
    )
    out["accepted"] = [n for n, _ in ok.named_parameters()]
    # the attributes PyTorch FSDP exposes
    out["attributes"] = (
        ok.sharding_strategy.name,
        ok.mixed_precision.param_dtype,
        ok.cpu_offload.offload_params,
        ok.rank,
        ok.world_size,
        ok.compute_device.type,
        ok.check_is_root(),
        type(FSDP.get_state_dict_type(ok)).__name__,
    )
    return out


def test_unbuilt_keywords_and_bad_input_raise_on_every_rank():
    results = run_distributed(errors_worker, 2, timeout=120)
    expected = {
        "old_optim_api": "NotBuiltError: FullyShardedDataParallel.full_optim_state_dict (deprecated in PyTorch FSDP)",
        "comm_hook": "NotBuiltError: register_comm_hook is not built in flatshard",
        "foreign_ignored": "ValueError: ignored_states holds a parameter that is not in the module being wrapped",
        "bad_prefetch": "TypeError: backward_prefetch must be a flatshard.BackwardPrefetch",
        "cpu_offload": "ValueError: CPUOffload(offload_params=True): offload needs an accelerator compute device",
        "param_init_fn": "TypeError: param_init_fn must be a callable",
        "group_pair": "ValueError: process_group=(shard_group, replicate_group) is for HYBRID_SHARD",
        "wrapped_twice": "ValueError: this module is already wrapped",
        "mixed_dtypes": "TypeError: unit '<root>' holds parameters of several dtypes",
        "bad_policy": "TypeError: auto_wrap_policy must be a policy object",
        "meta": "ValueError: the model is on the meta device, but these modules hold parameters or buffers of "
        "their own and have no reset_parameters()",
        "tie_into_hand_wrapped": "ValueError: a parameter flattened into the unit",
    }
    for rank, out in enumerate(results):
        for key, prefix in expected.items():
            assert out[key].startswith(prefix), f"rank {rank}, {key}: {out[key]}"
        assert out["accepted"] == [n for n, _ in OddMLP().named_parameters()]
        assert out["attributes"] == ("FULL_SHARD", None, False, rank, 2, "cpu", True, "StateDictSettings"), out[
            "attributes"
        ]
    assert "common ancestor" in results[0]["tie_into_hand_wrapped"], "the error says how to wrap instead"


def surface_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import param_groups
    from flatshard.wrap import (
        ModuleWrapPolicy,
        lambda_auto_wrap_policy,
        size_based_auto_wrap_policy,
        transformer_auto_wrap_policy,
    )

    out = {}
    torch.manual_seed(0)
    ref = TinyGPT()
    torch.manual_seed(0)
    model = FSDP(
        TinyGPT(), auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={Block})
    )
    out["names"] = [n for n, _ in model.named_parameters()] == [n for n, _ in ref.named_parameters()]
    out["units"] = [type(m.module).__name__ for m in FSDP.fsdp_modules(model)]
    out["block_is_fsdp"] = isinstance(model.blocks[0], FSDP)
    out["orig_shapes"] = all(p.orig_shape == r.shape for p, r in zip(model.parameters(), ref.parameters()))
    out["views_1d"] = all(p.dim() == 1 for p in model.parameters())
    groups, ref_groups = param_groups(model, 0.1), param_groups(ref, 0.1)
    out["decay_groups"] = [len(g["params"]) for g in groups] == [len(g["params"]) for g in ref_groups]
    out["decay_count"] = [len(g["params"]) for g in groups]
    out["getattr_forwarding"] = isinstance(model.wte, nn.Embedding)
    sized = FSDP(TinyGPT(), auto_wrap_policy=functools.partial(size_based_auto_wrap_policy, min_num_params=1000))
    out["size_units"] = sorted(type(m.module).__name__ for m in FSDP.fsdp_modules(sized))
    lam = FSDP(
        TinyGPT(),
        auto_wrap_policy=functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.LayerNorm)),
    )
    out["lambda_units"] = len(FSDP.fsdp_modules(lam))
    pol = FSDP(TinyGPT(), auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=False)
    out["policy_units"] = len(FSDP.fsdp_modules(pol))

    # summon_full_params: full shapes inside, edits written back, seen by the next forward
    x = torch.randint(0, 37, (2, 8))
    with FSDP.summon_full_params(model):
        full = dict(model.named_parameters())
        out["summon_shapes"] = all(full[n].shape == r.shape for n, r in ref.named_parameters())
        out["summon_values"] = all(torch.equal(full[n], r) for n, r in ref.named_parameters())
        with torch.no_grad():
            full["ln_f.bias"].add_(1.0)
    with torch.no_grad():
        ref.ln_f.bias.add_(1.0)
        out["writeback_forward"] = torch.allclose(model(x), ref(x))
    with FSDP.summon_full_params(model, writeback=False):
        with torch.no_grad():
            dict(model.named_parameters())["ln_f.bias"].add_(5.0)
    with torch.no_grad():
        out["no_writeback"] = torch.allclose(model(x), ref(x))

    # apply: fn sees full shapes (summoned) and its writes land in the shards
    def init(m):
        if isinstance(m, nn.Linear):
            with torch.no_grad():
                m.weight.copy_(torch.arange(m.weight.numel(), dtype=torch.float32).reshape(m.weight.shape) / 100)

    assert model.apply(init) is model
    ref.apply(init)
    with torch.no_grad():
        out["apply"] = torch.allclose(model(x), ref(x))
    return out


def test_fsdp_surface():
    for world in (2, 3):
        for out in run_distributed(surface_worker, world, timeout=120):
            assert out["names"] and out["orig_shapes"] and out["views_1d"], out
            assert out["units"] == ["TinyGPT", "Block", "Block"], out["units"]
            assert out["block_is_fsdp"] and out["getattr_forwarding"]
            assert out["decay_groups"] and out["decay_count"] == [10, 16], out["decay_count"]
            assert out["size_units"] == ["Block", "Block", "TinyGPT"], out["size_units"]
            assert out["lambda_units"] == 1 + 2 * 2 + 1  # root + two LayerNorms per block + ln_f
            assert out["policy_units"] == 3
            assert out["summon_shapes"] and out["summon_values"]
            assert out["writeback_forward"], "an edit inside summon_full_params must persist"
            assert out["no_writeback"], "writeback=False must discard the edit"
            assert out["apply"], "apply(fn) must see and write the full parameters"


def buffers_ignored_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    ref = WithBuffers()
    torch.manual_seed(0)
    model = FSDP(WithBuffers())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)  # each rank's own data: buffers follow the local batch
    for _ in range(3):
        x = torch.randn(5, 6, generator=g)
        model(x).sum().backward()
        ref(x).sum().backward()
        opt.step(), ref_opt.step(), opt.zero_grad(), ref_opt.zero_grad()
    bufs = dict(model.named_buffers())
    out = {
        "buffer_names": sorted(bufs) == sorted(n for n, _ in ref.named_buffers()),
        "batches_tracked": bufs["bn.num_batches_tracked"].item(),
        "calls": bufs["calls"].item(),
    }
    # ignored modules: parameters stay whole, untouched by flatshard, gradients not reduced
    torch.manual_seed(0)
    inner = WithBuffers()
    ignored = FSDP(inner, ignored_modules=[inner.out])
    out["ignored_param_whole"] = ignored.out.weight.shape == (1, 10) and ignored.out.weight is inner.out.weight
    out["ignored_not_view"] = not hasattr(inner.out.weight, "orig_shape")
    out["managed_are_views"] = all(
        hasattr(p, "orig_shape") for n, p in ignored.named_parameters() if not n.startswith("out.")
    )
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 + rank))
    ignored(x).sum().backward()
    out["ignored_grad"] = inner.out.weight.grad.clone()
    # ignored_states with parameters: the same for one parameter of a module flatshard manages
    torch.manual_seed(0)
    ref = WithBuffers()
    torch.manual_seed(0)
    inner = WithBuffers()
    kept = inner.out.weight
    model = FSDP(inner, ignored_states=[kept])
    named = dict(model.named_parameters())
    out["param_whole"] = named["out.weight"] is kept and kept.shape == (1, 10) and not hasattr(kept, "orig_shape")
    out["others_views"] = all(hasattr(p, "orig_shape") for n, p in named.items() if n != "out.weight")
    model(x).sum().backward()
    ref(x).sum().backward()  # this rank's batch: the ignored parameter's gradient is not averaged
    out["param_local_grad"] = torch.allclose(kept.grad, ref.out.weight.grad)
    out["param_in_state_dict"] = torch.equal(model.state_dict()["out.weight"], ref.out.weight)
    out["mixed_states"] = _raises(lambda: FSDP(WithBuffers(), ignored_states=[inner.out, kept]))
    return out


def test_buffers_and_ignored_modules():
    results = run_distributed(buffers_ignored_worker, 2, timeout=120)
    for out in results:
        assert out["buffer_names"] and out["batches_tracked"] == 3 and out["calls"] == 3
        assert out["ignored_param_whole"] and out["ignored_not_view"] and out["managed_are_views"]
        assert out["param_whole"] and out["others_views"] and out["param_local_grad"] and out["param_in_state_dict"], (
            out
        )
        assert out["mixed_states"].startswith("ValueError: ignored_states must hold only"), out["mixed_states"]
    # ignored parameters keep each rank's local gradient (not averaged across ranks)
    assert not torch.equal(results[0]["ignored_grad"], results[1]["ignored_grad"])


def buffers_match_worker(rank: int, world: int) -> bool:
    """BatchNorm running statistics equal the unwrapped model's run on the same local batches."""
    from flatshard import FullyShardedDataParallel as FSDP

    torch.manual_seed(0)
    ref = WithBuffers()
    torch.manual_seed(0)
    model = FSDP(WithBuffers())
    g = torch.Generator().manual_seed(rank)
    for _ in range(3):
        x = torch.randn(5, 6, generator=g)
        torch.testing.assert_close(model(x), ref(x))
    b = dict(model.named_buffers())
    torch.testing.assert_close(b["bn.running_mean"], ref.bn.running_mean)
    torch.testing.assert_close(b["bn.running_var"], ref.bn.running_var)
    return True


def test_buffers_follow_the_unwrapped_model():
    assert all(run_distributed(buffers_match_worker, 2, timeout=120))


def test_wrap_policies_select_like_fsdp():
    """Policies pick modules without a process group: pure selection."""
    from flatshard.wrap import ModuleWrapPolicy, select_units, size_based_auto_wrap_policy

    model = TinyGPT(layers=3)
    chosen = select_units(model, ModuleWrapPolicy({Block}), set(), set())
    assert chosen == list(model.blocks)
    big = functools.partial(size_based_auto_wrap_policy, min_num_params=10**9)
    assert select_units(model, big, set(), set()) == []
    with pytest.raises(TypeError, match="auto_wrap_policy must be"):
        select_units(model, "Block", set(), set())
