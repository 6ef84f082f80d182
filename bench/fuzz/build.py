"""Building one configuration of the fuzzer (bench/fuzz/) inside a rank: the wrapped model (the FSDP1
wrapper or ``fully_shard``), PyTorch's FSDP2 beside a ``fully_shard`` one, and the optimizers.

Meshes are made once per process and shape: ``init_device_mesh`` makes gloo groups (collective, every rank
in the same order), and a pool's ranks run hundreds of configurations, each idle group slowing every
collective a little. ``sharding_factor=F`` and the FSDP1 wrapper's own groups are made per configuration,
as a user's script would; the pool is replaced once a rank holds too many (pool.py).
"""

from __future__ import annotations

import functools
import os

import torch
import torch.distributed as dist
from torch import nn

from bench.fuzz import gathers
from bench.fuzz.models import BLOCKS, Root, make_model, unit_modules

_MESHES: dict[tuple, object] = {}


def mesh(shape: tuple):
    """A 1-D (shard) or 2-D (replicate, shard) mesh over every rank, one per shape in this process."""
    from torch.distributed.device_mesh import init_device_mesh

    if shape not in _MESHES:
        names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
        _MESHES[shape] = init_device_mesh("cpu", shape, mesh_dim_names=names)
    return _MESHES[shape]


def tp_meshes(cfg: dict, world: int):
    """(data-parallel mesh, TP mesh) of a tensor-parallel configuration: (dp, tp), or for HSDP
    (replicate, shard, tp) with F shard ranks; one mesh per shape in this process."""
    from torch.distributed.device_mesh import init_device_mesh

    tp, dp = cfg["tp"], world // cfg["tp"]
    shape = ("tp", dp, tp) if cfg["mesh"] != "2d" else ("tp", dp // cfg["F"], cfg["F"], tp)
    if shape not in _MESHES:
        names = ("dp", "tp") if len(shape) == 3 else ("replicate", "shard", "tp")
        _MESHES[shape] = init_device_mesh("cpu", shape[1:], mesh_dim_names=names)
    mesh = _MESHES[shape]
    return (mesh["dp"] if len(shape) == 3 else mesh["replicate", "shard"]), mesh["tp"]


def _parallelize(model: nn.Module, tp_mesh) -> None:
    """Every MLP block's fc1 column-wise (its DTensor output kept: the hidden width need not divide by the TP
    size) and fc2 row-wise, PyTorch's tensor-parallel styles."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    from bench.fuzz.models import MLPBlock

    for block in [m for m in model.modules() if isinstance(m, MLPBlock)]:
        parallelize_module(block, tp_mesh, {"fc1": ColwiseParallel(use_local_output=False), "fc2": RowwiseParallel()})


def _mixed(cfg: dict, kind: str):
    mp = cfg.get("mp")
    if not mp:
        return None
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    if kind == "fsdp1":
        from flatshard import MixedPrecision

        return MixedPrecision(param_dtype=dtypes[mp["param"]], reduce_dtype=dtypes[mp["reduce"]])
    if kind == "flatshard":
        from flatshard import MixedPrecisionPolicy
    else:
        from torch.distributed.fsdp import MixedPrecisionPolicy
    return MixedPrecisionPolicy(param_dtype=dtypes[mp["param"]], reduce_dtype=dtypes[mp["reduce"]])


def fsdp1_keywords(cfg: dict, world: int) -> dict:
    """FullyShardedDataParallel's keywords for ``cfg`` (one phase's strategy, F and groups)."""
    from flatshard import BackwardPrefetch, ShardingStrategy

    kw = {
        "sharding_strategy": ShardingStrategy[cfg["strategy"]],
        "backward_prefetch": None if cfg["backward_prefetch"] is None else BackwardPrefetch[cfg["backward_prefetch"]],
        "forward_prefetch": cfg["forward_prefetch"],
        "limit_all_gathers": cfg["limit_all_gathers"],
        "mixed_precision": _mixed(cfg, "fsdp1"),
    }
    groups, F = cfg["groups"], cfg["F"]
    if groups == "sharding_factor":
        kw["sharding_factor"] = F
    elif groups == "device_mesh":
        kw["device_mesh"] = mesh((world // F, F))
    elif groups == "local_world_size":  # torchrun's node size: the hybrid strategies' default F
        os.environ["LOCAL_WORLD_SIZE"] = str(F)
    if cfg.get("opt_across"):
        kw["shard_optimizer_across_replicas"] = True
    return kw


def _activation_checkpointing(model: nn.Module) -> None:
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

    apply_activation_checkpointing(model, check_fn=lambda m: type(m) in BLOCKS.values())


def wrap_fsdp1(model: Root, cfg: dict, world: int) -> nn.Module:
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy

    spec, act = cfg["model"], cfg.get("act_ckpt")
    wrap = functools.partial(FSDP, **fsdp1_keywords(cfg, world))
    model.checkpointed = act == "inside"
    chosen = unit_modules(model, spec, cfg.get("units", []))  # the blocks themselves, before any wrapper
    if act == "apply_before":
        _activation_checkpointing(model)
    if cfg["wrap"] == "classes":
        wrapped = wrap(model, auto_wrap_policy=ModuleWrapPolicy({BLOCKS[k] for k in cfg["wrap_classes"]}))
    elif cfg["wrap"] == "lambda":
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=set(chosen).__contains__)
        wrapped = wrap(model, auto_wrap_policy=policy)
    else:  # manual nesting: innermost first, then the root
        for module in chosen:
            _replace(model, module, wrap(module))
        wrapped = wrap(model)
    if act == "apply_after":
        _activation_checkpointing(wrapped)
    return wrapped


def _replace(root: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in root.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
                return
    raise LookupError(f"{type(old).__name__} is not under the root")


def wrap_fully_shard(model: Root, cfg: dict, world: int, torch_fsdp2: bool) -> nn.Module:
    """``fully_shard`` per chosen block (innermost first) and on the root; flatshard's or PyTorch's."""
    if torch_fsdp2:
        from torch.distributed.fsdp import fully_shard
    else:
        from flatshard import fully_shard
    spec, act = cfg["model"], cfg.get("act_ckpt")
    model.checkpointed = act == "inside"
    # the blocks themselves (a container's mlp first), before any wrapper, each with its block's setting
    units = [
        (m, after)
        for i, after in zip(cfg["units"], cfg["reshard_after_forward"])
        for m in unit_modules(model, spec, [i])
    ]
    if cfg.get("tp"):  # [Note: FSDP over tensor-parallel parameters]: TP first, then fully_shard on dp
        _parallelize(model, tp_meshes(cfg, world)[1])
    if act == "apply_before":
        _activation_checkpointing(model)
    kw = {"mp_policy": _mixed(cfg, "torch" if torch_fsdp2 else "flatshard")} if cfg.get("mp") else {}
    if cfg.get("tp"):
        kw["mesh"] = tp_meshes(cfg, world)[0]
    elif cfg["mesh"] != "default":
        kw["mesh"] = mesh((world,) if cfg["mesh"] == "1d" else (world // cfg["F"], cfg["F"]))
    if cfg.get("placement", "dim0") != "dim0":
        kw["shard_placement_fn"] = functools.partial(_placement, cfg["placement"])
    if cfg.get("opt_across") and not torch_fsdp2:  # PyTorch's FSDP2 beside it: plain HSDP, the same math
        kw["shard_optimizer_across_replicas"] = True
    if cfg.get("whole") and not torch_fsdp2:  # PyTorch's FSDP2 beside it: dim-0 chunks, the same math
        kw["shard_boundaries"] = "params"
    for module, after in units:
        target = module
        if act == "apply_before":  # the checkpoint wrapper is the block's parent now: shard the wrapper
            target = _wrapper_of(model, module) or module
        fully_shard(target, reshard_after_forward=after, **kw)
    fully_shard(model, **kw)
    if cfg.get("explicit_prefetch"):
        hosts = [m for m in model.modules() if hasattr(m, "set_modules_to_forward_prefetch") and m is not model]
        for a, b in zip(hosts, hosts[1:]):
            a.set_modules_to_forward_prefetch([b])
            b.set_modules_to_backward_prefetch([a])
    return model


def _placement(kind: str, param: nn.Parameter):
    """shard_placement_fn: the last dim, or the largest (the first of equals), of every parameter."""
    from torch.distributed.tensor import Shard

    if kind == "last":
        return Shard(param.ndim - 1)
    return Shard(max(range(param.ndim), key=lambda d: (param.shape[d], -d)))


def _wrapper_of(root: nn.Module, module: nn.Module):
    for m in root.modules():
        if getattr(m, "_checkpoint_wrapped_module", None) is module:
            return m
    return None


def build_models(cfg: dict, world: int, phase: str = "A"):
    """(reference, ours, PyTorch FSDP2's or None, {role: {name: original module}}) from one seed. The
    reference gets the same activation checkpointing (the same arithmetic; and a forward that counts its
    calls in a buffer counts the recomputation too). Phase "B" is the run after a checkpoint was loaded:
    its strategy is ``cfg["ckpt"]``'s."""
    spec, seed, act = cfg["model"], cfg["init_seed"], cfg.get("act_ckpt")
    ref = make_model(spec, seed)
    ours = make_model(spec, seed)
    for model in (ref, ours):
        gathers.convert(model, cfg.get("gathers_itself", []))
    modules = {"ref": dict(ref.named_modules()), "ours": dict(ours.named_modules())}
    ref.checkpointed = act == "inside"
    if act in ("apply_before", "apply_after"):
        _activation_checkpointing(ref)
    if cfg["front"] == "fsdp1":
        wrapped = wrap_fsdp1(ours, {**cfg, **cfg["ckpt"]} if phase == "B" else cfg, world)
        return ref, wrapped, None, modules
    wrapped = wrap_fully_shard(ours, cfg, world, torch_fsdp2=False)
    theirs = None
    if cfg.get("fsdp2"):
        theirs = make_model(spec, seed)
        gathers.convert(theirs, cfg.get("gathers_itself", []))
        modules["theirs"] = dict(theirs.named_modules())
        try:
            theirs = wrap_fully_shard(theirs, cfg, world, torch_fsdp2=True)
        except NotImplementedError as exc:  # FSDP2 refuses Shard(d > 0) that does not split evenly
            if "uneven sharding" not in str(exc):
                raise
            theirs = None
        # FSDP2 decides that from each rank's own piece: beside TP an uneven split on one TP rank may be
        # even on another, so it raises on some ranks only; drop it on every rank then (else a hang)
        refused = torch.tensor([float(theirs is None)])
        dist.all_reduce(refused, op=dist.ReduceOp.MAX)
        theirs = None if refused.item() else theirs
    return ref, wrapped, theirs, modules


LR = {"sgd": 0.05, "adamw": 1e-2, "adam": 1e-2}


def make_optimizer(cfg: dict, model: nn.Module) -> torch.optim.Optimizer:
    """SGD with momentum, AdamW (flatshard.param_groups: matrices decayed) or Adam, plain, foreach or fused."""
    from flatshard import param_groups

    kind, impl = cfg["optim"]["kind"], cfg["optim"]["impl"]
    flags = {"plain": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}[impl]
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=LR[kind], momentum=0.9, **flags)
    if kind == "adamw":
        return torch.optim.AdamW(param_groups(model, weight_decay=0.1), lr=LR[kind], **flags)
    return torch.optim.Adam(model.parameters(), lr=LR[kind], **flags)


def clean(name: str) -> str:
    """A parameter, buffer or module name as in the unwrapped model (no checkpoint wrapper in it)."""
    return ".".join(part for part in name.split(".") if part != "_checkpoint_wrapped_module")


def pg_count() -> int:
    return dist.get_pg_count()
