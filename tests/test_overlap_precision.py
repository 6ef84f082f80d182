"""Prefetch, the rate limiter and mixed precision.

fp32 results do not depend on the prefetch settings (bitwise); prefetch changes when collectives
are issued, never how many or how large; the limiter keeps at most two units (besides the root)
gathered; a changed forward order is noticed; bf16 gathers move half the bytes and train at parity
with a reference that applies the same casts (PyTorch's bf16 tolerances)."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch

from tests.helpers.cases import PER_RANK, build, run_case, shared_references
from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT
from tests.helpers.util import captured_logs

SETTINGS = [
    *itertools.product((None, "BACKWARD_PRE", "BACKWARD_POST"), (False, True), (True,)),
    ("BACKWARD_PRE", True, False),
]


def prefetch_worker(rank: int, world: int) -> dict:
    from flatshard import BackwardPrefetch

    finals = {}
    with shared_references():  # [Note: one reference per trajectory], tests/helpers/cases.py
        for bwd, fwd, limit in SETTINGS:
            kw = {
                "backward_prefetch": BackwardPrefetch[bwd] if bwd else None,
                "forward_prefetch": fwd,
                "limit_all_gathers": limit,
            }
            model = run_case(rank, world, "gpt_tie_across_units", "FULL_SHARD", "adamw", **kw)  # parity every step
            finals[(bwd, fwd, limit)] = [p.detach().clone() for p in model.parameters()]
    base = finals[(None, False, True)]
    for key, params in finals.items():
        assert all(map(torch.equal, params, base)), f"prefetch {key} changed fp32 results"
    return {"settings": len(finals)}


def test_prefetch_settings_leave_fp32_results_bitwise_unchanged():
    assert run_distributed(prefetch_worker, 2, timeout=300) == [{"settings": len(SETTINGS)}] * 2


def schedule_worker(rank: int, world: int) -> dict:
    from flatshard import BackwardPrefetch, testing
    from flatshard import FullyShardedDataParallel as FSDP

    out = {}
    for bwd in (None, "BACKWARD_PRE", "BACKWARD_POST"):
        for fwd in (False, True):
            _, model, batch, loss_fn = build(
                "gpt_tie_in_root",
                "FULL_SHARD",
                forward_prefetch=fwd,
                backward_prefetch=BackwardPrefetch[bwd] if bwd else None,
            )
            wrappers = FSDP.fsdp_modules(model)
            ready = []  # whether each block unit was already gathered when its forward began
            for w in wrappers[1:]:
                w.register_forward_pre_hook(lambda mod, args: ready.append(testing.is_gathered(mod)))
            most = [0]

            def count():
                most[0] = max(most[0], testing.gathered_count(model))

            for step in range(2):
                x, y = batch(step, PER_RANK)
                ready.clear()
                with model.record_comms(events=True) as rec, testing.on_transition(model, count):
                    loss_fn(model(x), y).backward()
            names = [(e.kind, e.unit) for e in rec.events if e.phase == "backward"]
            out[(bwd, fwd)] = {
                "events": names,
                "ready": list(ready),
                "most_gathered": most[0],
                "counts": {k: v["count"] for k, v in rec.summary().items()},
            }
    return out


def test_prefetch_moves_collectives_not_their_number():
    results = run_distributed(schedule_worker, 2, timeout=200)
    for out in results:
        counts = {key: r["counts"] for key, r in out.items()}
        assert all(c == counts[(None, False)] for c in counts.values()), counts  # same collectives, same number
        b0, b1 = "blocks.0", "blocks.1"
        plain = out[(None, False)]["events"]
        assert plain == [
            ("all_gather", b1),
            ("reduce_scatter", b1),
            ("all_gather", b0),
            ("reduce_scatter", b0),
            ("reduce_scatter", "<root>"),
        ], plain
        for key in (("BACKWARD_PRE", False), ("BACKWARD_POST", False)):
            # the next unit's all-gather is issued before this unit's reduce-scatter
            assert out[key]["events"] == [
                ("all_gather", b1),
                ("all_gather", b0),
                ("reduce_scatter", b1),
                ("reduce_scatter", b0),
                ("reduce_scatter", "<root>"),
            ], out[key]["events"]
        # forward prefetch (from the second step, once the order is recorded): each block is already
        # gathered when its forward begins (the root prefetches blocks.0, blocks.0 prefetches blocks.1)
        assert out[(None, True)]["ready"] == [True, True], out[(None, True)]["ready"]
        assert out[(None, False)]["ready"] == [False, False]
        for r in out.values():
            assert r["most_gathered"] <= 2, "the rate limiter allows two gathered units besides the root"


class SwappingGPT(TinyGPT):
    """Runs its blocks in reverse order when ``swap`` is set: the forward order changes between passes."""

    swap = False

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in reversed(self.blocks) if self.swap else self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


def order_change_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    ref = SwappingGPT()
    model = FSDP(copy.deepcopy(ref), auto_wrap_policy=ModuleWrapPolicy({Block}), forward_prefetch=True)
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
    with captured_logs() as records:
        for swap in (False, False, True, True):
            ref.swap = model.module.swap = swap
            with torch.no_grad():
                torch.testing.assert_close(model(x), ref(x))
    return [r.getMessage() for r in records]


def test_changed_forward_order_is_noticed_and_stays_correct():
    for messages in run_distributed(order_change_worker, 2, timeout=120):
        assert len(messages) == 1 and "forward order of units changed" in messages[0], messages


class TwoPart(torch.nn.Module):
    """fp32 layers around one that a per-unit policy runs in bf16 (its output cast back by the model)."""

    def __init__(self):
        super().__init__()
        self.fc1, self.inner, self.fc2 = torch.nn.Linear(5, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.fc2(self.inner(self.fc1(x)).float())


def precision_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision, units

    bf16 = torch.bfloat16
    out = {}
    # bytes: a bf16 gather moves half of an fp32 gather; reduce in fp32 keeps reduce-scatter bytes
    for name, mp in (
        ("fp32", None),
        ("bf16", MixedPrecision(param_dtype=bf16)),
        ("bf16_reduce_fp32", MixedPrecision(param_dtype=bf16, reduce_dtype=torch.float32)),
    ):
        _, model, batch, loss_fn = build("gpt_tie_in_root", "FULL_SHARD", mixed_precision=mp)
        x, y = batch(0, PER_RANK)
        with model.record_comms() as rec:
            logits = model(x)
            loss_fn(logits.float(), y).backward()
        out[name] = (
            rec.wire_bytes("all_gather"),
            rec.wire_bytes("reduce_scatter"),
            logits.dtype,
            {p.grad.dtype for p in model.parameters()},
            {p.dtype for p in model.parameters()},
        )
    # parity with a reference that applies the same casts: a bf16 copy computes, fp32 masters step.
    # Each step starts the reference from flatshard's parameters, so bf16 rounding does not compound
    # over the 10 steps and every step is checked on its own.
    ref, model, batch, loss_fn = build(
        "gpt_tie_in_root", "FULL_SHARD", mixed_precision=MixedPrecision(param_dtype=bf16)
    )
    lr = 0.05
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    local = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    from tests.helpers.util import pairs

    for step in range(10):
        with FSDP.summon_full_params(model), torch.no_grad():
            full = dict(model.named_parameters())
            for n, p in ref.named_parameters():
                p.copy_(full[n])
        x, y = batch(step, world * PER_RANK)
        low = copy.deepcopy(ref).to(bf16)
        loss_fn(low(x).float(), y).backward()
        with torch.no_grad():
            for p, q in zip(ref.parameters(), low.parameters()):
                p.grad = q.grad.float()
                p.sub_(lr * p.grad)
        loss_fn(model(x[local]).float(), y[local]).backward()
        opt.step()
        # Gradients of parameters that sum over every token (norm weights) accumulate bf16 rounding
        # differently when two ranks each reduce half the batch: a few bf16 ulps of the sum, so they are
        # checked at 2.5x bf16's tolerance; the fp32 masters they update at bf16's relative tolerance,
        # with an absolute one of lr times the gradients'.
        for name, p, ref_val, ref_grad in pairs(model, ref):
            torch.testing.assert_close(
                p.grad, ref_grad, rtol=4e-2, atol=5e-3, msg=lambda m: f"bf16 step {step} grad {name}: {m}"
            )
            torch.testing.assert_close(
                p.detach(), ref_val, rtol=1.6e-2, atol=lr * 5e-3, msg=lambda m: f"bf16 step {step} {name}: {m}"
            )
        opt.zero_grad()
        ref.zero_grad()
    # a unit wrapped by hand with its own policy (bf16) inside an fp32 root
    torch.manual_seed(0)
    m = TwoPart()
    m.inner = FSDP(m.inner, mixed_precision=MixedPrecision(param_dtype=bf16, cast_forward_inputs=True))
    model = FSDP(m)
    seen = []
    m.inner.register_forward_hook(lambda mod, args, output: seen.append(output.dtype))
    with model.record_comms(events=True) as rec:
        out_fp32 = model(torch.randn(3, 5))
        out_fp32.sum().backward()
    inner_gather = [
        e.wire_bytes for e in rec.events if e.kind == "all_gather" and e.unit == "inner" and e.phase == "forward"
    ]
    expected = [(world - 1) * units(m.inner)[0].shard_numel * 2.0]  # bf16: 2 bytes per element
    out["per_unit"] = (
        seen,
        out_fp32.dtype,
        all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters()),
        inner_gather == expected,
    )
    return out


def test_mixed_precision_bytes_and_parity():
    for out in run_distributed(precision_worker, 2, timeout=200):
        fp32, bf16, mixed_reduce = out["fp32"], out["bf16"], out["bf16_reduce_fp32"]
        assert bf16[0] * 2 == fp32[0], "bf16 all-gathers move half the bytes"
        assert bf16[1] * 2 == fp32[1], "reduce_dtype defaults to param_dtype"
        assert mixed_reduce[0] == bf16[0] and mixed_reduce[1] == fp32[1], "reduce_dtype=fp32 reduces in fp32"
        assert bf16[2] == torch.bfloat16 and fp32[2] == torch.float32
        assert bf16[3] == {torch.float32} and bf16[4] == {torch.float32}, "masters and .grad stay fp32"
        assert out["per_unit"] == ([torch.bfloat16], torch.float32, True, True), out["per_unit"]


def offload_worker(rank: int, world: int) -> str:
    from flatshard import CPUOffload
    from flatshard import FullyShardedDataParallel as FSDP

    try:
        FSDP(TinyGPT(), cpu_offload=CPUOffload(offload_params=True))
    except ValueError as e:
        return str(e)
    return "no error"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only error; a CUDA machine offloads")
def test_cpu_offload_without_an_accelerator_is_a_clear_error():
    for msg in run_distributed(offload_worker, 2, timeout=60):
        assert "offload needs an accelerator compute device" in msg, msg


def bounded_worker(rank: int, world: int) -> dict:
    from flatshard import BackwardPrefetch, testing, units
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy

    out, grads = {}, {}
    cases = [
        (None, False),
        (BackwardPrefetch.BACKWARD_PRE, False),
        (BackwardPrefetch.BACKWARD_POST, False),
        (BackwardPrefetch.BACKWARD_PRE, True),
    ]  # the last: reductions left in flight, as on accelerators
    for bp, in_flight in cases:
        torch.manual_seed(0)
        model = FSDP(TinyGPT(layers=6, dim=24), auto_wrap_policy=ModuleWrapPolicy({Block}), backward_prefetch=bp)
        testing.set_overlap_reductions(model, in_flight)
        sizes = [(u.padded_numel * 4, u.numel * 4) for u in units(model)]
        x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
        with model.record_memory() as mem:
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1), x.flatten()).backward()
        out[(str(bp), in_flight)] = (mem.peak["gathered"], sizes)
        grads[(str(bp), in_flight)] = [p.grad.clone() for p in model.parameters()]
    base = grads[("None", False)]
    assert all(all(map(torch.equal, g, base)) for g in grads.values()), "overlap must not change gradients"
    return out


def test_prefetch_keeps_gathered_memory_bounded():
    """Whatever the depth: the root, the unit computing and its gradients (per parameter at the end of
    its backward; its parameters are freed before they are joined into the flat gradient: [Note: free
    before the flat gradient]), with prefetch the next unit, and with reductions in flight the one
    full-size gradient still being reduced. A reduction left in flight is finished at the next
    post-backward, before that unit's gradient is reduced, so reductions never accumulate. Gradients
    are the same bits in every case."""
    for out in run_distributed(bounded_worker, 2, timeout=120):
        for (key, in_flight), (peak, sizes) in out.items():
            root, (unit, unpadded) = sizes[0][0], max(sizes[1:])  # the per-parameter gradients have no padding
            expected = (
                root
                + {  # the largest moment of each schedule
                    "None": unit + unpadded,  # end of a unit's backward: its parameters and gradients
                    "BackwardPrefetch.BACKWARD_PRE": 2 * unit + unpadded,  # ... and the next unit, prefetched
                    "BackwardPrefetch.BACKWARD_POST": 2 * unit,  # post-backward: flat gradient and the next unit
                }[key]
                + (unit if in_flight else 0)
            )  # ... and the previous unit's gradient, still being reduced
            assert peak == expected, (key, in_flight, peak, expected)


def low_precision_grads_worker(rank: int, world: int) -> dict:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision
    from flatshard.wrap import ModuleWrapPolicy

    bf16 = torch.bfloat16
    x = torch.randint(0, 37, (2, 8), generator=torch.Generator().manual_seed(rank))
    seen = {}
    for keep in (False, True):
        torch.manual_seed(0)
        model = FSDP(
            TinyGPT(),
            auto_wrap_policy=ModuleWrapPolicy({Block}),
            mixed_precision=MixedPrecision(param_dtype=bf16, reduce_dtype=bf16, keep_low_precision_grads=keep),
        )
        grads = []
        with model.record_memory() as mem:
            for _ in range(2):
                torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
                grads.append([p.grad.clone() for p in model.parameters()])
                if not keep:  # fp32: each backward's gradients alone; bf16: the second accumulates into the first
                    model.zero_grad()
            nbytes = mem.sample()["grads"] if keep else None
        if not keep:
            torch.nn.functional.cross_entropy(model(x).flatten(0, 1).float(), x.flatten()).backward()
            nbytes = mem.sample()["grads"]
        norm = model.clip_grad_norm_(1.0)  # norms in fp32 from bf16 gradients
        torch.optim.SGD(model.parameters(), lr=0.1).step()
        assert torch.isfinite(norm) and all(p.dtype == torch.float32 for p in model.parameters())
        seen[keep] = (grads, nbytes)
    ((g1, g2), bytes_fp32), ((k1, k12), bytes_bf16) = seen[False], seen[True]
    assert all(g.dtype == torch.float32 for g in g1 + g2) and all(g.dtype == bf16 for g in k1 + k12)
    # the same reduced bf16 values: without keep_low_precision_grads they are only cast up (exactly)
    assert all(torch.equal(a.to(bf16), b) for a, b in zip(g1, k1))
    # accumulation happens in the gradients' own dtype, bf16
    assert all(torch.equal(a + b.to(bf16), c) for a, b, c in zip(k1, g2, k12))
    assert bytes_bf16 * 2 == bytes_fp32, (bytes_bf16, bytes_fp32)
    return {"grad_bytes": (bytes_fp32, bytes_bf16)}


def test_keep_low_precision_grads_hands_the_optimizer_reduce_dtype_gradients():
    """MixedPrecision(keep_low_precision_grads=True): ``.grad`` stays in reduce_dtype (half the bytes of
    fp32 for bf16), holds the same values that are otherwise cast up, and accumulates across backward
    passes in that dtype; clip_grad_norm_ and an optimizer step work on them."""
    results = run_distributed(low_precision_grads_worker, 2, timeout=120)
    assert results[0] == results[1]
