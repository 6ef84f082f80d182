"""``FullyShardedDataParallel``: front end 1, PyTorch FSDP1's constructor keywords and methods.

A translator: it checks FSDP1's keywords, turns them into the engine's ``BuildOptions``, lets the
engine build the units (runtime/build/units.py), and runs its unit's forward through the hooks
(runtime/hooks.py). Every method is FSDP1's name delegating to the engine (summon, clip, no_sync,
recorders) or to the state package (state dicts); the wrapper owns nothing but its module and unit.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any, Optional, Union, cast

import torch
from torch import nn

from flatshard import interop
from flatshard.api import BackwardPrefetch, CPUOffload, MixedPrecision, NotBuiltError, ShardingStrategy
from flatshard.runtime import build, grad_utils, hooks, recording, summon
from flatshard.runtime.instrument import CommRecorder, MemoryRecorder
from flatshard.runtime.schedule import RunContext, ScheduleConfig, run_context
from flatshard.runtime.tree import WRAPPED, UnitHost, clean_name, unit_hosts, units_under
from flatshard.runtime.unit import Unit
from flatshard.state import module as state_module
from flatshard.state import optim as state_optim
from flatshard.state import settings as state_settings


class FullyShardedDataParallel(UnitHost, nn.Module):
    """Shard a module's parameters, gradients and optimizer state across ranks.

    Same constructor as ``torch.distributed.fsdp.FullyShardedDataParallel``. Differences a user can
    see: ``named_parameters()`` always yields the original names (``use_orig_params`` True or False
    behave alike), each as a 1-D *shard view* with the full shape in ``p.orig_shape``; it runs on CPU
    (gloo) as well as on GPUs.
    """

    def __init__(
        self,
        module: nn.Module,
        process_group=None,
        sharding_strategy: Optional[ShardingStrategy] = None,
        cpu_offload: Optional[CPUOffload] = None,
        auto_wrap_policy=None,
        backward_prefetch: Optional[BackwardPrefetch] = BackwardPrefetch.BACKWARD_PRE,
        mixed_precision: Optional[MixedPrecision] = None,
        ignored_modules=None,
        param_init_fn=None,
        device_id=None,
        sync_module_states: bool = False,
        forward_prefetch: bool = False,
        limit_all_gathers: bool = True,
        use_orig_params: bool = False,  # noqa: ARG002 - True and False alike: shard views keep the original names
        ignored_states=None,
        device_mesh=None,
        *,
        sharding_factor: Union[int, str, None] = None,
        memory_budget: Optional[int] = None,
        link_figures: Any = None,
        shard_boundaries: str = "flat",
        ranks_per_node: Optional[int] = None,
        inter_node_in_flight: bool = True,
        compress_inter_node: Optional[str] = None,
        shard_optimizer_across_replicas: bool = False,
    ):
        """All keywords as in PyTorch FSDP, plus flatshard's own:

        ``sharding_factor``: the number of ranks F that share one copy of the model (any divisor of the
        world size; W / F replicas). F = W is FULL_SHARD, F = 1 is NO_SHARD; with FULL_SHARD or
        HYBRID_SHARD and 1 < F < W the units are fully sharded inside groups of F consecutive ranks
        and gradients all-reduced across them. ``"auto"`` asks the planner for the smallest F whose
        per-rank peak (AdamW, no activations) fits ``memory_budget`` bytes (default: the accelerator's
        free memory); the choice and why are logged on rank 0 and kept in ``model.sharding_decision``.
        With ``link_figures`` (a ``flatshard.planner.Links``: bandwidths and latencies within and between
        nodes; read only with ``"auto"``) it chooses among the F that fit the one whose step the planner
        predicts fastest for the ranks per node (``ranks_per_node``) and those links.

        ``shard_boundaries``: where a unit's flat is cut between ranks ([Note: shard boundaries]):
        ``"flat"`` (default) anywhere, each rank holding 1-D pieces; ``"rows"`` only between rows, each
        rank's piece of a matrix a block of rows (``p.dim()`` keeps its meaning); ``"params"`` never
        inside a parameter: each lives whole on one rank (``flatshard.owned_named_parameters(model)``),
        so whole-matrix optimizers (Muon, Adafactor) step it locally.

        ``ranks_per_node``: how many consecutive ranks share a node (default: torchrun's
        ``LOCAL_WORLD_SIZE``; else the job is one node). Collectives between nodes are told apart by it:
        ``inter_node_in_flight`` (default True) leaves them in flight while backward goes on, the
        all-reduce across replicas until the end of backward ([Note: reductions in flight]); and
        ``compress_inter_node="int8"`` sends what crosses (the replicate all-reduce; a shard group's
        all-gathers and reduce-scatters to ranks on other nodes) as block-wise int8 with fp32 scales,
        on gloo ([Note: inter-node compression]). It raises where it cannot apply (NCCL, one node).

        ``shard_optimizer_across_replicas=True`` (HYBRID_SHARD or _HYBRID_SHARD_ZERO2, 1 < F < W): parameters
        sharded and gathered inside each shard group (a node) as the hybrid strategy does, gradients and
        optimizer state split over all W ranks: the shard views, and the optimizer's state, are this rank's
        piece of its flat shard, T/W elements; the gradient is reduce-scattered across replicas instead of
        all-reduced, and the updated pieces are gathered back across them at the next forward ([Note:
        optimizer state across replicas]). With ``sharding_factor="auto"`` it picks among 1 < F < W."""
        super().__init__()
        # PyTorch FSDP's own enums and configs are taken as flatshard's (a script with one import unswapped)
        sharding_strategy, backward_prefetch, mixed_precision, cpu_offload = map(
            interop.translate, (sharding_strategy, backward_prefetch, mixed_precision, cpu_offload)
        )
        strategy = sharding_strategy if sharding_strategy is not None else ShardingStrategy.FULL_SHARD
        _check_types(strategy, backward_prefetch, mixed_precision, cpu_offload)
        options = build.BuildOptions(
            strategy=strategy,
            process_group=process_group,
            device_mesh=device_mesh,
            sharding_factor=sharding_factor,
            memory_budget=memory_budget,
            link_figures=link_figures,
            auto_wrap_policy=auto_wrap_policy,
            ignored_modules=ignored_modules,
            ignored_states=ignored_states,
            mixed_precision=mixed_precision,
            offload_params=cpu_offload is not None and cpu_offload.offload_params,
            param_init_fn=param_init_fn,
            device_id=device_id,
            sync_module_states=sync_module_states,
            shard_boundaries=shard_boundaries,
            ranks_per_node=ranks_per_node,
            compress_inter_node=compress_inter_node,
            shard_optimizer_across_replicas=shard_optimizer_across_replicas,
            schedule=ScheduleConfig(inter_node_in_flight=inter_node_in_flight),  # what auto by time predicts
        )
        if not isinstance(shard_optimizer_across_replicas, bool):
            raise TypeError(
                f"shard_optimizer_across_replicas must be True or False, got {shard_optimizer_across_replicas!r}"
            )
        if link_figures is not None and sharding_factor != "auto":
            raise ValueError('link_figures is read only with sharding_factor="auto" (it chooses F by time)')
        if not isinstance(inter_node_in_flight, bool):
            raise TypeError(f"inter_node_in_flight must be True or False, got {inter_node_in_flight!r}")
        built = build.build_units(module, options, self._host)
        self._host_of(module, built.root, self)
        self._ignored_params = built.ignored_params
        self.sharding_decision: Optional[tuple[int, str]] = built.sharding_decision
        config = build.schedule_config(
            built.root.flat_group.compute_device,
            backward_prefetch=backward_prefetch,
            forward_prefetch=forward_prefetch,
            limit_all_gathers=limit_all_gathers,
            inter_node_in_flight=inter_node_in_flight,
        )
        build.become_root(self, config, mixed_precision)

    # [Note: nested wrappers]
    # FSDP1's nested wrappers are FullyShardedDataParallel instances users enumerate (fsdp_modules),
    # but the keywords that made them belong to the root's call, and the engine builds every unit
    # of that call at once (placing a tied weight needs the whole tree). So a nested wrapper is the
    # host of a unit already built: ``_host`` makes one without running the FSDP1 constructor, and
    # ``_host_of`` is the one place any wrapper, root or nested, gets its module and unit.
    @classmethod
    def _host(cls, module: nn.Module, unit: Unit) -> FullyShardedDataParallel:
        host = cls.__new__(cls)
        nn.Module.__init__(host)
        cls._host_of(module, unit, host)
        host._ignored_params = set()
        host.sharding_decision = None
        return host

    @staticmethod
    def _host_of(module: nn.Module, unit: Unit, host: FullyShardedDataParallel) -> None:
        host._modules[WRAPPED] = module
        host._unit = unit
        host.register_load_state_dict_post_hook(state_module.after_load_from_parent)

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return hooks.forward(self._unit, self._fsdp_wrapped_module, args, kwargs)

    # ---- what users read ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        module = self._modules[WRAPPED]
        assert module is not None  # set once, by _host_of
        return module

    def named_parameters(self, *args, **kwargs) -> Iterator[tuple[str, nn.Parameter]]:
        for name, param in super().named_parameters(*args, **kwargs):
            yield clean_name(name), param

    def named_buffers(self, *args, **kwargs) -> Iterator[tuple[str, torch.Tensor]]:
        for name, buf in super().named_buffers(*args, **kwargs):
            yield clean_name(name), buf

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            modules = self.__dict__.get("_modules", {})
            if WRAPPED not in modules:
                raise
            return getattr(modules[WRAPPED], name)

    def __getitem__(self, key):
        return self.module.__getitem__(key)  # type: ignore[operator]  # the wrapped module's own (a Sequential's)

    # ---- state dicts: every method delegates to the state package ---------------------------------
    def state_dict(self, *args, **kwargs):
        return state_module.module_state_dict(self, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return state_module.load_module_state_dict(self, state_dict, strict=strict, assign=assign)

    def _load_from_state_dict(  # nn.Module's signature; the caller's walk applies strict
        self,
        state_dict,
        prefix,
        local_metadata,  # noqa: ARG002
        strict,  # noqa: ARG002
        missing_keys,
        unexpected_keys,
        error_msgs,  # noqa: ARG002
    ) -> None:
        state_module.load_from_parent(self, state_dict, prefix, missing_keys, unexpected_keys)

    # [Note: get_state_dict on the wrapper]
    # PyTorch's get_state_dict / get_model_state_dict / get_optimizer_state_dict / set_state_dict know
    # PyTorch's FSDP classes and DTensor parameters; to them this wrapper is a plain module, so they would
    # take each rank's 1-D optimizer-state pieces for whole tensors and write a checkpoint missing most of
    # them, without an error. Every one of those functions first walks the model asking each module for
    # ``_fqn_modifiers`` (their extension point for modules that rename state-dict keys): here that
    # question raises, on every rank (every rank calls the function), before anything is written.
    @property
    def _fqn_modifiers(self):
        raise NotBuiltError(
            "torch.distributed.checkpoint.state_dict (get_state_dict, get_model_state_dict, "
            "get_optimizer_state_dict, set_state_dict, ...) does not understand flatshard's "
            "FullyShardedDataParallel: its optimizer state would be saved as each rank's 1-D piece. Use "
            "flatshard.checkpoint.save/load; or, for torch.distributed.checkpoint, "
            "FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT) with "
            "model.state_dict() and FullyShardedDataParallel.optim_state_dict(model, optim); or flatshard's "
            "fully_shard, whose DTensor parameters get_state_dict supports."
        )

    @staticmethod
    def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        return state_settings.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        return state_settings.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def get_state_dict_type(module: nn.Module):
        """The ``StateDictSettings`` (type, config, optimizer config) in force for ``module``."""
        return state_settings.settings_of(module)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        return state_optim.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(
        model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None
    ):
        if is_named_optimizer:
            raise NotBuiltError(
                "optim_state_dict_to_load(is_named_optimizer=True) is not built in flatshard: pass a "
                "torch.optim optimizer built from model.parameters()"
            )
        return state_optim.optim_state_dict_to_load(model, optim, optim_state_dict, load_directly, group)

    @staticmethod  # a helper of the class body, deleted below
    def _deprecated_optim(name: str):
        def method(*args, **kwargs):  # noqa: ARG001 - any call raises
            raise NotBuiltError(
                f"FullyShardedDataParallel.{name} (deprecated in PyTorch FSDP) is not built in flatshard: save with "
                "FullyShardedDataParallel.optim_state_dict(model, optim) and load with optim_state_dict_to_load(model, "
                "optim, osd), under the state_dict_type you want (FULL_STATE_DICT for one full dict)."
            )

        method.__name__ = name
        return staticmethod(method)

    full_optim_state_dict = _deprecated_optim("full_optim_state_dict")
    sharded_optim_state_dict = _deprecated_optim("sharded_optim_state_dict")
    shard_full_optim_state_dict = _deprecated_optim("shard_full_optim_state_dict")
    scatter_full_optim_state_dict = _deprecated_optim("scatter_full_optim_state_dict")
    flatten_sharded_optim_state_dict = _deprecated_optim("flatten_sharded_optim_state_dict")
    rekey_optim_state_dict = _deprecated_optim("rekey_optim_state_dict")
    del _deprecated_optim

    # ---- attributes PyTorch FSDP exposes --------------------------------------------------------
    @property
    def sharding_strategy(self) -> ShardingStrategy:
        return self._unit.settings.strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._unit.settings.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._unit.flat_group.offload)

    @property
    def process_group(self):
        """Every rank that trains this model (the shard group and, hybrid, the replicas)."""
        return self._unit.flat_group.groups.process_group

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        return self._unit.flat_group.compute_device

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root (the outermost one, which runs the schedule)."""
        return self._unit.is_root

    def register_comm_hook(self, state: object, hook: Callable) -> None:  # noqa: ARG002 - not built
        raise NotBuiltError(
            "register_comm_hook is not built in flatshard. For reductions in lower precision pass "
            "MixedPrecision(reduce_dtype=torch.bfloat16); for no reduction at all during accumulation use no_sync()."
        )

    # ---- training utilities -------------------------------------------------------------------
    def clip_grad_norm_(
        self, max_norm: float, norm_type: float = 2.0, error_if_nonfinite: bool = False
    ) -> torch.Tensor:
        """Clip gradients by their global norm across all ranks, as ``torch.nn.utils.clip_grad_norm_``
        would on the unwrapped model. Returns the total norm (before clipping), the same on every rank,
        NaN if any rank's gradients hold a NaN. One all-reduce."""
        ctx = self._require_root("clip_grad_norm_")
        return grad_utils.clip_grad_norm_(ctx, list(self._ignored_params), max_norm, norm_type, error_if_nonfinite)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full size, unreduced) across backward passes; the first
        backward after leaving the context reduces the sum."""
        ctx = self._require_root("no_sync")
        with grad_utils.no_sync(ctx):
            yield

    @staticmethod
    def summon_full_params(
        module: nn.Module,
        recurse: bool = True,
        writeback: bool = True,
        rank0_only: bool = False,
        offload_to_cpu: bool = False,
        with_grads: bool = False,
    ):
        """Gather full parameters into every unit under ``module`` for reading or in-place editing."""
        units = units_under(module) if recurse else [cast(UnitHost, module)._unit]  # recurse=False: a wrapper
        return summon.summon(
            units, writeback=writeback, rank0_only=rank0_only, offload_to_cpu=offload_to_cpu, with_grads=with_grads
        )

    def apply(self, fn: Callable[[nn.Module], None]) -> FullyShardedDataParallel:
        """``fn`` on every submodule and then this one, as ``nn.Module.apply``, with the full parameters
        summoned (and written back), so ``fn`` sees original shapes, as in PyTorch FSDP. Wrappers nested
        inside do not summon again."""
        if self.applying:
            return super().apply(fn)
        hosts = unit_hosts(self)
        with FullyShardedDataParallel.summon_full_params(self, writeback=True):
            for h in hosts:
                h.applying = True
            try:
                super().apply(fn)
            finally:
                for h in hosts:
                    h.applying = False
        return self

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list[FullyShardedDataParallel]:
        return [h for h in unit_hosts(module, root_only) if isinstance(h, FullyShardedDataParallel)]

    # ---- instrumentation ----------------------------------------------------------------------
    @contextlib.contextmanager
    def record_comms(self, *, events: bool = False) -> Iterator[CommRecorder]:
        """Count every collective this model issues inside the block: totals by phase, kind and group
        (``count``, ``wire_bytes``, ``summary``). ``events=True`` also keeps every collective, in order,
        in ``.events`` (one record each, for as long as the block runs: [Note: bounded recorders])."""
        with recording.record_comms(self._require_root("record_comms"), events=events) as recorder:
            yield recorder

    @contextlib.contextmanager
    def record_memory(
        self, optimizer: Optional[torch.optim.Optimizer] = None, *, timeline: bool = False
    ) -> Iterator[MemoryRecorder]:
        """Follow the bytes flatshard manages on this rank (and the optimizer's state) and their peak.
        ``timeline=True`` also keeps every sample in ``.timeline`` ([Note: bounded recorders])."""
        ctx = self._require_root("record_memory")
        with recording.record_memory(ctx, optimizer, list(self._ignored_params), timeline=timeline) as recorder:
            yield recorder

    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Bytes held on this rank now, by category: params, grads, optimizer, gathered."""
        return recording.memory_bytes(self._require_root("memory_bytes"), optimizer, list(self._ignored_params))

    def _require_root(self, what: str) -> RunContext:
        if not self._unit.is_root:
            raise RuntimeError(f"call {what} on the root FullyShardedDataParallel (the outermost wrapper)")
        ctx = run_context(self._unit)
        ctx.start()
        return ctx

    def extra_repr(self) -> str:
        u = self._unit
        layout = u.flat_group.layout
        return f"unit={u.name!r}, numel={layout.total}, shard={layout.shard_numel}, strategy={u.settings.strategy.name}"


def _check_types(strategy, backward_prefetch, mixed_precision, cpu_offload) -> None:
    if not isinstance(strategy, ShardingStrategy):
        raise TypeError(f"sharding_strategy must be a flatshard.ShardingStrategy, got {strategy!r}")
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a flatshard.BackwardPrefetch or None, got {backward_prefetch!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a flatshard.MixedPrecision, got {mixed_precision!r}")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a flatshard.CPUOffload or None, got {cpu_offload!r}")
