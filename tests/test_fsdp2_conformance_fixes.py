"""``fully_shard`` behaves as FSDP2 where PyTorch's own FSDP2 tests found it did not (tests/conformance):
meta-device models stay on meta until the user materialises them, misuse raises what FSDP2 raises
(with how to fix it), ``shard_placement_fn`` returning FSDP2's default is accepted, torch's composable
``replicate`` composes with it in either order. One spawn of two
gloo ranks runs every case; each rank's answers are checked."""

from __future__ import annotations

import copy
import dataclasses
import functools

import torch
from torch import nn

from tests.helpers.dist import raised as _raised
from tests.helpers.dist import run_distributed


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 5))


def _meta_then_materialise(rank: int) -> dict:
    """Built on meta, sharded, materialised by to_empty and values the test writes into each local
    chunk; then one SGD step, compared with the unsharded model holding the same values."""
    from torch.distributed.tensor import DTensor

    import flatshard

    with torch.device("meta"):
        model = nn.Sequential(_mlp(), _mlp())
    flatshard.fully_shard(model[0])
    flatshard.fully_shard(model)
    on_meta = all(p.is_meta and isinstance(p, DTensor) for p in model.parameters())
    model.to_empty(device="cpu")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # built after to_empty, as FSDP2 users do
    torch.manual_seed(0)
    ref = nn.Sequential(_mlp(), _mlp())
    with torch.no_grad():
        for p, r in zip(model.parameters(), ref.parameters()):
            p.to_local().copy_(torch.chunk(r, 2)[rank])  # what reset_parameters() would write, known here
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    model(x[2 * rank : 2 * rank + 2]).sum().backward()
    opt.step()
    (ref(x).sum() / 2).backward()
    ref_opt.step()
    errors = [
        (n, (p.full_tensor() - r).abs().max().item()) for (n, p), r in zip(model.named_parameters(), ref.parameters())
    ]
    return {"on_meta": on_meta, "max_error": max(e for _, e in errors), "after": str(next(model.parameters()).device)}


def _forward_on_meta() -> str:
    import flatshard

    with torch.device("meta"):
        model = nn.Sequential(_mlp(), _mlp())
    flatshard.fully_shard(model[0])
    flatshard.fully_shard(model)
    return _raised(lambda: model(torch.randn(2, 5)))


def worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard

    import flatshard

    out = {"meta": _meta_then_materialise(rank), "meta forward": _forward_on_meta()}
    model = flatshard.fully_shard(_mlp())
    out["deepcopy"] = _raised(lambda: copy.deepcopy(model))
    out["twice"] = _raised(lambda: flatshard.fully_shard(model))
    out["slice"] = type(model[:2]).__name__
    out["module list"] = _raised(lambda: flatshard.fully_shard(nn.ModuleList([nn.Linear(2, 2)])))
    mesh3 = init_device_mesh("cpu", (2, 1, 1))
    out["3-D mesh"] = _raised(lambda: flatshard.fully_shard(_mlp(), mesh=mesh3))
    zero = flatshard.fully_shard(_mlp(), shard_placement_fn=lambda p: Shard(0) if p.ndim > 1 else None)
    out["Shard(0)"] = [tuple(p.placements) == (Shard(0),) for p in zero.parameters()]
    out["Shard(1)"] = _raised(lambda: flatshard.fully_shard(_mlp(), shard_placement_fn=lambda p: Shard(p.ndim - 1)))
    scalar = nn.Linear(2, 2)
    scalar.scale = nn.Parameter(torch.tensor(1.0))
    out["0-D"] = _raised(lambda: flatshard.fully_shard(scalar))
    return out


def test_fully_shard_meets_fsdp2_where_its_tests_found_differences():
    for out in run_distributed(worker, 2):
        assert out["meta"]["on_meta"], out  # FSDP2 keeps the sharded parameters on meta
        assert out["meta"]["after"] == "cpu", out
        assert out["meta"]["max_error"] < 1e-6, out
        assert out["meta forward"].startswith("RuntimeError/"), out
        assert "still on meta device: ['1.0.weight', '1.0.bias', '1.2.weight', '1.2.bias']" in out["meta forward"]
        assert "to_empty" in out["meta forward"], out
        assert out["deepcopy"].startswith("FullyShardUsageError/ValueError/AssertionError: FSDP does not support"), out
        assert "Copy the model before" in out["deepcopy"], out
        assert "Each distinct composable distributed API can only be applied to a module once" in out["twice"], out
        assert out["slice"] == "Sequential", out
        assert "fully_shard does not support containers that do not implement forward" in out["module list"], out
        assert out["3-D mesh"].startswith("ValueError/"), out
        assert "fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh" in out["3-D mesh"], out
        assert out["Shard(0)"] == [True] * 4, out
        assert out["Shard(1)"] == "no error", out  # tests/test_shard_dims.py trains it
        assert out["0-D"].startswith("ValueError/"), out
        assert "Change scale to a 1D tensor with numel equal to 1." in out["0-D"], out


class _TiedHead(nn.Module):
    """An embedding, a body and a head tied to the embedding: the head and the embedding must share one
    group (one unit), as FSDP2 requires of tied parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(11, 6)
        self.body = nn.Linear(6, 6)
        self.head = nn.Linear(6, 11, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.body(self.embed(ids))))


def group_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """fully_shard([embed, head]) (one group) and fully_shard(body), then the root; three AdamW steps
    against the unsharded model on the global batch; then the head run alone, chunk by chunk."""
    import flatshard

    torch.manual_seed(0)
    ref = _TiedHead()
    model = copy.deepcopy(ref)
    flatshard.fully_shard([model.embed, model.head])
    flatshard.fully_shard(model.body)
    flatshard.fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    units = len(flatshard.units(model))
    errors = []
    for step in range(3):
        ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(step))
        loss = model(ids[2 * rank : 2 * rank + 2]).sum()
        loss.backward()
        (ref(ids).sum() / 2).backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        errors.append(
            max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters()))
        )
    h = torch.randn(2, 6)
    for chunk in h.chunk(2):  # a module of a group run alone, twice, each with its own backward
        model.head(chunk).sum().backward()
    grads = [p.grad is not None for p in model.head.parameters()]
    return {"units": units, "errors": errors, "tied": model.head.weight is model.embed.weight, "head grads": grads}


def test_several_modules_in_one_group():
    for out in run_distributed(group_worker, 2):
        assert out["units"] == 3, out  # [embed, head], body, the root (no parameters of its own)
        assert out["tied"], out
        assert max(out["errors"]) < 1e-5, out
        assert out["head grads"] == [True], out


class _Features(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(6, 6)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.proj(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.features(x).sum(-1)


class _UsesFeatures(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.vit, self.head = _Features(), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.vit.features(x))  # a method other than forward, called from outside


def forward_method_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import flatshard

    torch.manual_seed(0)
    ref = _UsesFeatures()
    model = copy.deepcopy(ref)
    flatshard.fully_shard(model.vit)
    flatshard.fully_shard(model)
    flatshard.register_fsdp_forward_method(model.vit, "features")
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(1))
    model(x[2 * rank : 2 * rank + 2]).sum().backward()
    (ref(x).sum() / 2).backward()
    return {
        "grad error": max(
            (p.grad.full_tensor() - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
        ),
        "missing method": _raised(lambda: flatshard.register_fsdp_forward_method(model.vit, "nothing")),
    }


def test_register_fsdp_forward_method():
    for out in run_distributed(forward_method_worker, 2):
        assert out["grad error"] < 1e-6, out
        assert out["missing method"].startswith("ValueError/"), out


def ignored_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """One ignored set for the whole model, passed to every fully_shard call (as FSDP2 users do): the
    inner call is given a parameter of the root's module too."""
    import flatshard

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    ignored = {model[1].weight, model[1].bias}
    flatshard.fully_shard(model[0], ignored_params=ignored)
    flatshard.fully_shard(model, ignored_params=ignored)
    model(torch.randn(2, 4)).sum().backward()
    return {
        "whole": [tuple(p.shape) for p in (model[1].weight, model[1].bias)],
        "plain": type(model[1].weight).__name__,
    }


def test_ignored_params_of_other_modules_are_no_error():
    for out in run_distributed(ignored_worker, 2):
        assert out == {"whole": [(4, 4), (4,)], "plain": "Parameter"}, out


def tied_apart_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """A weight tied between two modules sharded by separate calls: refused at the second call (it
    would be a second, untied copy), not trained apart in silence."""
    import flatshard

    model = _TiedHead()
    flatshard.fully_shard(model.embed)
    return {"apart": _raised(lambda: flatshard.fully_shard(model.head))}


def test_a_tie_across_two_calls_is_refused():
    for out in run_distributed(tied_apart_worker, 2):
        assert out["apart"].startswith("ValueError/"), out
        assert "weight is already managed by another fully_shard call" in out["apart"], out
        assert "fully_shard([a, b])" in out["apart"], out


def offload_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """CPUOffloadPolicy on a CPU-only run is accepted, as FSDP2 accepts it: nothing to move."""
    import flatshard

    torch.manual_seed(0)
    ref = _mlp()
    model = copy.deepcopy(ref)
    flatshard.fully_shard(model, offload_policy=flatshard.CPUOffloadPolicy(pin_memory=False))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(1))
    model(x[2 * rank : 2 * rank + 2]).sum().backward()
    (ref(x).sum() / 2).backward()
    return {
        "grad error": max(
            (p.grad.full_tensor() - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
        )
    }


def test_cpu_offload_policy_on_a_cpu_run():
    for out in run_distributed(offload_worker, 2):
        assert out["grad error"] < 1e-6, out


def cast_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """MixedPrecisionPolicy(param_dtype=torch.float32) on fp32 parameters still casts a bf16 input, as
    FSDP2 does; output_dtype casts the output."""
    import flatshard

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    flatshard.fully_shard(model[1], mp_policy=flatshard.MixedPrecisionPolicy(param_dtype=torch.float32))
    flatshard.fully_shard(model, mp_policy=flatshard.MixedPrecisionPolicy(output_dtype=torch.bfloat16))
    inner = _raised(lambda: model[1](torch.randn(2, 4, dtype=torch.bfloat16)))
    return {"inner": inner, "out": str(model(torch.randn(2, 4)).dtype)}


def test_param_dtype_equal_to_the_parameters_still_casts_inputs():
    for out in run_distributed(cast_worker, 2):
        assert out == {"inner": "no error", "out": "torch.bfloat16"}, out


def unshard_in_backward_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import flatshard

    torch.manual_seed(0)
    ref = _TiedHead()
    ref.head.weight = nn.Parameter(ref.head.weight.detach().clone())  # untied: the embedding alone in its group
    model = copy.deepcopy(ref)
    flatshard.fully_shard(model.embed)
    flatshard.fully_shard(model)
    model.embed.set_unshard_in_backward(False)
    ids = torch.randint(0, 11, (4, 5), generator=torch.Generator().manual_seed(1))
    model(ids[2 * rank : 2 * rank + 2]).sum().backward()
    (ref(ids).sum() / 2).backward()
    return {
        "grad error": max(
            (p.grad.full_tensor() - r.grad).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())
        )
    }


def test_set_unshard_in_backward_is_accepted():
    for out in run_distributed(unshard_in_backward_worker, 2):
        assert out["grad error"] < 1e-5, out  # fp32 sums of 55 logits in another order


class _Event:
    """Stands for the event optimizer.step() recorded: counts the waits."""

    waits = 0

    def synchronize(self) -> None:
        _Event.waits += 1


def post_optim_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import flatshard

    _Event.waits = 0  # the pool's process may have run this case before
    model = flatshard.fully_shard(_mlp())
    event = _Event()
    model.set_post_optim_event(event)
    model(torch.randn(2, 5)).sum().backward()
    model(torch.randn(2, 5)).sum().backward()
    return {"waits": _Event.waits}


def test_set_post_optim_event_is_waited_on_once():
    for out in run_distributed(post_optim_worker, 2):
        assert out == {"waits": 1}, out


def cast_after_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """model.to(torch.float64) after fully_shard: parameters, gradients and the training follow."""
    import flatshard

    torch.manual_seed(0)
    ref = nn.Sequential(_mlp(), _mlp()).to(torch.float64)
    model = nn.Sequential(_mlp(), _mlp())
    model.load_state_dict({k: v.float() for k, v in ref.state_dict().items()})
    flatshard.fully_shard(model[0])
    flatshard.fully_shard(model[1])
    flatshard.fully_shard(model)  # the root holds no parameters of its own
    model.to(torch.float64)
    with torch.no_grad():  # the fp64 values, past the fp32 rounding of the copy
        for p, r in zip(model.parameters(), ref.parameters()):
            p.to_local().copy_(torch.chunk(r, 2)[rank])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    for _ in range(2):
        model(x[2 * rank : 2 * rank + 2]).sum().backward()
        (ref(x).sum() / 2).backward()
        opt.step()
        ref_opt.step()
    return {
        "dtypes": sorted(
            {str(p.to_local().dtype) for p in model.parameters()} | {str(p.grad.dtype) for p in model.parameters()}
        ),
        "error": max((p.full_tensor() - r).abs().max().item() for p, r in zip(model.parameters(), ref.parameters())),
    }


def test_a_cast_after_fully_shard_is_followed():
    for out in run_distributed(cast_after_worker, 2):
        assert out["dtypes"] == ["torch.float64"], out
        assert out["error"] < 1e-12, out


def dtensor_param_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """A parameter that is already a DTensor of a mesh that fully_shard's tensor-parallel support does not
    cover (a 2-D one) is refused at the call, naming it, instead of failing at the first copy with
    DTensor's "got mixed torch.Tensor and DTensor"; one on the mesh fully_shard is to shard over is a
    ValueError that says which mesh goes where (tests/test_tensor_parallel.py trains FSDP over TP)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    import flatshard

    model = _mlp()
    mesh_2d = init_device_mesh("cpu", (1, 2))
    model[0].weight = nn.Parameter(distribute_tensor(model[0].weight.detach(), mesh_2d, [Replicate(), Replicate()]))
    refused = _raised(lambda: flatshard.fully_shard(model))
    same = _mlp()
    mesh = init_device_mesh("cpu", (2,))
    same[0].weight = nn.Parameter(distribute_tensor(same[0].weight.detach(), mesh, [Replicate()]))
    nested = nn.Sequential(_mlp(), _mlp())  # an inner call's DTensors are its own: no error
    flatshard.fully_shard(nested[0])
    return {
        "refused": refused,
        "same mesh": _raised(lambda: flatshard.fully_shard(same, mesh=mesh)),
        "nested": _raised(lambda: flatshard.fully_shard(nested)),
    }


def test_dtensor_parameters_are_refused_at_the_call():
    for out in run_distributed(dtensor_param_worker, 2):
        assert out["refused"].startswith("NotBuiltError/"), out
        assert "0.weight" in out["refused"] and "torch.distributed.fsdp.fully_shard" in out["refused"], out
        assert "over a 2-D mesh" in out["refused"], out
        assert out["same mesh"].startswith("ValueError/"), out
        assert "pass the data-parallel mesh" in out["same mesh"], out
        assert out["nested"] == "no error", out


def post_acc_hook_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """A parameter's post-accumulate-grad hook runs once per backward with its reduced gradient on
    ``.grad``, as FSDP2 runs it: an optimizer stepped from the hook (one per parameter) trains as one
    stepped after backward."""
    import flatshard

    torch.manual_seed(0)
    models = [nn.Sequential(_mlp(), _mlp()) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    for model in models:
        flatshard.fully_shard(model[0])
        flatshard.fully_shard(model)
    ref_opt = torch.optim.SGD(models[0].parameters(), lr=0.1)
    calls: dict[str, int] = {}
    opts = {p: torch.optim.SGD([p], lr=0.1) for p in models[1].parameters()}

    def hook(name: str, p: nn.Parameter) -> None:
        calls[name] = calls.get(name, 0) + 1
        opts[p].step()
        opts[p].zero_grad()

    for name, p in models[1].named_parameters():
        p.register_post_accumulate_grad_hook(functools.partial(hook, name))
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        models[0](x).sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
        models[1](x).sum().backward()
    diff = max((a - b).abs().max().item() for a, b in zip(models[0].parameters(), models[1].parameters()))
    return {"calls": sorted(set(calls.values())), "hooked": len(calls), "diff": diff}


def test_post_accumulate_grad_hooks_run_on_the_reduced_gradient():
    for out in run_distributed(post_acc_hook_worker, 2):
        assert out == {"calls": [2], "hooked": 8, "diff": 0.0}, out


@dataclasses.dataclass
class _Input:
    x: torch.Tensor
    note: str = "kept"


class _TakesDataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, inp: _Input) -> torch.Tensor:
        assert inp.note == "kept"
        return self.lin(inp.x)


def dataclass_input_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """Floating tensors inside a dataclass input are cast to param_dtype, as FSDP2 casts them."""
    import flatshard

    model = _TakesDataclass()
    flatshard.fully_shard(model, mp_policy=flatshard.MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    dtypes = []
    out = _raised(lambda: dtypes.append(str(model(_Input(torch.randn(2, 4))).dtype)))
    return {"out": out, "dtype": dtypes}


def test_dataclass_inputs_are_cast():
    for out in run_distributed(dataclass_input_worker, 2):
        assert out == {"out": "no error", "dtype": ["torch.bfloat16"]}, out


def replicate_worker(rank: int, world: int) -> dict:
    """torch's composable ``replicate`` (DDP) beside flatshard's ``fully_shard`` ([Note: composing with
    torch's replicate], fsdp2/checks.py), in both orders: fully_shard on a block then replicate on the
    whole model; replicate on a block then fully_shard on the whole model. Three SGD steps on each rank's
    own rows, against one process over the global batch."""
    from torch.distributed._composable.replicate import replicate
    from torch.distributed.tensor import DTensor

    import flatshard

    out: dict = {}
    for order in ("fully_shard first", "replicate first"):
        torch.manual_seed(0)
        model = nn.Sequential(_mlp(), _mlp())
        ref = copy.deepcopy(model)
        if order == "fully_shard first":
            flatshard.fully_shard(model[0])
            replicate(model)
            out["replicate refuses a fully_shard module"] = _raised(lambda: replicate(model[0]))
        else:
            replicate(model[1])
            flatshard.fully_shard(model)
        kinds = {n: type(p).__name__ for n, p in model.named_parameters()}
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
        steps = []
        for step in range(3):
            x = torch.randn(4 * world, 5, generator=torch.Generator().manual_seed(step))
            model(x[4 * rank : 4 * (rank + 1)]).pow(2).mean().backward()
            ref(x).pow(2).mean().backward()
            for o in (opt, ref_opt):
                o.step()
                o.zero_grad()
            full = [p.full_tensor() if isinstance(p, DTensor) else p.detach() for p in model.parameters()]
            steps.append(all(torch.allclose(a, b, atol=1e-6) for a, b in zip(full, ref.parameters())))
        out[order] = {"kinds": kinds, "steps": steps}
    return out


def test_torch_replicate_composes_with_fully_shard_in_either_order():
    for out in run_distributed(replicate_worker, 2):
        first, second = out["fully_shard first"], out["replicate first"]
        # fully_shard's block is sharded (DTensors), the rest is DDP's (plain); replicate's block stays plain
        assert first["kinds"] == {
            "0.0.weight": "DTensor", "0.0.bias": "DTensor", "0.2.weight": "DTensor", "0.2.bias": "DTensor",
            "1.0.weight": "Parameter", "1.0.bias": "Parameter", "1.2.weight": "Parameter", "1.2.bias": "Parameter",
        }, first["kinds"]  # fmt: skip
        assert second["kinds"] == {
            "0.0.weight": "DTensor", "0.0.bias": "DTensor", "0.2.weight": "DTensor", "0.2.bias": "DTensor",
            "1.0.weight": "Parameter", "1.0.bias": "Parameter", "1.2.weight": "Parameter", "1.2.bias": "Parameter",
        }, second["kinds"]  # fmt: skip
        assert first["steps"] == second["steps"] == [True, True, True], out
        assert "already managed by `fully_shard`" in out["replicate refuses a fully_shard module"], out
