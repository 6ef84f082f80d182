"""``sharding_factor="auto"``: the planner picks F from the real model's units.

The paper's R4: the smallest sharding factor whose peak fits, not full sharding by default. The
units are known before any parameter is sharded (the wrap policy and placement do not depend on F),
so the planner sees the real element count of every unit and of the root, and the number of
original parameters (AdamW's ``step`` tensors). The budget is what parameters, gradients,
optimizer state and gathered units may use on one rank: ``memory_budget`` bytes, or the
accelerator's free memory. Activations are not known at wrap time and are not counted.

With ``link_figures`` (a ``flatshard.planner.Links``: the links within and between nodes) the
planner chooses by time instead: among the F that fit, the one whose step it predicts fastest
([Note: planner step schedule] in planner/steptime.py), for the topology the engine resolves (ranks
per node: ``ranks_per_node`` or LOCAL_WORLD_SIZE, as comm/nodes.py's ``Nodes``) and the collectives it
will run (flatshard's point-to-point exchange on gloo, the backend's ring otherwise). Compute and the
optimizer step are not known at wrap time either: the times compared are communication only, which
is what differs between the F (compute is the same for every F); what they leave out, the ``why``
says.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.distributed as dist

from flatshard.api import ShardingStrategy
from flatshard.planner import Links, PlanInputs, choose_sharding_factor
from flatshard.runtime.comm.nodes import Nodes

logger = logging.getLogger("flatshard")


def auto_sharding_factor(
    *,
    strategy: ShardingStrategy,
    unit_sizes: list[int],
    root_size: int,
    param_tensors: int,
    world_size: int,
    memory_budget: Optional[int],
    device: torch.device,
    optimizer: str = "adam",
    link_figures: Optional[Links] = None,
    ranks_per_node: Optional[int] = None,
    group: Any = None,
    inter_node_in_flight: bool = True,
    optimizer_across_replicas: bool = False,
) -> tuple[int, str]:
    if strategy is ShardingStrategy.NO_SHARD:
        raise ValueError('sharding_factor="auto" chooses how far to shard; NO_SHARD fixes F = 1. Drop one of the two.')
    if link_figures is not None and not isinstance(link_figures, Links):
        raise TypeError(
            f"link_figures must be a flatshard.planner.Links (bandwidths and latencies within and between nodes), "
            f"got {type(link_figures).__name__}; e.g. Links(intra_bandwidth=300e9, inter_bandwidth=25e9), or "
            "flatshard.planner.read_calibration(path)[0] for a measured calibration"
        )
    budget = memory_budget if memory_budget is not None else _free_device_memory(device)
    topology: dict[str, Any] = {"gpus_per_node": world_size}
    if link_figures is not None:
        topology = {
            "gpus_per_node": Nodes.resolve(ranks_per_node).size,
            "links": link_figures,
            "exchange": _exchange(device, group),
            "inter_node_in_flight": inter_node_in_flight,
        }
    inputs = PlanInputs(
        world_size=world_size,
        unit_elements=tuple(unit_sizes),
        root_elements=root_size,
        device_memory_bytes=int(budget),
        headroom=0.0,
        optimizer=optimizer,
        param_tensors=param_tensors,
        optimizer_across_replicas=optimizer_across_replicas,
        **topology,
    )
    factor, why = choose_sharding_factor(
        inputs, reshard_after_forward=strategy.reshard_after_forward, by_time=link_figures is not None
    )
    if why.startswith("nothing fits"):
        raise ValueError(
            f'sharding_factor="auto": {why}. Give a larger memory_budget, more ranks, or smaller units; or pass '
            "sharding_factor=W to shard fully anyway."
        )
    if dist.get_rank() == 0:
        logger.info("sharding_factor=auto chose F=%d of W=%d: %s", factor, world_size, why)
    return factor, why


def _exchange(device: torch.device, group: Any) -> str:
    """How the engine will move all-gathers and reduce-scatters: point-to-point on gloo (CPU tensors,
    comm/collectives.py), the backend's ring otherwise."""
    backend = str(dist.get_backend(group if group is not None else dist.group.WORLD))
    return "direct" if device.type == "cpu" and "gloo" in backend else "ring"


def _free_device_memory(device: torch.device) -> int:
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return free
    raise ValueError(
        'sharding_factor="auto" needs a memory budget: on a CPU device pass memory_budget=<bytes per rank> '
        "(what parameters, gradients, optimizer state and gathered units may use); on a GPU the device's free "
        "memory is used when memory_budget is not given."
    )
