"""One configuration of the fuzzer (bench/fuzz/) on one rank: train the wrapped model beside the
unwrapped reference on the global batch (and, for ``fully_shard``, PyTorch's FSDP2), every step comparing
the loss, every gradient, every parameter after the step and every buffer ([Note: fuzz tolerances] in
check.py).

The loop is a user's: each step runs ``accum`` micro-batches (the first ones under ``no_sync()`` or
``set_requires_gradient_sync(False)``), may clip, and steps. Events of the configuration happen on every
model alike: before a step, a parameter's ``requires_grad`` is flipped or it is edited in place (the
wrapped model's rank edits its shard, the reference the whole parameter); during a step, an exception
raised by a hook (forward: a forward hook on a module raises; backward: a hook on that module's output
raises when its gradient arrives) is caught by the loop, which zeroes the gradients and skips the batch.
A checkpoint saved after step s is loaded at another world size (phase "B"), the reference replaying the
first s + 1 steps itself.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from bench.fuzz.build import LR, build_models, clean, make_optimizer, pg_count
from bench.fuzz.check import DEFAULT, EXACT, Checker, local_of, local_tensor
from bench.fuzz.models import batch, loss_fn
from bench.fuzz.reference import CastReference, emulated


class Injected(RuntimeError):
    """The exception a configuration injects; the training loop catches it and skips the batch (and, when
    ``reset``, calls the root's reset_iter_state())."""

    def __init__(self, message: str, reset: bool, set_to_none: bool = True):
        super().__init__(message)
        self.reset = reset
        self.set_to_none = set_to_none


ROLES = {"ref": "the reference", "ours": "flatshard", "theirs": "PyTorch's FSDP2"}


class SideError(RuntimeError):
    """An exception that was not injected, raised while one side trained."""

    def __init__(self, role: str, message: str):
        super().__init__(message)
        self.role = role


class Side:
    """One model being trained: the reference, flatshard's, or PyTorch FSDP2's."""

    def __init__(self, role: str, model, modules: dict, cfg: dict):
        self.role, self.model, self.cfg = role, model, cfg
        self.opt = make_optimizer(cfg, model)
        self.armed = None  # the "raise" event while its injection is due
        self.params = {clean(n): p for n, p in model.named_parameters()}
        self.groups_cfg = cfg  # the strategy of the steps being run (a checkpoint's, after it is loaded)
        self._casts: dict = {}
        self.handles = []
        for event in cfg["events"]:
            if event["kind"] == "raise":
                module = modules[event["module"]]
                self.handles.append(module.register_forward_hook(self._hook))

    def _hook(self, module, args, output):  # noqa: ARG002 - forward hook signature
        event, self.armed = self.armed, None
        if event is None:
            return
        reset = bool(event.get("reset"))
        if event["phase"] == "forward":
            raise Injected(f"injected in forward ({self.role})", reset)

        def fail(grad):  # noqa: ARG001 - tensor hook signature
            raise Injected(f"injected in backward ({self.role})", reset)

        output.register_hook(fail)

    def cast_reference(self, world: int, rank: int):
        """The reference's casts for ``world`` ranks ([Note: a reference that rounds as the ranks do]), or
        None where the reference is the fp32 run of the global batch."""
        if not emulated(self.cfg):
            return None
        key = (world, id(self.groups_cfg))
        if key not in self._casts:
            self._casts[key] = CastReference(self.model, self.cfg, self.groups_cfg, world, rank)
        return self._casts[key]

    def sync(self, on: bool):
        """Gradient synchronisation on or off for one micro-batch (a context manager)."""
        if self.role == "ref":
            return contextlib.nullcontext()
        if self.cfg["front"] == "fsdp1":
            return contextlib.nullcontext() if on else self.model.no_sync()
        self.model.set_requires_gradient_sync(on)
        return contextlib.nullcontext()


def _apply_event(side: Side, event: dict, ranges: dict) -> None:
    p = side.params[event["param"]]
    if event["kind"] == "flip":
        p.requires_grad_(event["value"])
        return
    with torch.no_grad():
        if event["how"] == "mul":
            p.mul_(event["factor"])
            return
        shape = getattr(p, "orig_shape", p.shape)
        g = torch.Generator().manual_seed(event["seed"])
        values = 0.3 * torch.randn(tuple(shape), generator=g)
        if side.role == "ref":
            p.copy_(values)
        elif hasattr(p, "to_local"):  # a DTensor: its local chunk
            p.to_local().copy_(local_of(values, p, ranges))
        else:  # a shard view: its slice of the parameter
            p.data.copy_(local_of(values, p, ranges))


def _run_step(side: Side, cfg: dict, step: int, world: int, rank: int) -> list | None:
    """The step's losses on this rank's rows (the reference's computed on the global batch), or None when
    an injected exception skipped it."""
    m, accum, spec = cfg["micro"], cfg["accum"], cfg["model"]
    local = slice(rank * m, (rank + 1) * m)
    due = [e for e in cfg["events"] if e["kind"] == "raise" and e["step"] == step]
    skip = next((e for e in cfg["events"] if e["kind"] == "skip" and e["step"] == step), None)
    losses = []
    cast = side.cast_reference(world, rank) if side.role == "ref" else None
    try:
        for j in range(accum):
            x, y = batch(spec, cfg["init_seed"], step, j, world * m)
            side.armed = next((e for e in due if e["micro"] == j), None)
            skipped = skip is not None and skip["micro"] == j
            if cast is not None:  # [Note: a reference that rounds as the ranks do] (reference.py)

                def skip_now(skipped=skipped):
                    if skipped:
                        raise Injected(f"loss skipped ({side.role})", False, skip["set_to_none"])

                losses.append(cast.micro(spec, x, y, m, accum, skip_now))
                continue
            with side.sync(j == accum - 1):
                if side.role == "ref":
                    out = side.model(x)
                    loss = loss_fn(spec, out, y) / accum
                    losses.append((loss_fn(spec, out[local], y[local]) / accum).detach())
                else:
                    out = side.model(x[local])
                    loss = loss_fn(spec, out, y[local]) / accum
                    losses.append(loss.detach())
                if skipped:  # the loop's guard finds the loss not finite
                    raise Injected(f"loss skipped ({side.role})", False, skip["set_to_none"])
                loss.backward()
        if cast is not None:
            cast.reduce_into_grads()
    except Injected as exc:
        if cast is not None:
            cast.discard(zeros=not exc.set_to_none)
        # PyTorch's FSDP2 recovers only through reset_iter_state() (its documented workflow: catch, reset,
        # next iteration), which may still finish reductions in flight: the gradients are zeroed after it.
        # flatshard puts its units back by itself ([Note: a step that raised]); fully_shard takes the call too
        if side.role == "theirs" or (side.role == "ours" and exc.reset):
            side.model.reset_iter_state()
        side.opt.zero_grad(set_to_none=exc.set_to_none)
        return None
    except Exception as exc:
        first = (str(exc).strip().splitlines() or [""])[0]
        raise SideError(side.role, f"{ROLES[side.role]} raised {type(exc).__name__}: {first}") from exc
    finally:
        side.armed = None
    return losses


def _clip(side: Side, max_norm: float):
    if side.role != "ref" and side.cfg["front"] == "fsdp1":
        return side.model.clip_grad_norm_(max_norm)
    if side.role == "ours" and side.cfg.get("whole"):  # each parameter on its owner's mesh: one all-reduce
        from flatshard.fsdp2 import clip_grad_norm_

        return clip_grad_norm_(list(side.model.parameters()), max_norm)
    if side.cfg.get("tp"):
        return _clip_by_mesh(list(side.model.parameters()), max_norm)
    norm = torch.nn.utils.clip_grad_norm_(list(side.model.parameters()), max_norm)
    return local_tensor(norm) if not hasattr(norm, "full_tensor") else norm.full_tensor()


def _clip_by_mesh(params: list, max_norm: float) -> torch.Tensor:
    """Clipping as FSDP + TP loops write it: torch's clip_grad_norm_ cannot stack the norms of DTensors on
    different meshes (data-parallel only, and data-parallel x TP), so each mesh's gradients are normed
    apart and the norms combined (every rank in the same order; the reference has one group)."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    norms = [torch.nn.utils.get_total_norm([p.grad for p in group]) for group in by_mesh.values()]
    total = torch.stack([n.full_tensor() if hasattr(n, "full_tensor") else n for n in norms]).norm()
    for group in by_mesh.values():  # one mesh per call: foreach kernels take one mesh
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, total)
    return total


def _same_layout(got, want) -> tuple:
    """``got`` and ``want`` as tensors of one layout: where flatshard's DTensor lies otherwise than FSDP2's
    (optimizer state across replicas: 1/W of each on the mesh flattened, against HSDP's 1/F; whole
    parameters on their owners), FSDP2's whole (``full_tensor()``, collective: every rank compares the same
    parameters in the same order) cut to what flatshard's holds on this rank."""
    from torch.distributed.tensor import DTensor

    if isinstance(got, DTensor) and isinstance(want, DTensor):
        if got.device_mesh != want.device_mesh or got.placements != want.placements:
            return got, local_of(want.full_tensor(), got, {})
    return got, want


class Run:
    def __init__(self, cfg: dict, rank: int, world: int, phase: str):
        from flatshard.testing import shard_ranges

        self.cfg, self.rank, self.world = cfg, rank, world
        ref, ours, theirs, modules = build_models(cfg, world, phase)
        self.ref = Side("ref", ref, modules["ref"], cfg)
        self.ours = Side("ours", ours, modules["ours"], cfg)
        self.theirs = Side("theirs", theirs, modules["theirs"], cfg) if theirs is not None else None
        self.ranges = shard_ranges(ours) if cfg["front"] == "fsdp1" else {}
        mixed, kind = bool(cfg.get("mp")), cfg["optim"]["kind"]
        self.check = Checker(mixed, kind, LR[kind])
        self.fsdp2_check = Checker(mixed, kind, LR[kind])  # PyTorch's FSDP2 against the reference: a witness
        self.check.loss_floor = self.fsdp2_check.loss_floor = 1.0 / cfg["accum"]
        self.fsdp2_until = None  # the step PyTorch's FSDP2 was dropped at
        self.fsdp2_error = None  # what it raised, if it did
        sizes = [world] if cfg.get("mesh") in ("default", "1d") else [world // cfg.get("F", world), cfg.get("F")]
        if cfg.get("tp"):  # the data-parallel reductions sum world / tp addends, the TP ones tp
            sizes = [world // cfg["tp"], cfg["tp"]]
        # [Note: fuzz tolerances]: bitwise against FSDP2 where every reduction is in fp32 and sums at most two
        # addends; fp32's defaults where it is in fp32; bf16's where it is in bf16
        bf16_reduce = mixed and cfg["mp"]["reduce"] == "bf16"
        self.vs_fsdp2 = "tight" if bf16_reduce else (EXACT if max(sizes) <= 2 else DEFAULT)
        if self.vs_fsdp2 == EXACT and cfg.get("opt_across") and cfg["optim"]["impl"] == "fused":
            self.vs_fsdp2 = DEFAULT  # a fused step vectorises 1/W of a tensor otherwise than 1/F: its tail rounds
        # [Note: a reference that rounds as the ranks do]: fp32's defaults against the reference, bf16
        # parameters included; those the reference does not emulate (reference.emulated): FSDP2 only
        self.vs_ref = DEFAULT
        self.against_ref = emulated(cfg) or not mixed

    def sides(self):
        return [s for s in (self.ref, self.ours, self.theirs) if s is not None]

    def _against_ref(self, step: int, what: str, side: Side, checker: Checker, tensors) -> None:
        """``tensors(param)`` -> the tensor to compare (the parameter or its gradient), for every parameter."""
        if not self.against_ref:
            return
        for name, p in side.params.items():
            r = self.ref.params[name]
            got, want = tensors(p), tensors(r)
            if got is None or want is None:
                if (got is None) != (want is None):
                    where = "the reference" if want is None else side.role
                    checker.fail(step, what, name, "reference", float("nan"), f"{what} is None on {where} only")
                continue
            checker.check(step, what, name, got, local_of(want.detach(), p, self.ranges), self.vs_ref)

    def _against_fsdp2(self, step: int, what: str, tensors) -> None:
        for (name, p), q in zip(self.ours.params.items(), self.theirs.params.values()):
            got, want = tensors(p), tensors(q)
            if got is not None and want is not None:
                got, want = _same_layout(got, want)
                self.check.check(step, what, name, got, want, self.vs_fsdp2, against="fsdp2")
            elif (got is None) != (want is None):
                self.check.fail(step, what, name, "fsdp2", float("nan"), f"{what} is None on one side only")

    def compare(self, step: int, what: str) -> None:
        """Every parameter (``what`` "param ...") or gradient ("grad") against the reference and FSDP2."""
        get = (lambda p: p.grad) if what == "grad" else (lambda p: p)
        self._against_ref(step, what, self.ours, self.check, get)
        if self.theirs is not None:
            self._against_ref(step, what, self.theirs, self.fsdp2_check, get)
            self._against_fsdp2(step, what, get)
        if what != "grad":
            refb = {clean(n): b for n, b in self.ref.model.named_buffers()}
            for name, b in self.ours.model.named_buffers():
                self.check.check(step, "buffer", clean(name), b, refb[clean(name)], EXACT)

    def step(self, step: int, ref_only: bool = False) -> None:
        sides = [self.ref] if ref_only else self.sides()
        for event in self.cfg["events"]:
            if event["kind"] in ("flip", "edit") and event["step"] == step:
                for side in sides:
                    _apply_event(side, event, self.ranges)
        world = self.cfg["W"] if ref_only else self.world  # the reference replays the steps before a checkpoint
        losses = {}
        for side in sides:
            try:
                tp = self.cfg.get("tp") or 1  # the TP ranks of one data-parallel rank take the same rows
                losses[side.role] = _run_step(side, self.cfg, step, world // tp, self.rank // tp)
            except SideError as exc:
                if exc.role != "theirs":
                    raise
                # PyTorch's FSDP2 cannot run this configuration (every rank raises alike): go on without it
                self.theirs, self.fsdp2_until, self.fsdp2_error = None, step, str(exc)
        sides = [s for s in sides if s.role in losses]
        if ref_only:
            if losses["ref"] is not None:
                grad_max = self._grad_max()
                if self.cfg.get("clip"):
                    _clip(self.ref, self.cfg["clip"])
                self.ref.opt.step()
                self.ref.opt.zero_grad()
                self.check.advance_param_tolerance(grad_max)
            return
        skipped = {role for role, v in losses.items() if v is None}
        if skipped and skipped != {s.role for s in sides}:
            detail = f"the injected exception was raised by {sorted(skipped)} only"
            self.check.fail(step, "skip", "-", "reference", float("nan"), detail)
        if not skipped:
            self._compare_and_step(step, losses)
        self.compare(step, "param after step")
        if not skipped and self.theirs is not None:  # losses, gradients and parameters of this rank
            self.check.bitwise_steps.append(self.check.equal_now)

    def _grad_max(self) -> float:
        grads = [p.grad for p in self.ref.params.values() if p.grad is not None]
        return max((g.abs().max().item() for g in grads if g.numel()), default=0.0)

    def _compare_and_step(self, step: int, losses: dict) -> None:
        self.check.equal_now = True  # every comparison with FSDP2 of this step bitwise equal so far
        for j, (a, b) in enumerate(zip(losses["ours"], losses["ref"])):
            if self.against_ref:
                self.check.check(step, "loss", f"micro {j}", a, b, self.vs_ref)
            if self.theirs is not None:
                self.check.check(step, "loss", f"micro {j}", a, losses["theirs"][j], self.vs_fsdp2, "fsdp2")
        grad_max = self._grad_max()
        self.check.grad_scale = self.fsdp2_check.grad_scale = grad_max
        self.compare(step, "grad")
        if self.cfg.get("clip"):
            norms = {s.role: _clip(s, self.cfg["clip"]) for s in self.sides()}
            if self.against_ref:
                self.check.check(step, "grad norm", "-", norms["ours"], norms["ref"], self.vs_ref)
            if self.theirs is not None:
                self.check.check(step, "grad norm", "-", norms["ours"], norms["theirs"], self.vs_fsdp2, "fsdp2")
        for side in self.sides():
            side.opt.step()
            side.opt.zero_grad()
        self.check.advance_param_tolerance(grad_max)


def run(rank: int, world: int, cfg: dict, phase: str, ckpt_dir: str | None) -> dict:
    """Phase "whole": every step. "A": steps up to the checkpoint, then save. "B": load at this world
    size (the reference replays the steps before) and run the rest."""
    torch.set_num_threads(1)
    try:
        run_ = Run(cfg, rank, world, phase)
    except Exception as exc:  # noqa: BLE001 - a refusal is reported (and judged) by the parent
        from flatshard import NotBuiltError

        if isinstance(exc, (ValueError, NotBuiltError)):
            return {"refused": f"{type(exc).__name__}: {exc}", "groups": pg_count()}
        raise
    steps = range(cfg["steps"])
    ckpt = cfg.get("ckpt")
    if phase == "A":
        steps = range(ckpt["after_step"] + 1)
    elif phase == "B":
        for s in range(ckpt["after_step"] + 1):
            run_.step(s, ref_only=True)
        # a checkpoint holds no .grad: the gradients that parameters outside the optimizer accumulate
        # (frozen at construction, so not in AdamW's groups, then unfrozen) start again from none
        run_.ref.model.zero_grad(set_to_none=True)
        run_.ref.groups_cfg = {**cfg, **ckpt}  # the reference's reduction is the new strategy's from here
        _load(run_, ckpt_dir)
        run_.compare(ckpt["after_step"], "param after load")
        steps = range(ckpt["after_step"] + 1, cfg["steps"])
    for s in steps:
        run_.step(s)
    if phase == "A":
        from flatshard import checkpoint

        checkpoint.save(ckpt_dir, run_.ours.model, run_.ours.opt, step=ckpt["after_step"])
    dist.barrier()
    c = run_.check
    return {
        "mismatch": c.first,
        "mismatches": c.firsts,
        "fsdp2_vs_reference": run_.fsdp2_check.first,
        "fsdp2_until": run_.fsdp2_until,
        "fsdp2_error": run_.fsdp2_error,
        "compared": c.compared,
        "margins": c.margins,
        "bitwise_steps": c.bitwise_steps,
        "bitwise_held": run_.vs_fsdp2 == EXACT,
        "groups": pg_count(),
    }


def _load(run_: Run, ckpt_dir: str) -> None:
    from flatshard import checkpoint

    for event in run_.cfg["events"]:  # requires_grad is not in a checkpoint: the flips so far, again
        if event["kind"] == "flip" and event["step"] <= run_.cfg["ckpt"]["after_step"]:
            _apply_event(run_.ours, event, run_.ranges)
    checkpoint.load(ckpt_dir, run_.ours.model, run_.ours.opt)
