"""World → shard group × replicate group: the sharding factor F and the replica count R = W / F.

Every strategy is a pair of groups over the W ranks that train one model:

  FULL_SHARD, SHARD_GRAD_OP      F = W, R = 1 (unless a sharding_factor says otherwise)
  NO_SHARD                       F = 1, R = W (gradients all-reduced, as DDP)
  HYBRID_SHARD, _HYBRID_ZERO2    1 <= F <= W, shard groups of F consecutive ranks (a node under
                                 torchrun), replicate groups of the ranks with the same index in them

Three ways to name the groups, all equivalent: a 2-D ``DeviceMesh`` (replicate, shard);
``process_group=(shard_group, replicate_group)``; or flatshard's ``sharding_factor=F``. With a hybrid
strategy and none of them, F is the node size (torchrun's ``LOCAL_WORLD_SIZE``). A group of size 1
is never called: a unit with F = 1 aliases its unsharded flat to its flat shard, R = 1 skips the
all-reduce.
"""

from __future__ import annotations

import atexit
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from flatshard.api import ShardingStrategy
from flatshard.runtime.comm.collectives import default_group


@dataclass(frozen=True)
class ShardGroups:
    shard_group: Optional[ProcessGroup]  # None when F == 1
    replicate_group: Optional[ProcessGroup]  # None when R == 1
    shard_size: int  # F
    shard_rank: int
    replicate_size: int  # R
    process_group: ProcessGroup  # all ranks that train this model together (F·R of them)
    replicate_rank: int = 0  # which replica this rank belongs to

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data: gradients are summed over them and divided by this."""
        return self.shard_size * self.replicate_size


def device_of(device_id) -> torch.device:
    """FSDP's ``device_id``: an int is a CUDA device index; a string or ``torch.device`` is itself."""
    return torch.device("cuda", device_id) if isinstance(device_id, int) else torch.device(device_id)


def group_timeout(group: Optional[ProcessGroup]) -> Optional[timedelta]:
    """The timeout ``group``'s collectives run under (what ``init_process_group``/``new_group`` was given),
    or None when the backend does not say (then torch's default applies to groups made from it)."""
    group = group if group is not None else dist.group.WORLD
    if group is None:  # torch.distributed is not initialised: no group, no timeout
        return None
    for device in ("cpu", "cuda"):
        try:
            return group._get_backend(torch.device(device)).options._timeout
        except (RuntimeError, AttributeError):
            continue
    return None


def require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flatshard needs torch.distributed: call torch.distributed.init_process_group(backend) "
            "before wrapping (use 'gloo' on CPU, 'nccl' on GPUs; start the processes with torchrun). "
            "A single process works too: init_process_group('gloo', rank=0, world_size=1, ...)."
        )
    if "gloo" in str(dist.get_backend()):
        _hand_gloo_workers_the_gil_at_exit()


# [Note: gloo's workers at exit]
# A gloo worker thread destroys each collective's Work once it has run it. When the Work holds the last
# reference to a tensor whose Python object the script has already dropped, that destruction takes the GIL.
# If the interpreter starts finalizing while the thread still waits for the GIL (the main thread held it
# from the script's last collective to its last line), Python ends the thread inside C++ and the process
# aborts after the script has finished: SIGABRT, "terminate called without an active exception", core
# backtrace ProcessGroupGloo::runLoop -> ~AsyncAllreduceWork -> TensorImpl::decref_pyobject -> take_gil ->
# PyThread_exit_thread. torchrun then reports the run failed. The README's FSDP1 quickstart ended so in 5 of
# 60 runs under torchrun on 2 cores, the same script with the handler below in 0 of 60 (the loop that counts
# them is in CONTRIBUTING.md). The handler, registered once when a gloo group is in use, runs before
# finalization and sleeps, which releases the GIL, so a waiting worker finishes. PyTorch's FSDP2 on gloo
# aborts the same way (the conformance shim, tests/conformance/shim.py, ends a passed rank without
# finalizing); a script that imports flatshard gets the handler whichever front end issued the collective.
_EXIT_HANDOFF_S = 0.05
_exit_handoff_registered = False


def _hand_gloo_workers_the_gil_at_exit() -> None:
    global _exit_handoff_registered
    if not _exit_handoff_registered:
        _exit_handoff_registered = True
        atexit.register(time.sleep, _EXIT_HANDOFF_S)


def resolve_groups(strategy: ShardingStrategy, process_group, device_mesh, sharding_factor=None) -> ShardGroups:
    """Turn FSDP's ``process_group`` / ``device_mesh`` keywords (and ``sharding_factor``) into a pair of groups."""
    require_initialized()
    if device_mesh is not None and process_group is not None:
        raise ValueError("pass either process_group or device_mesh, not both")
    ways = {
        "device_mesh": device_mesh,
        "process_group=(shard_group, replicate_group)": process_group if isinstance(process_group, tuple) else None,
        "sharding_factor": sharding_factor,
    }
    given = [name for name, value in ways.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"name the shard and replicate groups one way only; got {' and '.join(given)}")
    if isinstance(process_group, tuple):
        return _from_pair(strategy, process_group)
    if device_mesh is not None and device_mesh.ndim == 2:
        return _from_mesh(strategy, device_mesh)
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(f"device_mesh must be 1-D (shard) or 2-D (replicate, shard); got {device_mesh.ndim}-D")
        process_group = device_mesh.get_group()
    group = process_group if process_group is not None else default_group()
    world = dist.get_world_size(group)
    if dist.get_rank(group) < 0:
        raise ValueError("this rank is not a member of the process_group given to FullyShardedDataParallel")
    factor = _factor(strategy, sharding_factor, world)
    return _split(group, world, factor)


def _factor(strategy: ShardingStrategy, sharding_factor, world: int) -> int:
    if sharding_factor is None:
        if strategy is ShardingStrategy.NO_SHARD:
            return 1
        if strategy.is_hybrid:
            return _node_size(strategy, world)
        return world
    if isinstance(sharding_factor, bool) or not isinstance(sharding_factor, int):
        raise TypeError(f"sharding_factor must be an int dividing the world size {world}; got {sharding_factor!r}")
    if sharding_factor < 1 or world % sharding_factor:
        divisors = [d for d in range(1, world + 1) if world % d == 0]
        raise ValueError(
            f"sharding_factor={sharding_factor} does not divide the world size {world}; choose one of {divisors} "
            "(F ranks share one copy of the model, W / F replicas train on different data)."
        )
    if strategy is ShardingStrategy.NO_SHARD and sharding_factor != 1:
        raise ValueError(
            f"NO_SHARD means sharding_factor=1; for F={sharding_factor} use HYBRID_SHARD (or FULL_SHARD, which "
            "takes any sharding_factor)."
        )
    return sharding_factor


def _node_size(strategy: ShardingStrategy, world: int) -> int:
    local = os.environ.get("LOCAL_WORLD_SIZE")
    if local is None:
        raise ValueError(
            f"{strategy.name} needs its shard groups: pass sharding_factor=F, a 2-D device_mesh "
            "(init_device_mesh(device, (R, F), mesh_dim_names=('replicate', 'shard'))) or "
            "process_group=(shard_group, replicate_group); under torchrun the default is one node "
            "(LOCAL_WORLD_SIZE ranks)."
        )
    factor = int(local)
    if world % factor:
        raise ValueError(
            f"LOCAL_WORLD_SIZE={factor} does not divide the world size {world}: nodes of different sizes "
            "cannot form shard groups; pass sharding_factor=F explicitly."
        )
    return factor


def _split(group: ProcessGroup, world: int, factor: int) -> ShardGroups:
    """Shard groups of ``factor`` consecutive ranks of ``group``; replicate groups across them.

    Every rank creates every subgroup, in the same order (``new_group`` is collective), with ``group``'s
    timeout: a stalled peer fails the others after the time the user gave, not torch's default."""
    ranks = dist.get_process_group_ranks(group)
    me = dist.get_rank(group)
    replicas = world // factor
    shard_group = replicate_group = None
    timeout = group_timeout(group)
    if 1 < factor < world:
        for r in range(replicas):
            g = dist.new_group(ranks[r * factor : (r + 1) * factor], timeout=timeout)
            if r == me // factor:
                shard_group = g
        for k in range(factor):
            g = dist.new_group(ranks[k::factor], timeout=timeout)
            if k == me % factor:
                replicate_group = g
    elif factor == world and world > 1:
        shard_group = group
    elif factor == 1 and world > 1:
        replicate_group = group
    return ShardGroups(shard_group, replicate_group, factor, me % factor, replicas, group, me // factor)


def _from_pair(strategy: ShardingStrategy, pair: tuple) -> ShardGroups:
    if not strategy.is_hybrid:
        raise ValueError(
            "process_group=(shard_group, replicate_group) is for HYBRID_SHARD or _HYBRID_SHARD_ZERO2, "
            f"not {strategy.name}"
        )
    if len(pair) != 2:
        raise ValueError("process_group as a tuple must be (shard_group, replicate_group)")
    shard, replicate = pair
    return _checked(shard, replicate, default_group(), "process_group=(shard_group, replicate_group)")


def _from_mesh(strategy: ShardingStrategy, mesh) -> ShardGroups:
    if not strategy.is_hybrid:
        raise ValueError(
            f"a 2-D device_mesh (replicate, shard) is for HYBRID_SHARD or _HYBRID_SHARD_ZERO2, not {strategy.name}; "
            "pass a 1-D mesh for FULL_SHARD / SHARD_GRAD_OP / NO_SHARD"
        )
    names = mesh.mesh_dim_names
    shard_dim, replicate_dim = ("shard", "replicate") if names and set(names) == {"shard", "replicate"} else (1, 0)
    # a 2-D data-parallel mesh inside a larger one (HSDP beside tensor parallelism): its own ranks' group
    whole = default_group() if mesh.size() == dist.get_world_size() else mesh._flatten().get_group()
    return _checked(mesh.get_group(shard_dim), mesh.get_group(replicate_dim), whole, "device_mesh")


def _checked(shard: ProcessGroup, replicate: ProcessGroup, world_group: ProcessGroup, how: str) -> ShardGroups:
    F, R, W = dist.get_world_size(shard), dist.get_world_size(replicate), dist.get_world_size(world_group)
    if F * R != W:
        raise ValueError(
            f"{how} describes {R} replicas × {F} shards = {F * R} ranks, but the world has {W}; the groups must "
            "cover every rank exactly once."
        )
    return ShardGroups(
        shard if F > 1 else None,
        replicate if R > 1 else None,
        F,
        dist.get_rank(shard),
        R,
        world_group,
        dist.get_rank(replicate),
    )
