"""FSDP2's reduction settings on ``fully_shard`` against PyTorch's FSDP2 on the same script: the same
TinyGPT (odd shapes: 37 rows of the tied embedding pad at W = 2 and 3), the same batches, SGD-momentum,
compared after every step (loss, every rank's local gradient before the step, local shard after it).

* ``set_force_sum_reduction_for_comms(True)`` on every module, alone and with torchtitan's
  ``set_gradient_divide_factor(1.0)`` (which PyTorch's FSDP2 cannot run on gloo without it), at W = 2 and
  W = 3; with ``set_all_reduce_hook`` the hook sees the sum (force-sum) or the mean (default) as FSDP2's.
* ``set_requires_all_reduce(False)`` for the first micro-batch of an accumulation: under HSDP (2x2, W = 4)
  reduce-scatters but no all-reduce until the last; on a 1-D mesh (W = 2) nothing changes.
  ``set_all_reduce_hook`` runs on the all-reduce's output (HSDP) or the reduce-scatter's (1-D).
* ``set_reshard_after_forward``: an int raises FSDP2's ValueError; True after ``reshard_after_forward=2``
  gathers the whole unit in backward again (W = 4).
* NCCL's settings on gloo: ``set_allocate_memory_from_process_group_for_comm`` changes nothing in either,
  ``set_symm_mem_for_comm`` raises a RuntimeError in both and leaves the module as it was.
* ``set_reduce_scatter_max_input_buffers`` checks its value as FSDP2's and caps the reductions in flight.

Bitwise: at W = 2 and in HSDP's 2x2 (sums of two numbers, and divisions by powers of two, round alike).
At W = 3 and in the 4-way reduce-scatter within PyTorch's default fp32 tolerance: gloo's reduce-scatter and
flatshard's exchange add three or four ranks' gradients in different orders, so no step is bitwise there.
"""

from __future__ import annotations

import dataclasses

import torch

from tests.helpers.cases import fsdp2_pair, token_loss
from tests.helpers.dist import raised, run_distributed

STEPS, PER_RANK = 2, 2


def _fsdp_modules(model):
    import torch.distributed.fsdp as torch_fsdp

    return [m for m in model.modules() if isinstance(m, torch_fsdp.FSDPModule)]


def _batch(rank: int, step: int, micro: int = 0) -> torch.Tensor:
    return torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(1000 * step + 10 * micro + rank))


def _local(t: torch.Tensor) -> torch.Tensor:
    return t._local_tensor.detach().clone()


def _step(model, opt, rank: int, step: int, micros: int, before_micro) -> tuple[float, list, list]:
    """One optimizer step over ``micros`` micro-batches (``before_micro(model, i)`` first); returns the loss,
    the local gradients before the step and the local shards after it."""
    total = 0.0
    for i in range(micros):
        before_micro(model, i)
        loss = token_loss(model, _batch(rank, step, i)) / micros
        loss.backward()
        total += loss.item()
    grads = [_local(p.grad) for p in model.parameters()]
    opt.step()
    opt.zero_grad()
    return total, grads, [_local(p) for p in model.parameters()]


def _compare(pair, rank: int, what: str, *, micros: int = 1, before_micro=lambda m, i: None) -> int:
    """Train FSDP2's model and flatshard's side by side for STEPS steps; each step within fp32's default
    tolerance (loss, gradients, shards); returns how many steps were equal to the bit."""
    theirs, ours = pair
    opts = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in pair]
    bitwise = 0
    for step in range(STEPS):
        a = _step(theirs, opts[0], rank, step, micros, before_micro)
        b = _step(ours, opts[1], rank, step, micros, before_micro)
        loss_a, loss_b = (torch.tensor(x[0], dtype=torch.float32) for x in (a, b))  # fp32's tolerance
        torch.testing.assert_close(loss_b, loss_a, msg=lambda m: f"{what} step {step}: loss {m}")
        for kind, i in (("gradient", 1), ("parameter", 2)):
            for x, y in zip(a[i], b[i]):
                torch.testing.assert_close(y, x, msg=lambda m: f"{what} step {step}: {kind} {m}")
        bitwise += a[0] == b[0] and all(torch.equal(x, y) for i in (1, 2) for x, y in zip(a[i], b[i]))
    return bitwise


def _hooked(pair, add: float) -> tuple[list, list]:
    """Set on every module of both models a hook that records what it is given and adds ``add`` to it (so
    the gradients show whether it ran before or after the division)."""
    seen: tuple[list, list] = ([], [])
    for model, record in zip(pair, seen):

        def hook(t: torch.Tensor, record=record) -> None:
            record.append(t.detach().clone())
            t.add_(add)

        for m in _fsdp_modules(model):
            m.set_all_reduce_hook(hook)
    return seen


def _same_tensors(a: list, b: list) -> tuple[bool, bool]:
    """(within fp32's default tolerance, equal to the bit) for two lists of tensors."""
    if len(a) != len(b) or any(x.shape != y.shape for x, y in zip(a, b)):
        return False, False
    close = all(torch.allclose(y, x, rtol=1.3e-6, atol=1e-5) for x, y in zip(a, b))
    return close, all(map(torch.equal, a, b))


# ---- set_force_sum_reduction_for_comms ---------------------------------------------------------------
def force_sum_worker(rank: int, world: int) -> dict:
    out: dict = {}
    for name, factor in (("force sum", None), ("force sum, divide factor 1", 1.0)):
        pair = fsdp2_pair()
        for model in pair:
            for m in _fsdp_modules(model):
                m.set_force_sum_reduction_for_comms(True)
                if factor is not None:
                    m.set_gradient_divide_factor(factor)
        out[name] = _compare(pair, rank, name)
    for force in (False, True):  # the hook sees the mean, or (force-sum) the sum, as FSDP2's does
        pair = fsdp2_pair()
        seen = _hooked(pair, add=0.25)
        for model in pair:
            for m in _fsdp_modules(model):
                m.set_force_sum_reduction_for_comms(force)
        name = f"hook, force sum {force}"
        out[name] = _compare(pair, rank, name)
        out[f"{name}: what it saw (close, bitwise)"] = _same_tensors(*seen)
        out[f"{name}: calls"] = len(seen[1])
    return out


def _check_force_sum(world: int) -> None:
    for out in run_distributed(force_sum_worker, world, timeout=240):
        for force in (False, True):
            assert out[f"hook, force sum {force}: calls"] == STEPS * 3, out  # once per unit (root, 2 blocks) a step
            close, bitwise = out[f"hook, force sum {force}: what it saw (close, bitwise)"]
            assert close and (bitwise or world == 3), out
        if world == 2:  # sums of two, divisions by two: every step to the bit
            steps = [
                out[k]
                for k in ("force sum", "force sum, divide factor 1", *(f"hook, force sum {f}" for f in (False, True)))
            ]
            assert steps == [STEPS] * 4, out


def test_force_sum_reduction_matches_fsdp2_at_2_ranks():
    _check_force_sum(2)


def test_force_sum_reduction_matches_fsdp2_at_3_ranks():
    _check_force_sum(3)


# ---- set_requires_all_reduce and set_all_reduce_hook -----------------------------------------------------
def _accumulate_without_all_reduce(model, i: int) -> None:
    """The first of two micro-batches reduce-scatters only; the second all-reduces both."""
    model.set_requires_all_reduce(i == 1)


def all_reduce_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import flatshard

    hsdp = world == 4
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if hsdp else None
    out: dict = {}
    pair = fsdp2_pair(mesh)
    out["accumulate"] = _compare(pair, rank, "accumulate", micros=2, before_micro=_accumulate_without_all_reduce)
    ours = pair[1]
    with ours.record_comms() as rec:  # one more accumulation, counted
        for i in range(2):
            ours.set_requires_all_reduce(i == 1)
            token_loss(ours, _batch(rank, 9, i)).backward()
            if i == 0:
                out["all_reduce after the first"] = rec.count("all_reduce", "backward")
                out["grads after the first"] = sorted(
                    {str(p.grad.to_local().count_nonzero().item()) for p in ours.parameters()}
                )
    out["reduce_scatter"] = rec.count("reduce_scatter", "backward")
    out["all_reduce"] = rec.count("all_reduce", "backward")
    # the loop's zero_grad() between the two drops the first micro-batch's sums (flatshard's window,
    # [Note: an open accumulation window]): the step equals FSDP2's that saw only the second micro-batch
    opt = torch.optim.SGD(ours.parameters(), lr=0.0)
    ours.set_requires_all_reduce(False)
    token_loss(ours, _batch(rank, 11, 0)).backward()
    opt.zero_grad()
    ours.set_requires_all_reduce(True)
    token_loss(ours, _batch(rank, 11, 1)).backward()
    dropped = [_local(p.grad) for p in ours.parameters()]
    token_loss(pair[0], _batch(rank, 11, 1)).backward()
    out["zero_grad drops the window"] = all(map(torch.equal, [_local(p.grad) for p in pair[0].parameters()], dropped))

    pair = fsdp2_pair(mesh)  # the hook on every module, on the all-reduce's output (HSDP) or the reduce-scatter's
    seen = _hooked(pair, add=0.25)
    out["hook"] = _compare(pair, rank, "hook", micros=2, before_micro=_accumulate_without_all_reduce)
    out["hook saw (close, bitwise)"] = _same_tensors(*seen)
    out["hook calls"] = len(seen[1])
    shapes = {u.shard_numel for u in flatshard.units(pair[1])}
    out["hook saw the shards"] = {t.numel() for t in seen[1]} == shapes
    out["stream"] = [raised(lambda m=m: m.set_all_reduce_hook(print, stream=object())) for m in pair]

    return out


def test_requires_all_reduce_and_all_reduce_hook_match_fsdp2_hsdp():
    for out in run_distributed(all_reduce_worker, 4, timeout=300):
        assert out["accumulate"] == STEPS and out["hook"] == STEPS, out  # 2x2: to the bit
        # the first micro-batch: a reduce-scatter per unit, no all-reduce, no gradient on .grad
        assert out["all_reduce after the first"] == 0 and out["grads after the first"] == ["0"], out
        assert out["reduce_scatter"] == 6 and out["all_reduce"] == 3, out  # 3 units, 2 micro-batches
        assert out["zero_grad drops the window"], out
        assert out["hook saw (close, bitwise)"] == (True, True) and out["hook calls"] == STEPS * 3, out
        assert out["hook saw the shards"], out
        assert (
            out["stream"][0]
            == out["stream"][1]
            == "ValueError/Exception/BaseException: " + ("stream cannot be set when using native HSDP")
        ), out


def test_requires_all_reduce_and_all_reduce_hook_match_fsdp2_1d():
    for out in run_distributed(all_reduce_worker, 2, timeout=240):
        assert out["accumulate"] == STEPS and out["hook"] == STEPS, out  # nothing skipped on a 1-D mesh
        assert out["all_reduce after the first"] == 0 and out["all_reduce"] == 0, out
        assert out["reduce_scatter"] == 6 and out["grads after the first"] != ["0"], out  # reduced at once
        assert out["hook saw (close, bitwise)"] == (True, True) and out["hook calls"] == STEPS * 2 * 3, out
        assert out["hook saw the shards"], out
        assert out["stream"][1].startswith("NotBuiltError/") and "leave stream unset" in out["stream"][1], out


# ---- set_reshard_after_forward ----------------------------------------------------------------------------
def reshard_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    """reshard_after_forward=2 at W = 4, then set_reshard_after_forward(True) on each block: backward gathers
    the whole unit again, within the 4 ranks, as FSDP2's does; an int raises FSDP2's ValueError."""
    import torch.distributed.fsdp as torch_fsdp

    import flatshard
    from tests.helpers.models import TinyGPT

    torch.manual_seed(0)
    models = (TinyGPT(), TinyGPT())
    models[1].load_state_dict(models[0].state_dict())
    out: dict = {}
    for model, shard in zip(models, (torch_fsdp.fully_shard, flatshard.fully_shard)):
        for block in model.blocks:
            shard(block, reshard_after_forward=2)
        shard(model)
        out.setdefault("int", []).append(raised(lambda m=model: m.set_reshard_after_forward(2)))
        for block in model.blocks:
            block.set_reshard_after_forward(True, recurse=False)
    with models[1].record_comms(events=True) as rec:
        _compare(models, rank, "reshard True after int")  # 4-way sums: fp32 tolerance, checked every step
    out["backward gathers (post_forward, shard)"] = (
        rec.count("all_gather", "backward", "post_forward"),
        rec.count("all_gather", "backward", "shard"),
    )
    return out


def test_set_reshard_after_forward_takes_a_bool_and_replaces_an_int():
    for out in run_distributed(reshard_worker, 4, timeout=240):
        said = "ValueError/Exception/BaseException: reshard_after_forward should be a bool, got <class 'int'>"
        assert out["int"] == [said, said], out
        assert out["backward gathers (post_forward, shard)"] == (0, 2 * STEPS), out  # no pairs: each block whole


# ---- NCCL's settings on gloo ----------------------------------------------------------------------------
def nccl_settings_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    out: dict = {}
    pair = fsdp2_pair()
    for model in pair:
        for m in _fsdp_modules(model):
            m.set_allocate_memory_from_process_group_for_comm(True)
    out["allocate from the process group"] = _compare(pair, rank, "allocate from the process group")
    pair = fsdp2_pair()
    out["symm_mem"] = [raised(model.set_symm_mem_for_comm) for model in pair]
    out["after symm_mem"] = _compare(pair, rank, "after symm_mem")
    return out


def test_nccl_settings_on_gloo_do_what_fsdp2_does():
    for out in run_distributed(nccl_settings_worker, 2, timeout=240):
        assert out["allocate from the process group"] == STEPS, out  # gloo has no allocator: plain buffers
        theirs, ours = out["symm_mem"]  # no NCCL symmetric memory in torch's CPU build: a RuntimeError in both
        assert theirs.startswith("RuntimeError/") and ours.startswith("NotBuiltError/NotImplementedError/RuntimeError")
        assert out["after symm_mem"] == STEPS, out


def max_input_buffers_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    from flatshard.runtime.schedule import run_context

    pair = fsdp2_pair()
    out: dict = {
        str(k): [raised(lambda m=m, k=k: m.set_reduce_scatter_max_input_buffers(k)) for m in pair]
        for k in (True, 1.5, 0, 2)
    }
    out["after"] = _compare(pair, rank, "after max input buffers")
    # where reductions are left in flight (an accelerator; forced here), the cap is how many
    ours = pair[1]
    ctx = run_context(ours._unit)
    ctx.config = dataclasses.replace(ctx.config, overlap_reductions=True)
    settle, seen = ctx.settle_reductions, []

    def counting(keep: int) -> None:
        seen.append(len(ctx.pending_reductions))
        settle(keep)

    ctx.settle_reductions = counting  # type: ignore[method-assign]  # counts, then settles
    out["in flight"] = {}
    for k in (1, 2):
        ours.set_reduce_scatter_max_input_buffers(k)
        seen.clear()
        token_loss(ours, _batch(rank, 0)).backward()
        out["in flight"][k] = max(seen)
    return out


def test_reduce_scatter_max_input_buffers():
    """FSDP2's checks of the value; on CPU neither changes a result; where reductions are left in flight,
    flatshard leaves up to that many (3 units: the root's post-backward finds both blocks' in flight)."""
    for out in run_distributed(max_input_buffers_worker, 2, timeout=240):
        assert out["True"] == ["TypeError/Exception/BaseException: max_input_buffers must be an int, got bool"] * 2
        assert out["1.5"][0] == out["1.5"][1] and out["1.5"][1].startswith("TypeError/"), out
        assert out["0"][0] == out["0"][1] and out["0"][1].startswith("ValueError/"), out
        assert out["2"] == ["no error", "no error"] and out["after"] == STEPS, out
        assert out["in flight"] == {1: 1, 2: 2}, out
