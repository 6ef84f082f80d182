"""Front end 2: ``fully_shard``, PyTorch FSDP2's API (DTensor parameters) on flatshard's engine.

    from flatshard import fully_shard, MixedPrecisionPolicy      # was: from torch.distributed.fsdp import ...

  frontend.py         fully_shard(), the policies, DTensor views
  module.py           FSDPModule: FSDP2's methods on a sharded module (unshard, reshard, set_*)
  checks.py           what fully_shard refuses before it builds anything
  tensor_parallel.py  FSDP over tensor-parallel DTensor parameters (a 2-D mesh: TP inside, FSDP across)
  extensions.py       parameters that gather themselves (FSDP2's fsdp_pre/post_all_gather)
  whole.py            shard_boundaries="params": every parameter whole on one rank (Muon), clip_grad_norm_
  spmd.py             dp_mesh_dims: parameters already DTensors on the whole SPMD mesh

(The function's file is frontend.py, not fully_shard.py: a submodule named like the function would
replace it as ``flatshard.fsdp2.fully_shard``.)
"""

from flatshard.fsdp2.checks import FullyShardUsageError
from flatshard.fsdp2.frontend import (
    CPUOffloadPolicy,
    MixedPrecisionPolicy,
    OffloadPolicy,
    fully_shard,
    register_fsdp_forward_method,
)
from flatshard.fsdp2.module import FSDPModule, UnshardHandle
from flatshard.fsdp2.whole import clip_grad_norm_

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "FullyShardUsageError",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "UnshardHandle",
    "clip_grad_norm_",
    "fully_shard",
    "register_fsdp_forward_method",
]
