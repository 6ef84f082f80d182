"""``FSDPModule``: PyTorch FSDP2's methods on a module ``fully_shard`` (frontend.py) was applied to.

``fully_shard`` swaps each module's class for one that also derives from ``FSDPModule`` and gives it its unit
(``_unit``). Its methods act on that unit, or on every unit under the module (``recurse``): gather and
free it (``unshard``, ``reshard``), change what the engine does with it (``set_*``: the unit's settings,
runtime/context.py ``UnitSettings``), and flatshard's recorders. FSDP2's methods that flatshard has not
built raise ``NotBuiltError`` naming what to do instead.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import nn

from flatshard import interop
from flatshard.api import NotBuiltError
from flatshard.fsdp2 import checks
from flatshard.runtime import recording
from flatshard.runtime.schedule import run_context
from flatshard.runtime.tree import UnitHost, units_under
from flatshard.runtime.unit import Unit


class UnshardHandle:
    """What ``unshard(async_op=True)`` returns: ``wait()`` blocks until the parameters have arrived."""

    def __init__(self, unit: Unit):
        self._unit = unit

    def wait(self) -> None:
        self._unit.wait_for_unshard()


def _not_built(name: str, instead: str):
    def method(self, *args, **kwargs):  # noqa: ARG001 - any call raises
        raise NotBuiltError(f"FSDPModule.{name} is not built in flatshard's fully_shard; {instead}")

    method.__name__ = name
    return method


class FSDPModule(UnitHost, interop.TorchFSDPModule):
    """FSDP2's methods on a module ``fully_shard`` was applied to (a mixin of its new class); also a
    ``torch.distributed.fsdp.FSDPModule`` (interop.TorchFSDPModule says why)."""

    _orig_cls: type[nn.Module]  # the class fully_shard made this one from (_fsdp_class sets it on each)
    fsdp_output_dtype: Optional[torch.dtype] = None  # MixedPrecisionPolicy.output_dtype
    post_optim_event: Optional[Any] = None  # set_post_optim_event's, waited on by the next forward

    def __new__(cls, *args, **kwargs):
        """A sharded container indexed or sliced (``model[:2]`` builds ``type(model)(...)``) gives a
        module of the original class, as FSDP2's does: the new module holds no unit."""
        orig = cls._orig_cls
        self = orig.__new__(orig)
        orig.__init__(self, *args, **kwargs)
        return self

    def __deepcopy__(self, memo):
        raise checks.FullyShardUsageError(
            f"FSDP does not support deepcopy of a module fully_shard was applied to ({type(self).__name__}): its "
            "parameters are shards over a process group. Copy the model before calling fully_shard, or build a "
            "second one and load the first one's state dict into it."
        )

    def _units(self, recurse: bool) -> list[Unit]:
        return units_under(self) if recurse else [self._unit]

    def unshard(self, async_op: bool = False) -> UnshardHandle | None:  # type: ignore[override]  # flatshard's handle
        """All-gather this module's parameters now (its forward then finds them gathered)."""
        self._unit.unshard(wait=not async_op)
        return UnshardHandle(self._unit) if async_op else None

    def reshard(self) -> None:
        """Free this module's gathered parameters."""
        self._unit.use_shard_views()
        self._unit.reshard()

    def set_requires_gradient_sync(self, requires_gradient_sync: bool, *, recurse: bool = True) -> None:
        """False: gradients accumulate unreduced over the following backwards (gradient accumulation);
        the first backward after setting True again reduces the sum. Sets ``set_requires_all_reduce``
        alike, as FSDP2's does."""
        for unit in self._units(recurse):
            unit.settings.requires_gradient_sync = requires_gradient_sync
            unit.settings.requires_all_reduce = requires_gradient_sync

    def set_requires_all_reduce(self, requires_all_reduce: bool, *, recurse: bool = True) -> None:
        """HSDP: False reduce-scatters each backward's gradients within the shard group but does not
        all-reduce them across replicas; this rank's shard of the sum is kept (reduce dtype, undivided) and
        the next backward that all-reduces adds it first, so gradient accumulation sends one all-reduce per
        window. Nothing reaches ``.grad`` meanwhile ([Note: an open accumulation window],
        runtime/grad_state.py). On a 1-D mesh there is no all-reduce and nothing changes, as in FSDP2."""
        units = self._units(recurse)
        for unit in units:
            if not requires_all_reduce and unit.self_gathered is not None and _replicas(unit) > 1:
                raise NotBuiltError(
                    f"set_requires_all_reduce(False) is not built for {unit.name!r}, whose parameters include "
                    "tensor subclasses that gather themselves (FSDP2's all-gather extensions) on a 2-D mesh: "
                    "use set_requires_gradient_sync(False) for the accumulation's micro-batches"
                )
            if not requires_all_reduce and any(g.pieces is not None for g in unit.flat_groups):
                raise NotBuiltError(
                    f"set_requires_all_reduce(False) is not built for {unit.name!r}, whose optimizer state is split "
                    "across replicas (shard_optimizer_across_replicas=True): use set_requires_gradient_sync(False) "
                    "for the accumulation's micro-batches"
                )
        for unit in units:
            unit.settings.requires_all_reduce = requires_all_reduce

    def set_reshard_after_forward(self, reshard_after_forward: bool, recurse: bool = True) -> None:
        """True: free the parameters after forward (every unit but the root); False: keep them for
        backward. A bool, as FSDP2's (an int raises its ValueError: pass it to ``fully_shard``); it
        replaces a ``reshard_after_forward=int`` the unit was built with, as in FSDP2."""
        if not isinstance(reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward should be a bool, got {type(reshard_after_forward)}")
        for unit in self._units(recurse):
            unit.settings.reshard_after_forward = reshard_after_forward
            for group in unit.flat_groups:  # [Note: reshard after forward to a smaller group]: no longer
                group.gather.post_forward = None

    def set_reshard_after_backward(self, reshard_after_backward: bool, *, recurse: bool = True) -> None:
        for unit in self._units(recurse):
            unit.settings.reshard_after_backward = reshard_after_backward

    def set_modules_to_forward_prefetch(  # type: ignore[override]  # flatshard's FSDPModules (others raise)
        self, modules: list[FSDPModule]
    ) -> None:
        """Gather these modules' parameters as this module's forward begins (instead of the recorded order)."""
        self._unit.settings.forward_prefetch = [_host_unit(m, "set_modules_to_forward_prefetch") for m in modules]

    def set_modules_to_backward_prefetch(  # type: ignore[override]  # flatshard's FSDPModules (others raise)
        self, modules: list[FSDPModule]
    ) -> None:
        """Gather these modules' parameters as this module's backward begins."""
        self._unit.settings.backward_prefetch = [_host_unit(m, "set_modules_to_backward_prefetch") for m in modules]

    # ---- flatshard's recorders, as on FullyShardedDataParallel (the root's) -----------------------------
    def record_comms(self, *, events: bool = False):
        """Count every collective flatshard issues for this model inside the block (the root's run context)."""
        return recording.record_comms(run_context(self._unit), events=events)

    def record_memory(self, optimizer: Optional[torch.optim.Optimizer] = None, *, timeline: bool = False):
        """Follow the bytes flatshard manages on this rank (and the optimizer's state) and their peak."""
        return recording.record_memory(run_context(self._unit), optimizer, [], timeline=timeline)

    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        return recording.memory_bytes(run_context(self._unit), optimizer, [])

    def reset_iter_state(self) -> None:
        """After a forward or backward that raised, put the step's state back now: wait for collectives in
        flight, discard the gradients not yet on ``.grad`` (with any unreduced accumulation), reshard every
        unit. flatshard also does this by itself when the next forward begins ([Note: a step that raised],
        runtime/schedule.py); call it to free the gathered parameters at once. On the root, as FSDP2's."""
        if not self._unit.is_root:
            raise RuntimeError("reset_iter_state must be called on the root module (the outermost fully_shard)")
        run_context(self._unit).recover(force=True)

    def set_is_last_backward(self, is_last_backward: bool) -> None:  # noqa: ARG002 - accepted, unused
        """Accepted for FSDP2's scripts: flatshard finishes every backward's reductions at its end, so
        whether a backward is the last of an accumulation changes no result and no schedule."""

    def set_post_optim_event(self, event) -> None:
        """The next forward's all-gathers wait for ``event`` (recorded after ``optimizer.step()``), FSDP2's
        method; flatshard waits on the host once, as the root's next forward begins."""
        self.post_optim_event = event

    def set_unshard_in_backward(self, unshard_in_backward: bool) -> None:  # noqa: ARG002 - accepted, unused
        """Accepted for FSDP2's scripts: flatshard gathers every unit in backward, so False (an embedding,
        whose backward needs no weights) saves that all-gather in FSDP2 but changes no result here."""

    def set_gradient_divide_factor(self, factor: float) -> None:
        """Divide this module's summed gradients by ``factor`` instead of the data-parallel size. This
        module only, not those under it, as in FSDP2 (torchtitan calls it on every ``FSDPModule``)."""
        self._unit.settings.gradient_divide_factor = float(factor)

    set_reduce_scatter_divide_factor = set_gradient_divide_factor

    def set_force_sum_reduction_for_comms(self, enable: bool) -> None:
        """This module's reduce-scatter and all-reduce use only sums, the division a step of its own
        (FSDP2's, for collectives such as NCCL's zero-copy ones that offer only SUM). flatshard's always do,
        so gradients do not change; what changes is what ``set_all_reduce_hook``'s hook sees: the sum,
        divided after the hook, instead of the divided gradient (runtime/reduce.py: ``ReduceSpec.hook_sees_sum``).
        This module only, not those under it, as in FSDP2."""
        self._unit.settings.force_sum_reduction_for_comms = enable

    def set_all_reduce_hook(self, hook: Callable[[torch.Tensor], None], *, stream=None) -> None:
        """Run ``hook(reduce_output)`` on this rank's reduced shard of this module's gradients (reduce dtype,
        FSDP2's chunk layout: every parameter's chunk, padded) as each backward reduces it: after the
        all-reduce across replicas under HSDP, after the reduce-scatter otherwise; before the division by
        the data-parallel size or after it as FSDP2 divides (``set_force_sum_reduction_for_comms``). It may
        change the tensor in place; ``.grad`` gets the result. FSDP2's hook sees only the parameters that
        got a gradient in that backward; flatshard's, every parameter of the module (zeros for the others).
        This module only, not those under it, as in FSDP2. ``stream`` is not built (leave it unset: the hook
        runs on the compute stream, after the reduction); under HSDP it raises FSDP2's ValueError."""
        unit = self._unit
        if stream is not None:
            if _replicas(unit) > 1:
                raise ValueError("stream cannot be set when using native HSDP")
            raise NotBuiltError(
                "set_all_reduce_hook(stream=...) is not built in flatshard's fully_shard; leave stream unset: "
                "the hook runs on the compute stream once the reduction is done"
            )
        if unit.self_gathered is not None:
            raise NotBuiltError(
                f"set_all_reduce_hook is not built for {unit.name!r}, whose parameters include tensor subclasses "
                "that gather themselves (FSDP2's all-gather extensions; reduced apart from the others): "
                "apply the hook's change to the gradients after backward instead"
            )
        unit.settings.all_reduce_hook = hook

    def set_reduce_scatter_max_input_buffers(self, max_input_buffers: int, *, recurse: bool = True) -> None:
        """How many reductions may be in flight at once (FSDP2's cap on its reduce-scatter input buffers,
        default 1): where flatshard leaves a reduction in flight while the next unit's backward computes
        (an accelerator; [Note: reductions in flight], runtime/schedule.py), up to this many full-size
        gradients wait for their collectives before the oldest is finished. The largest value among a
        root's modules counts, as in FSDP2 (flatshard reads it at each backward; FSDP2 at its first forward).
        On CPU each reduction finishes before the next unit computes, so nothing changes there but the
        check of the value (FSDP2 then only keeps that many spent input buffers alive)."""
        if isinstance(max_input_buffers, bool) or not isinstance(max_input_buffers, int):
            raise TypeError(f"max_input_buffers must be an int, got {type(max_input_buffers).__name__}")
        if max_input_buffers < 1:
            raise ValueError(f"max_input_buffers must be a positive int, got {max_input_buffers}")
        for unit in self._units(recurse):
            unit.settings.reduce_scatter_max_input_buffers = max_input_buffers

    def set_reduce_scatter_unused_params(self, reduce_scatter_unused_params: bool, *, recurse: bool = True) -> None:
        """True: a trainable parameter group that got no gradient on this rank in a backward still takes
        part in its reduce-scatter, with zeros, so ranks that use different parameters (an MoE's experts
        that received no token, a branch one rank skips) reduce alike and their peers' gradients are right
        ([Note: unused parameters in a reduction], runtime/hooks.py), as FSDP2's. False (the default): such
        a group is not reduced, as in FSDP2 (every rank must then use it alike)."""
        for unit in self._units(recurse):
            unit.settings.reduce_scatter_unused_params = bool(reduce_scatter_unused_params)

    def set_allocate_memory_from_process_group_for_comm(self, enable: bool) -> None:
        """FSDP2 then allocates this module's collective buffers with the process group's own allocator
        where its backend has one (NCCL's, for zero-copy transfers), and ordinary tensors where it has none
        (gloo): there it changes nothing, here neither. flatshard's buffers are always ordinary tensors, so
        on a backend with an allocator it raises NotBuiltError. After ``set_custom_all_gather`` or
        ``set_custom_reduce_scatter`` it raises FSDP2's AssertionError, either way."""
        settings = self._unit.settings
        for kind, comm in (
            ("all gather", settings.custom_all_gather),
            ("reduce scatter", settings.custom_reduce_scatter),
        ):
            if comm is not None:
                raise AssertionError(
                    "cannot call set_allocate_memory_from_process_group() "
                    f"when {kind} comm is custom: {comm.__class__.__name__}"
                )
        if not enable:
            return
        for group in self._unit.flat_groups:
            pg, device = group.groups.shard_group or group.groups.process_group, group.compute_device
            if pg._get_backend(device).supports_tensor_alloc(device):
                raise NotBuiltError(
                    "set_allocate_memory_from_process_group_for_comm(True) is not built in flatshard's fully_shard "
                    f"on a {pg._get_backend(device).name()} process group (flatshard's collective buffers are "
                    "ordinary tensors): leave it unset"
                )

    def set_custom_all_gather(self, comm: Any) -> None:
        """Issue this module's all-gather with ``comm``, an FSDP2 ``AllGather``: it allocates the gathered
        buffer and is called with ``output_tensor``, ``input_tensor``, ``group`` and ``async_op`` as FSDP2
        calls it (runtime/reduce.py: [Note: custom collectives]). This module only, as in FSDP2; a module
        with several parameter groups (parameters on meshes of their own) raises FSDP2's ValueError."""
        _set_custom(self._unit, "set_custom_all_gather", "custom_all_gather", comm)

    def set_custom_reduce_scatter(self, comm: Any) -> None:
        """Issue this module's reduce-scatter with ``comm``, an FSDP2 ``ReduceScatter``: it allocates the
        collective's input and output and is called with ``output_tensor``, ``input_tensor``, ``group``,
        ``op`` and ``async_op``, ``op`` being FSDP2's (an average over the shard group for fp32 and bf16;
        runtime/reduce.py: [Note: custom collectives]). HSDP's all-reduce across replicas is not the
        comm's, as in FSDP2. This module only; several parameter groups raise FSDP2's ValueError."""
        _set_custom(self._unit, "set_custom_reduce_scatter", "custom_reduce_scatter", comm)

    def set_separate_reduce_scatter_group(self, enable: bool = True, *, recurse: bool = True) -> None:
        """Reduce-scatter this module's gradients on a process group of its own over the shard group's ranks
        (``enable=False``: back on the shard group), as FSDP2 does: one new group per distinct set of shard
        ranks in a call, made with ``dist.new_group(ranks, use_local_synchronization=True)``, so every rank of
        that set calls this alike. A custom reduce-scatter (``set_custom_reduce_scatter``) is handed that
        group. On gloo, flatshard's exchanges already overlap on one group (tags), so it changes no figure
        there; with NCCL it gives the reduce-scatter its own communicator."""
        created: dict[tuple[int, ...], Any] = {}
        for unit in self._units(recurse):
            for group in unit.flat_groups:
                shard_group = group.groups.shard_group
                if not enable or shard_group is None:  # F = 1: no reduce-scatter to move
                    group.reduce_scatter_group = None
                    continue
                ranks = tuple(dist.get_process_group_ranks(shard_group))
                if ranks not in created:
                    existing = group.reduce_scatter_group
                    created[ranks] = existing or dist.new_group(
                        list(ranks), use_local_synchronization=True, group_desc="flatshard_reduce_scatter"
                    )
                group.reduce_scatter_group = created[ranks]

    # FSDP2's needs NCCL's symmetric memory; with torch's CPU build its setter raises RuntimeError ("does not
    # find allocation backend NCCL") and leaves the module as it was, as this NotBuiltError (a RuntimeError) does
    set_symm_mem_for_comm = _not_built(
        "set_symm_mem_for_comm", "leave the default (collective buffers are ordinary tensors)"
    )


def _set_custom(unit: Unit, method: str, setting: str, comm: Any) -> None:
    if len(unit.flat_groups) > 1:  # FSDP2's error, word for word where it can be
        raise ValueError(
            f"{method} is not supported with multiple param groups (from per-param mesh via shard_placement_fn, "
            "or, in flatshard, frozen parameters of another dtype). The custom comm would be ambiguous across "
            "groups with different meshes."
        )
    if unit.self_gathered is not None:
        raise NotBuiltError(
            f"{method} is not built for {unit.name!r}, whose parameters include tensor subclasses that gather "
            "themselves (FSDP2's all-gather extensions; gathered and reduced apart from the others). Leave the "
            "default collectives for this module"
        )
    setattr(unit.settings, setting, comm)


def _replicas(unit: Unit) -> int:
    """The size of the unit's replicate group: more than 1 under HSDP."""
    return unit.flat_groups[0].groups.replicate_size


def _host_unit(module: nn.Module, what: str) -> Unit:
    if not isinstance(module, FSDPModule):
        raise ValueError(f"{what} takes modules fully_shard was applied to; {type(module).__name__} is not one")
    return module._unit
