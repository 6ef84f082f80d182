"""World → shard group × replicate group: the sharding factor F and the replica count R = W / F.

Every strategy is a pair of groups. FULL_SHARD and SHARD_GRAD_OP shard over the whole process group
(F = W, R = 1); NO_SHARD replicates over it (F = 1, R = W). A group of size 1 is never called: a unit
with F = 1 aliases its unsharded flat to its flat shard, and R = 1 skips the all-reduce.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist
from torch.distributed import ProcessGroup

from flatshard.api import NotBuiltError, ShardingStrategy


@dataclass(frozen=True)
class ShardGroups:
    shard_group: Optional[ProcessGroup]  # None when F == 1
    replicate_group: Optional[ProcessGroup]  # None when R == 1
    shard_size: int  # F
    shard_rank: int
    replicate_size: int  # R
    process_group: ProcessGroup  # all ranks that train this model together (F·R of them)

    @property
    def data_parallel_size(self) -> int:
        """How many ranks see different data: gradients are summed over them and divided by this."""
        return self.shard_size * self.replicate_size


def _require_initialized() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            "flatshard needs torch.distributed: call torch.distributed.init_process_group(backend) "
            "before wrapping (use 'gloo' on CPU, 'nccl' on GPUs; start the processes with torchrun). "
            "A single process works too: init_process_group('gloo', rank=0, world_size=1, ...)."
        )


def resolve_groups(strategy: ShardingStrategy, process_group, device_mesh) -> ShardGroups:
    """Turn FSDP's ``process_group`` / ``device_mesh`` keywords into a pair of groups."""
    _require_initialized()
    if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
        raise NotBuiltError(
            f"sharding_strategy={strategy.name} is not built yet in flatshard (hybrid sharding lands with "
            "its own issue); use FULL_SHARD, SHARD_GRAD_OP or NO_SHARD for now."
        )
    if isinstance(process_group, tuple):
        raise NotBuiltError(
            "process_group=(shard_group, replicate_group) is for hybrid sharding, which is not built yet; "
            "pass one ProcessGroup (or None for the default group)."
        )
    if device_mesh is not None:
        if process_group is not None:
            raise ValueError("pass either process_group or device_mesh, not both")
        if device_mesh.ndim != 1:
            raise NotBuiltError(
                f"a {device_mesh.ndim}-D device_mesh means hybrid sharding, which is not built yet; "
                "pass a 1-D mesh (or process_group=) for now."
            )
        process_group = device_mesh.get_group()
    group = process_group if process_group is not None else dist.group.WORLD
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if rank < 0:
        raise ValueError("this rank is not a member of the process_group given to FullyShardedDataParallel")
    if strategy is ShardingStrategy.NO_SHARD or size == 1:
        return ShardGroups(None, group if size > 1 else None, 1, 0, size, group)
    return ShardGroups(group, None, size, rank, 1, group)
