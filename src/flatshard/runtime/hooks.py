"""Every hook flatshard registers, and what each does, in the order one step runs them.

Each runs under ``torch.profiler.record_function("flatshard::<hook> (<unit>)")``, the unit named
by its fully qualified module name (``blocks.3``; ``<root>`` for the root), as FSDP2 labels
``FSDP::pre_forward (layers.3)``. The public entry points that communicate (clip_grad_norm_,
summon_full_params, state dicts, checkpoints) run under ``flatshard::<entry point>`` (instrument.py, ``label``).

  pre_forward     the front end's forward (FSDP1: the wrapper's ``forward``; fully_shard: a
                  forward pre-hook): gather, set compute views, record the order, prefetch the next
  post_forward    after the module's forward: shard views back; reshard unless the root or
                  SHARD_GRAD_OP; hook the outputs for pre-backward
  pre_backward    a tensor hook on the unit's outputs: the first gradient to arrive gathers the
                  unit again and prefetches the previous one (BACKWARD_PRE); the first of a pass
                  queues end_of_backward
  split backward  a prehook on the compute views' split node: free the parameters before autograd
                  joins their gradients ([Note: free before the flat gradient])
  post_backward   each flat group's unsharded flat's post-accumulate-grad hook: start the group's reduction
                  (``post_backward_reduce``), reshard; finish the previous unit's reduction
  end_of_backward one autograd-engine callback per backward pass: finish reductions in flight,
                  expose ``.grad`` on shard views, reshard what is still gathered
"""

from __future__ import annotations

import functools
import sys
import weakref
from typing import Any

import torch
from torch.autograd import Variable
from torch.utils._pytree import tree_flatten, tree_unflatten

from flatshard.runtime import precision
from flatshard.runtime.flat_group import FlatGroup
from flatshard.runtime.instrument import label
from flatshard.runtime.schedule import RunContext, run_context
from flatshard.runtime.unit import Unit


# ---- forward ----------------------------------------------------------------------------------
# [Note: hooks under compile]
# A compiled module (``block.compile()``, ``torch.compile(block)``, ``torch.compile(model)``, before or
# after wrapping) runs flatshard's forward hooks eagerly: each is ``torch.compiler.disable``d, so dynamo
# stops at it (a graph break) and compiles the module's own code between them, as FSDP2's hooks do.
# Traced, they would break the graph anyway (point-to-point collectives, data-dependent checks) and, worse,
# be re-traced into many small graphs. Backward hooks (tensor hooks, post-accumulate-grad hooks, the
# end-of-backward callback) run in the autograd engine, outside dynamo.
def forward(unit: Unit, module: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """Run ``module`` (the unit's module) between the unit's pre- and post-forward."""
    if unit.summoned:  # [Note: forward inside summon_full_params] (summon.py)
        return module(*args, **kwargs)
    args, kwargs = _enter_forward(unit, args, kwargs)
    completed = False
    try:
        output = module(*args, **kwargs)
        completed = True
    finally:
        _leave_forward(unit, completed)
    return _hook_outputs(unit, output)


def _begin_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """What both front ends do as a unit's forward begins: the run starts (buffers cast), the inputs are
    cast to the compute dtype (MixedPrecision), and the root begins the pass."""
    ctx = run_context(unit)
    ctx.start()
    p = unit.precision
    if p.mixed and (p.cast_forward_inputs or (unit.is_root and p.cast_root_forward_inputs)):
        args, kwargs = precision.cast_floating((args, kwargs), p.compute)
    if unit.is_root:
        ctx.begin_forward()
    return args, kwargs


@torch.compiler.disable
def _enter_forward(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    args, kwargs = _begin_forward(unit, args, kwargs)
    try:
        pre_forward(unit)
    except BaseException:
        if unit.is_root:
            run_context(unit).end_forward(False)
        raise
    return args, kwargs


@torch.compiler.disable
def _leave_forward(unit: Unit, completed: bool) -> None:
    try:
        post_forward(unit)
    finally:
        if unit.is_root:
            run_context(unit).end_forward(completed)


@torch.compiler.disable
def _hook_outputs(unit: Unit, output: Any) -> Any:
    if torch.is_grad_enabled():
        register_pre_backward(output, unit)
    return output


# ---- the forward of fully_shard: module hooks instead of a wrapper's forward --------------------------
@torch.compiler.disable
def forward_pre_hook(unit: Unit, _module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple:
    """fully_shard's forward pre-hook: what ``forward`` does before calling the module."""
    if unit.summoned:
        raise RuntimeError("fully_shard modules have no summon_full_params; use FSDPModule.unshard()")
    args, kwargs = _begin_forward(unit, args, kwargs)
    unit.forward_entries.append(sys.exc_info()[1])
    if unit.settings.reduce_scatter_unused_params and torch.is_grad_enabled() and not unit.ctx.in_backward:
        args, kwargs = _hook_inputs(unit, args, kwargs)  # before pre_forward makes the compute views
    pre_forward(unit)
    return args, kwargs


@torch.compiler.disable
def forward_post_hook(unit: Unit, output_dtype, _module: torch.nn.Module, _args: tuple, output: Any) -> Any:
    """fully_shard's forward hook: what ``forward`` does after the module returned (``output_dtype``:
    MixedPrecisionPolicy's cast of the outputs). Registered with ``always_call``, so it also runs when the
    forward raised ([Note: a step that raised], schedule.py): an exception other than the one being handled
    when the forward began (a forward called inside an ``except`` block sees that one on both sides) is
    propagating, and the unit reshards at once."""
    entered = unit.forward_entries.pop() if unit.forward_entries else None
    raised = sys.exc_info()[1] is not entered
    post_forward(unit)
    if unit.is_root:
        run_context(unit).end_forward(not raised)
    if raised:
        return None
    if output_dtype is not None:
        output = precision.cast_floating(output, output_dtype)
    if torch.is_grad_enabled():
        register_pre_backward(output, unit)
    return output


def pre_forward(unit: Unit) -> None:
    with label("pre_forward", unit.name):
        ctx = run_context(unit)
        for group in unit.refresh_requires_grad():  # requires_grad changed on a shard view since the last forward
            register_post_backward(unit, group)
        unit.unshard()
        _use_compute_views(unit)
        if not ctx.in_backward:
            ctx.record_forward(unit)
            if unit.settings.forward_prefetch:  # explicit targets (fully_shard's set_modules_to_forward_prefetch)
                for target in unit.settings.forward_prefetch:
                    target.unshard(wait=False)
            else:
                ctx.prefetch_forward()


# [Note: recomputation in backward]
# Activation checkpointing runs a unit's forward again during backward. Whether the checkpoint
# wraps the unit (its forward, with these hooks, runs again) or sits inside it (the module reads
# its parameters directly), the unit must be gathered with compute views set on its modules until
# its post-backward; so a forward that runs in the backward phase neither reshards nor puts the
# shard views back, and pre-backward sets compute views too.
def post_forward(unit: Unit) -> None:
    with label("post_forward", unit.name):
        if unit.ctx.in_backward:
            return
        unit.use_shard_views()
        if (unit.settings.reshard_after_forward and not unit.is_root) or not torch.is_grad_enabled():
            unit.reshard(after_forward=torch.is_grad_enabled())


def _use_compute_views(unit: Unit) -> None:
    for group, split in unit.use_compute_views():
        if split is not None and not unit.ctx.in_backward:  # its backward will build the group's flat gradient
            group.open_splits += 1
            split.register_prehook(functools.partial(_on_split_backward, unit, group))


# [Note: free before the flat gradient]
# Backward of the compute views' split concatenates their gradients into one flat gradient, a
# buffer the size of the unsharded flat. By the time it runs, every operator that reads these views
# has run its backward, so when it is the last open split of this unit (a unit run twice in one pass
# has two) the unsharded flat is freed first: backward then holds the gradients and the flat
# gradient, never the parameters as well, and the peak of a unit's backward drops by one unsharded
# flat. Only splits made outside backward count: a recomputation's split (activation checkpointing)
# never runs its backward (non-reentrant) or runs it with the parameters no longer needed after
# (reentrant, where the unit then reshards in post-backward). A split made before the last backward
# ended (counts reset there) leaves the count off zero: the unit then reshards in post-backward.
def _on_split_backward(unit: Unit, group: FlatGroup, grad_outputs) -> None:
    with label("split_backward", unit.name):
        group.open_splits -= 1
        # The group's backward peak: its parameters and every per-parameter gradient, about to be joined.
        group.view_grad_bytes = sum(g.untyped_storage().nbytes() for g in grad_outputs if g is not None)
        ctx = unit.ctx
        ctx.sample_memory()
        settings = unit.settings
        early = settings.reshard_after_backward and (unit.sync or settings.reshard_after_forward)
        if group.open_splits == 0 and ctx.in_backward and early:
            group.use_shard_views()
            group.reshard()
    return None


# ---- backward ---------------------------------------------------------------------------------
def register_pre_backward(output: Any, unit: Unit) -> None:
    """Hook every output tensor that needs a gradient: the first gradient to arrive gathers the unit."""
    tensors, _ = tree_flatten(output)

    def hook(_grad_output: torch.Tensor) -> None:
        pre_backward(unit)

    for t in tensors:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)


def pre_backward(unit: Unit) -> None:
    with label("pre_backward", unit.name):
        ctx = run_context(unit)
        begin_backward(ctx)
        unit.unshard()
        if not unit.compute_views_set:
            # the autograd engine runs hooks with grad off; a recomputation (activation checkpointing inside
            # the unit) must read views that need a gradient, made by a split, as forward's did, or autograd
            # saves other tensors than forward did ([Note: recomputation in backward])
            with torch.enable_grad():
                _use_compute_views(unit)
        if unit.settings.backward_prefetch:  # explicit targets (fully_shard's set_modules_to_backward_prefetch)
            for target in unit.settings.backward_prefetch:
                target.unshard(wait=False)
        else:
            ctx.prefetch_backward(unit, pre=True)


def register_post_backward(unit: Unit, group: FlatGroup) -> None:
    """At construction (and when a parameter is unfrozen later): a flat group's unsharded flat's gradient,
    once complete, starts the group's reduction. Registered once per group."""
    if group.requires_grad and group.post_backward_hook is None:
        # [Note: hooks hold units weakly]
        # The hook lives in the unsharded flat's C++ autograd metadata, which Python's collector cannot
        # traverse: a hook that held its unit strongly would keep the unit, the wrapped model and its
        # process groups alive until the process exits, and groups destroyed during interpreter
        # finalization can abort the process from a gloo worker thread. Held weakly, a dropped model is
        # freed by one gc.collect(), which destroys its groups while the interpreter is alive.
        unit_ref, group_ref = weakref.ref(unit), weakref.ref(group)

        def hook(unsharded: torch.Tensor) -> None:
            alive, alive_group = unit_ref(), group_ref()
            if alive is not None and alive_group is not None:
                if alive.settings.reduce_scatter_unused_params and alive.inputs_hooked:
                    # reduced in the backward of the unit's inputs ([Note: unused parameters in a reduction])
                    alive_group.grad_waiting = True
                    return
                post_backward(alive, alive_group, unsharded)

        group.post_backward_hook = group.unsharded.register_post_accumulate_grad_hook(hook)


def post_backward(unit: Unit, group: FlatGroup, unsharded: torch.Tensor) -> None:
    """A flat group's unsharded flat's gradient is complete: start reducing it to this rank's shard, and
    free the group (only this group: another group of the unit may still be in its backward)."""
    with label("post_backward", unit.name):
        ctx = run_context(unit)
        settings = unit.settings
        group.view_grad_bytes = 0  # joined into the flat gradient by now
        group.reduced_in_backward = True
        begin_backward(ctx)
        # The reduction left in flight by the previous unit has had this unit's backward to finish:
        # finish it now, so at most one full-size gradient is ever waiting for its reduce-scatter (or as
        # many as fully_shard's set_reduce_scatter_max_input_buffers allows).
        ctx.settle_reductions(keep=ctx.max_reductions_in_flight - 1)
        ctx.finish_in_flight(group)
        ctx.sample_memory()
        unit.use_shard_views()
        if not unit.sync:
            group.keep_unsynced_gradient(unsharded)  # no_sync: accumulates unreduced until a synchronised backward
            if settings.reshard_after_forward and settings.reshard_after_backward:
                group.reshard()
            return
        ctx.prefetch_backward(unit, pre=False)  # BACKWARD_POST: the next gather goes before this reduction
        in_flight = ctx.reduction_in_flight(group)  # [Note: reductions in flight] (schedule.py)
        with label("post_backward_reduce", unit.name):
            group.start_reduction(unsharded, async_op=in_flight)  # takes the flat gradient off ``unsharded``
        if settings.reshard_after_backward:
            group.reshard()
        if in_flight:
            ctx.pending_reductions.append(group)  # finished at the next post-backward or the end of backward
        else:
            ctx.settle(group)  # finished now, or (across nodes) left in flight until the end of backward


# [Note: unused parameters in a reduction]
# fully_shard's set_reduce_scatter_unused_params(True), FSDP2's: a trainable flat group whose parameters
# got no gradient on this rank in a backward (an MoE's experts that received no token and were skipped)
# still takes part in its group's reduce-scatter, with zeros, so its peers' gradients are right and none
# waits. Its post-accumulate-grad hook never fires, and CPU collectives block, so every group of such a
# unit is reduced at one point every rank reaches, in the unit's group order, zeros for a group with no
# gradient: the backward of the unit's inputs (a node made before the unit's compute views, so the autograd
# engine, which runs a backward's nodes newest first, runs it after the views' gradients are joined), as
# FSDP2 reduces in the backward of its module's inputs; the groups' hooks then only leave the flat gradient
# on the unsharded flat. (Reducing each group as its gradient completed deadlocks: a rank whose experts had
# no gradient enters the dense group's reduce-scatter while its expert peer is in the experts'.) A unit whose
# inputs need no gradient (the root, on token
# ids) reduces them at the end of backward, where a rank that used them reduced its last too; so does a
# unit gathered at the end of backward (the root, reshard_after_forward=False) that got none, as FSDP2's
# final callback does. Without the setting such a group is not reduced, as in FSDP2 (on every rank alike:
# its parameters' .grad stay as they were; on some ranks only: collectives mismatch, which the first
# step's order checks, and every step's under TORCH_DISTRIBUTED_DEBUG=DETAIL, report by name).
def _hook_inputs(unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    flat, spec = tree_flatten((args, kwargs))
    at = [i for i, t in enumerate(flat) if torch.is_tensor(t) and t.requires_grad]
    if at:
        unit.inputs_hooked = True
        outs = _InputsBackward.apply(unit, *(flat[i] for i in at))
        for i, t in zip(at, outs if isinstance(outs, tuple) else (outs,)):
            flat[i] = t
    return tree_unflatten(flat, spec)


class _InputsBackward(torch.autograd.Function):
    """The identity on a unit's inputs; its backward reduces the unit's unused groups."""

    @staticmethod
    def forward(ctx, unit, *tensors):
        ctx.unit = weakref.ref(unit)
        outs = tuple(t.view_as(t) for t in tensors)
        return outs if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        unit = ctx.unit()
        if unit is not None:
            reduce_unused(unit)
        return (None, *grads)


def reduce_unused(unit: Unit) -> None:
    """Reduce zeros for each trainable group of ``unit`` that is gathered in this backward and got no
    gradient ([Note: unused parameters in a reduction])."""
    if not (unit.settings.reduce_scatter_unused_params and unit.ctx.in_backward):
        return
    for group in unit.flat_groups:
        waiting, group.grad_waiting = group.grad_waiting, False
        if waiting or (group.requires_grad and not group.reduced_in_backward and group.gathered):
            unsharded = group.unsharded
            if unsharded.grad is None:
                unsharded.grad = torch.zeros_like(unsharded)
            post_backward(unit, group, unsharded)
    unit.inputs_hooked = False


def begin_backward(ctx: RunContext) -> None:
    """The first backward hook of a pass queues end_of_backward with the autograd engine."""
    if ctx.begin_backward():
        Variable._execution_engine.queue_callback(functools.partial(end_of_backward, ctx))


def end_of_backward(ctx: RunContext) -> None:
    with label("end_of_backward"):
        for unit in ctx.units:
            reduce_unused(unit)
        ctx.end_of_backward()
