"""``FullyShardedDataParallel``: the wrapper users construct, with PyTorch FSDP's keywords and methods.

Thin by design: it validates keywords, picks units (wrap.py), places parameters (placement.py),
builds one ``Unit`` per wrapped module (unit.py) and runs each unit's forward between its pre- and
post-forward transitions. Everything that spans units lives in the root's ``RunContext``.
"""
from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Union

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from flatshard import deferred, full_params, grad, precision
from flatshard import state_dict as state_dict_impl
from flatshard.api import BackwardPrefetch, CPUOffload, MixedPrecision, NotBuiltError, ShardingStrategy
from flatshard.flat_param import FlatLayout
from flatshard.instrument import CommRecorder, MemoryRecorder
from flatshard.auto import auto_sharding_factor
from flatshard.mesh import ShardGroups, require_initialized, resolve_groups
from flatshard.placement import Placement, check_no_tie_into_wrapped
from flatshard.schedule import RunContext
from flatshard.unit import Unit
from flatshard.wrap import select_units

WRAPPED = "_fsdp_wrapped_module"
_PREFIX = WRAPPED + "."


_CHECKPOINT_PREFIX = "_checkpoint_wrapped_module."  # torch's checkpoint_wrapper, stripped as PyTorch FSDP does


def clean_name(name: str) -> str:
    """A parameter or buffer name as in the unwrapped model."""
    return name.replace(_PREFIX, "").replace(_CHECKPOINT_PREFIX, "")


@dataclass(frozen=True)
class _WrapConfig:
    """What every unit built by one constructor call shares."""

    groups: ShardGroups
    strategy: ShardingStrategy
    sync_module_states: bool
    mixed_precision: Optional[MixedPrecision] = None
    backward_prefetch: Optional[BackwardPrefetch] = None
    forward_prefetch: bool = False
    limit_all_gathers: bool = True
    offload_params: bool = False


class FullyShardedDataParallel(nn.Module):
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
        use_orig_params: bool = False,
        ignored_states=None,
        device_mesh=None,
        *,
        sharding_factor: Union[int, str, None] = None,
        memory_budget: Optional[int] = None,
        _offload_on_cpu_for_tests: bool = False,
    ):
        """All keywords as in PyTorch FSDP, plus flatshard's own:

        ``sharding_factor``: the number of ranks F that share one copy of the model (any divisor of the
        world size; W / F replicas). F = W is FULL_SHARD, F = 1 is NO_SHARD; with FULL_SHARD or
        HYBRID_SHARD and 1 < F < W the units are fully sharded inside groups of F consecutive ranks
        and gradients all-reduced across them. ``"auto"`` asks the planner for the smallest F whose
        per-rank peak (AdamW, no activations) fits ``memory_budget`` bytes (default: the accelerator's
        free memory); the choice and why are logged on rank 0 and kept in ``model.sharding_decision``."""
        super().__init__()
        _reject_not_built(backward_prefetch, forward_prefetch, mixed_precision, cpu_offload, param_init_fn)
        deferred.check_init_fn(param_init_fn)
        if isinstance(module, FullyShardedDataParallel):
            raise ValueError("this module is already wrapped in FullyShardedDataParallel; wrap it once")
        strategy = sharding_strategy if sharding_strategy is not None else ShardingStrategy.FULL_SHARD
        if not isinstance(strategy, ShardingStrategy):
            raise TypeError(f"sharding_strategy must be a flatshard.ShardingStrategy, got {strategy!r}")
        ignored, ignored_params = _ignored(module, ignored_modules, ignored_states)
        ignored_params |= {p for m in ignored for p in m.parameters()}
        offload = cpu_offload is not None and cpu_offload.offload_params
        if offload:
            device_id = _offload_compute_device(module, device_id, _offload_on_cpu_for_tests)
        _place_on_device(module, device_id, ignored_params)
        wrapped_earlier = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        skip = set(ignored) | set(wrapped_earlier)
        chosen = select_units(module, auto_wrap_policy, skip, ignored_params)
        placement = Placement(module, chosen, skip, ignored_params)
        check_no_tie_into_wrapped(placement, wrapped_earlier)
        by_unit = placement.infos_by_unit()
        self.sharding_decision: Optional[tuple[int, str]] = None
        if sharding_factor == "auto":
            sharding_factor = self._auto_factor(strategy, module, chosen, by_unit, process_group, device_mesh, memory_budget)
        elif memory_budget is not None:
            raise ValueError('memory_budget is read only with sharding_factor="auto"')
        groups = resolve_groups(strategy, process_group, device_mesh, sharding_factor)
        config = _WrapConfig(groups, strategy, sync_module_states, mixed_precision, backward_prefetch,
                             forward_prefetch, limit_all_gathers, offload)
        self._build_units(module, chosen, by_unit, placement.path, skip, param_init_fn, device_id, config)
        self._ignored_params = ignored_params
        if sync_module_states:
            _broadcast_buffers(module, groups, ignored)

    # ---- construction -----------------------------------------------------------------------
    def _build_units(self, module, chosen, by_unit, paths, skip, param_init_fn, device_id, config) -> None:
        """One unit per chosen module (each replaced in its parents by its wrapper), and ``self``'s own."""
        parents = _parents(module)
        if deferred.has_meta_states(module, skip):  # [Note: deferred initialisation] (deferred.py)
            units = deferred.units_in_init_order(module, [*chosen, module], by_unit, skip, param_init_fn,
                                                 deferred.materialization_device(device_id))
        else:  # children first (any order would do: parents are looked up before any unit is built)
            units = ((m, by_unit.get(m, [])) for m in [*chosen, module])
        for unit_module, params in units:
            if unit_module is module:
                self._setup(module, params, config, "")
            else:
                wrapper = FullyShardedDataParallel._new_unit_wrapper(unit_module, params, config, paths[unit_module])
                for parent, attr in parents.get(unit_module, []):
                    parent._modules[attr] = wrapper
            del params  # the unit keeps its shard; the full-size parameters go before the next unit is initialised

    def _auto_factor(self, strategy, module, chosen, by_unit, process_group, device_mesh, budget) -> int:
        if device_mesh is not None or isinstance(process_group, tuple):
            raise ValueError('sharding_factor="auto" picks the groups itself; do not pass device_mesh or a group pair')
        require_initialized()
        group = process_group if process_group is not None else torch.distributed.group.WORLD
        sizes = [sum(i.numel for i, _ in by_unit.get(m, [])) for m in chosen]
        infos = [i for m in [*chosen, module] for i, _ in by_unit.get(m, [])]
        device = next((p.device for _, p in by_unit.get(module, [])), torch.device("cpu"))
        factor, why = auto_sharding_factor(
            strategy, sizes, sum(i.numel for i, _ in by_unit.get(module, [])), len(infos),
            torch.distributed.get_world_size(group), budget, device,
        )
        self.sharding_decision = (factor, why)
        return factor

    @classmethod
    def _new_unit_wrapper(cls, module, params, config, name) -> "FullyShardedDataParallel":
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self._setup(module, params, config, name)
        self._ignored_params = set()
        return self

    def _setup(self, module: nn.Module, params: list, config: _WrapConfig, name: str) -> None:
        self._modules[WRAPPED] = module
        self._ctx: Optional[RunContext] = None
        self._is_root: Optional[bool] = None
        self.register_load_state_dict_post_hook(_after_load_through_parent)
        self._strategy = config.strategy
        self._config = config
        infos = [info for info, _ in params]
        originals = [p for _, p in params]
        dtypes = {p.dtype for p in originals}
        if len(dtypes) > 1:
            raise TypeError(
                f"unit {name or '<root>'!r} holds parameters of several dtypes {sorted(map(str, dtypes))}; one flat "
                "parameter needs one dtype. Cast the model to one dtype first (model.float()), or wrap the "
                "modules of each dtype as separate units."
            )
        dtype = dtypes.pop() if dtypes else torch.float32
        device = originals[0].device if originals else torch.device("cpu")
        layout = FlatLayout(infos, config.groups.shard_size)
        flat = layout.flatten(originals, dtype=dtype, device=device)
        if config.sync_module_states and config.groups.process_group is not None:
            _broadcast(flat, config.groups)
        self._flattened_originals = {id(p): weakref.ref(p) for p in originals}
        full_shard = config.strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)
        self._unit = Unit(name, layout, flat, config.groups, full_shard=full_shard,
                          precision=precision.resolve(config.mixed_precision, dtype), offload=config.offload_params)

    def _lazy_init(self) -> RunContext:
        """On first use, the outermost wrapper becomes the root and hands one run context to every unit."""
        if self._ctx is not None:
            return self._ctx
        wrappers = [m for m in self.modules() if isinstance(m, FullyShardedDataParallel)]
        groups = {id(w._unit.groups.process_group) for w in wrappers}
        if len(groups) > 1:
            raise NotBuiltError(
                "units under one root use different process groups; flatshard needs one process group per "
                "root for now. Pass the same process_group to every FullyShardedDataParallel."
            )
        ctx = RunContext([w._unit for w in wrappers], self._unit)
        ctx.configure(self._config.backward_prefetch, self._config.forward_prefetch, self._config.limit_all_gathers,
                      self._unit.compute_device)
        if self._config.mixed_precision is not None:
            precision.cast_buffers(self.module, self._config.mixed_precision.buffer_dtype)
        for w in wrappers:
            w._ctx, w._is_root = ctx, w is self
            w._unit.ctx, w._unit.is_root = ctx, w is self
        for path, m in self.named_modules():  # units wrapped by hand learn their place under the root
            if isinstance(m, FullyShardedDataParallel):
                m._unit.name = clean_name(path).removesuffix("._fsdp_wrapped_module") or "<root>"
        return ctx

    # ---- forward ------------------------------------------------------------------------------
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        ctx = self._lazy_init()
        unit = self._unit
        p = unit.precision
        if p.mixed and (p.cast_forward_inputs or (self._is_root and p.cast_root_forward_inputs)):
            args, kwargs = precision.cast_floating((args, kwargs), p.compute)
        if self._is_root:
            ctx.begin_forward()
        try:
            unit.pre_forward()
            try:
                output = self._fsdp_wrapped_module(*args, **kwargs)
            finally:
                unit.post_forward()
        finally:
            if self._is_root:
                ctx.end_forward()
        if torch.is_grad_enabled():
            _register_pre_backward(output, unit)
        return output

    # ---- what users read ----------------------------------------------------------------------
    @property
    def module(self) -> nn.Module:
        return self._modules[WRAPPED]

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
        return self._modules[WRAPPED].__getitem__(key)

    # ---- state dicts: every method delegates to state_dict.py -----------------------------------
    def state_dict(self, *args, **kwargs):
        return state_dict_impl.module_state_dict(self, super().state_dict, *args, **kwargs)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return state_dict_impl.load_module_state_dict(self, super().load_state_dict, state_dict, strict=strict, assign=assign)

    # [Note: loading through a plain parent]
    # A model whose top is not wrapped (``model.backbone = FSDP(model.backbone)``) is loaded by
    # nn.Module.load_state_dict, which walks the modules and calls each one's ``_load_from_state_dict``
    # with the keys under its prefix. The outermost wrapper on that walk loads its whole subtree here
    # with flatshard's loader (a collective: every rank takes part, errors are raised on all ranks),
    # and reports missing and unexpected keys to the walk, which applies the caller's ``strict``. The
    # walk then goes on into the wrapped modules, which hold shard views and would call their own
    # names missing: the wrapper's post-hook drops those names, and wrappers nested inside skip.
    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        if self.__dict__.get("_loaded_by_outer", False):
            return
        ours = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)}
        result = state_dict_impl.load_module_state_dict(self, None, ours, strict=False)
        missing_keys.extend(prefix + k for k in result.missing_keys)
        unexpected_keys.extend(prefix + k for k in result.unexpected_keys)
        for k in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[k]  # consumed: nothing below this wrapper reads them
        self.__dict__["_load_prefix"] = prefix
        for w in FullyShardedDataParallel.fsdp_modules(self)[1:]:
            w.__dict__["_loaded_by_outer"] = True

    @staticmethod
    def state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        return state_dict_impl.state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def set_state_dict_type(module, state_dict_type, state_dict_config=None, optim_state_dict_config=None):
        return state_dict_impl.set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)

    @staticmethod
    def optim_state_dict(model, optim, optim_state_dict=None, group=None):
        return state_dict_impl.optim_state_dict(model, optim, optim_state_dict, group)

    @staticmethod
    def optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer=False, load_directly=False, group=None):
        return state_dict_impl.optim_state_dict_to_load(model, optim, optim_state_dict, is_named_optimizer, load_directly, group)

    @staticmethod
    def get_state_dict_type(module: nn.Module):
        """The ``StateDictSettings`` (type, config, optimizer config) in force for ``module``."""
        return state_dict_impl.settings_of(module)

    def _deprecated_optim(name: str):
        def method(*args, **kwargs):
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
        return self._strategy

    @property
    def mixed_precision(self) -> MixedPrecision:
        return self._config.mixed_precision or MixedPrecision()

    @property
    def cpu_offload(self) -> CPUOffload:
        return CPUOffload(offload_params=self._config.offload_params)

    @property
    def process_group(self):
        """Every rank that trains this model (the shard group and, hybrid, the replicas)."""
        return self._unit.groups.process_group

    @property
    def rank(self) -> int:
        return torch.distributed.get_rank(self.process_group)

    @property
    def world_size(self) -> int:
        return torch.distributed.get_world_size(self.process_group)

    @property
    def compute_device(self) -> torch.device:
        return self._unit.compute_device

    def check_is_root(self) -> bool:
        """Whether this wrapper is the root (the outermost one, which runs the schedule)."""
        self._lazy_init() if self._is_root is None else None
        return bool(self._is_root)

    def register_comm_hook(self, state: object, hook: Callable) -> None:
        raise NotBuiltError(
            "register_comm_hook is not built in flatshard. For reductions in lower precision pass "
            "MixedPrecision(reduce_dtype=torch.bfloat16); for no reduction at all during accumulation use no_sync()."
        )

    # ---- training utilities -------------------------------------------------------------------
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip gradients by their global norm across all ranks, as ``torch.nn.utils.clip_grad_norm_``
        would on the unwrapped model. Returns the total norm (before clipping). One all-reduce."""
        ctx = self._require_root("clip_grad_norm_")
        return grad.clip_grad_norm_(ctx, list(self._ignored_params), max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally (full size, unreduced) across backward passes; the first
        backward after leaving the context reduces the sum."""
        ctx = self._require_root("no_sync")
        with grad.no_sync(ctx):
            yield

    @staticmethod
    def summon_full_params(module: nn.Module, recurse: bool = True, writeback: bool = True,
                           rank0_only: bool = False, offload_to_cpu: bool = False, with_grads: bool = False):
        """Gather full parameters into every unit under ``module`` for reading or in-place editing."""
        wrappers = FullyShardedDataParallel.fsdp_modules(module) if recurse else [module]
        for w in wrappers:
            w._lazy_init() if w._ctx is None else None
        return full_params.summon(wrappers, writeback=writeback, rank0_only=rank0_only,
                                  offload_to_cpu=offload_to_cpu, with_grads=with_grads)

    def apply(self, fn: Callable[[nn.Module], None]) -> "FullyShardedDataParallel":
        """``fn`` on every submodule and then this one, as ``nn.Module.apply``, with the full parameters
        summoned (and written back), so ``fn`` sees original shapes, as in PyTorch FSDP. Wrappers nested
        inside do not summon again."""
        if getattr(self, "_applying", False):
            return super().apply(fn)
        wrappers = FullyShardedDataParallel.fsdp_modules(self)
        with FullyShardedDataParallel.summon_full_params(self, writeback=True):
            for w in wrappers:
                w._applying = True
            try:
                super().apply(fn)
            finally:
                for w in wrappers:
                    w._applying = False
        return self

    @staticmethod
    def fsdp_modules(module: nn.Module, root_only: bool = False) -> list["FullyShardedDataParallel"]:
        wrappers = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
        if root_only:
            inner = {id(m) for w in wrappers for m in w.modules() if m is not w}
            wrappers = [w for w in wrappers if id(w) not in inner]
        return wrappers

    # ---- instrumentation ----------------------------------------------------------------------
    @contextlib.contextmanager
    def record_comms(self) -> Iterator[CommRecorder]:
        """Count every collective this model issues inside the block (kind, group, phase, bytes)."""
        ctx = self._require_root("record_comms")
        recorder = CommRecorder()
        ctx.comm_recorders.append(recorder)
        try:
            yield recorder
        finally:
            ctx.comm_recorders.remove(recorder)

    @contextlib.contextmanager
    def record_memory(self, optimizer: Optional[torch.optim.Optimizer] = None) -> Iterator[MemoryRecorder]:
        """Follow the bytes flatshard manages on this rank (and the optimizer's state) and their peak."""
        ctx = self._require_root("record_memory")
        recorder = MemoryRecorder(ctx.units, optimizer, extra_params=list(self._ignored_params))
        recorder.sample()
        ctx.memory_recorders.append(recorder)
        try:
            yield recorder
        finally:
            ctx.memory_recorders.remove(recorder)

    def memory_bytes(self, optimizer: Optional[torch.optim.Optimizer] = None) -> dict[str, int]:
        """Bytes held on this rank now, by category: params, grads, optimizer, gathered."""
        ctx = self._require_root("memory_bytes")
        return MemoryRecorder(ctx.units, optimizer, extra_params=list(self._ignored_params)).current()

    def _require_root(self, what: str) -> RunContext:
        ctx = self._lazy_init()
        if not self._is_root:
            raise RuntimeError(f"call {what} on the root FullyShardedDataParallel (the outermost wrapper)")
        return ctx

    def extra_repr(self) -> str:
        u = self._unit
        return f"unit={u.name!r}, numel={u.layout.total}, shard={u.layout.shard_numel}, strategy={self._strategy.name}"


# ---- helpers ---------------------------------------------------------------------------------
def _reject_not_built(backward_prefetch, forward_prefetch, mixed_precision, cpu_offload, param_init_fn) -> None:
    if backward_prefetch is not None and not isinstance(backward_prefetch, BackwardPrefetch):
        raise TypeError(f"backward_prefetch must be a flatshard.BackwardPrefetch or None, got {backward_prefetch!r}")
    if mixed_precision is not None and not isinstance(mixed_precision, MixedPrecision):
        raise TypeError(f"mixed_precision must be a flatshard.MixedPrecision, got {mixed_precision!r}")
    if cpu_offload is not None and not isinstance(cpu_offload, CPUOffload):
        raise TypeError(f"cpu_offload must be a flatshard.CPUOffload or None, got {cpu_offload!r}")


def _offload_compute_device(module: nn.Module, device_id, allow_cpu: bool):
    """CPUOffload(offload_params=True): the device units compute on (``device_id``; else the device of
    the module's parameters; else the current CUDA device), which must be an accelerator. Tests on
    machines without one pass ``_offload_on_cpu_for_tests=True`` (``allow_cpu``): the offload path then
    runs with CPU as the compute device, the flat shards separate CPU tensors copied before every
    gather, as on an accelerator (but not pinned)."""
    if device_id is None:
        device = next((p.device for p in module.parameters() if not p.is_meta), torch.device("cpu"))
        if device.type == "cpu" and torch.cuda.is_available():
            device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    if device.type == "cpu" and not allow_cpu:
        raise ValueError(
            "CPUOffload(offload_params=True): offload needs an accelerator compute device, and this run has "
            "none: the parameters already live in CPU memory. Pass cpu_offload=None (or CPUOffload(False))."
        )
    return device


def _ignored(module: nn.Module, ignored_modules, ignored_states) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The modules (with their submodules) and the parameters flatshard leaves alone: not flattened, not
    sharded, and their gradients not reduced (as in PyTorch FSDP)."""
    states = list(ignored_states or [])
    if ignored_modules is not None and states:
        raise ValueError("pass ignored_modules or ignored_states, not both")
    if states and not (all(isinstance(s, nn.Parameter) for s in states) or all(isinstance(s, nn.Module) for s in states)):
        raise ValueError("ignored_states must hold only nn.Parameter objects or only nn.Module objects, not a mix")
    given = list(ignored_modules or []) + [s for s in states if isinstance(s, nn.Module)]
    params = {s for s in states if isinstance(s, nn.Parameter)}
    ignored: set[nn.Module] = set()
    for m in given:
        if isinstance(m, FullyShardedDataParallel):
            raise ValueError("ignored_modules must not contain FullyShardedDataParallel instances")
        ignored.update(m.modules())
    if module in ignored:
        raise ValueError("the module being wrapped cannot itself be ignored")
    owned = {id(p) for p in module.parameters()}
    if any(id(p) not in owned for p in params):
        raise ValueError("ignored_states holds a parameter that is not in the module being wrapped")
    return ignored, params


def _place_on_device(module: nn.Module, device_id, ignored_params: set) -> None:
    """Move real parameters and buffers to ``device_id``; meta ones are materialised there later (deferred.py)."""
    if device_id is None:
        return
    device = torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)
    for sub in module.modules():
        for attr, p in sub._parameters.items():
            if p is not None and p not in ignored_params and not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for attr, b in sub._buffers.items():
            if b is not None and not b.is_meta and b.device != device:
                sub._buffers[attr] = b.to(device)


def _after_load_through_parent(module: "FullyShardedDataParallel", incompatible) -> None:
    """[Note: loading through a plain parent]: the names the wrapped modules reported missing are loaded."""
    prefix = module.__dict__.pop("_load_prefix", None)
    if prefix is None:
        return
    inner = prefix + WRAPPED + "."
    incompatible.missing_keys[:] = [k for k in incompatible.missing_keys if not k.startswith(inner)]
    for w in FullyShardedDataParallel.fsdp_modules(module)[1:]:
        w.__dict__.pop("_loaded_by_outer", None)


def _parents(root: nn.Module) -> dict[nn.Module, list[tuple[nn.Module, str]]]:
    out: dict[nn.Module, list[tuple[nn.Module, str]]] = {}
    for parent in root.modules():
        for attr, child in parent._modules.items():
            if child is not None:
                out.setdefault(child, []).append((parent, attr))
    return out


def _broadcast(tensor: torch.Tensor, groups: ShardGroups) -> None:
    from flatshard import collectives

    if torch.distributed.get_world_size(groups.process_group) > 1:
        collectives.broadcast(tensor, 0, groups.process_group)


def _broadcast_buffers(module: nn.Module, groups: ShardGroups, ignored: set[nn.Module]) -> None:
    for sub in module.modules():
        if sub in ignored:
            continue
        for buf in sub._buffers.values():
            if buf is not None:
                _broadcast(buf, groups)


def _register_pre_backward(output: Any, unit: Unit) -> None:
    """Hook every output tensor that needs a gradient: the first gradient to arrive gathers the unit."""
    tensors, _ = tree_flatten(output)

    def hook(grad_output: torch.Tensor) -> None:
        unit.pre_backward()

    for t in tensors:
        if torch.is_tensor(t) and t.requires_grad:
            t.register_hook(hook)
