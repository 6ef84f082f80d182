"""flatshard.planner: a pure cost model of sharded data parallel training.

What fits, what it costs, which sharding factor to choose: per-rank bytes, collectives and bytes per
link class, an alpha-beta step time, and the same with CPU offload (device, host, copies) for
FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD and _HYBRID_SHARD_ZERO2 at every sharding factor F
dividing the world size. Arithmetic only: nothing here imports torch.distributed (or torch), so it runs
anywhere, before any process starts.

    from flatshard.planner import PlanInputs, plan
    report = plan(PlanInputs.from_params(7 * 10**9, units=32, world_size=8, device_memory_bytes=40 * 10**9))
    report.plan_for("FULL_SHARD").memory.steady      # 14_000_000_000
    report.recommendation                             # strategy, sharding_factor, why

Reading path: inputs.py (what is asked) -> memory.py and comm.py (the two models, each opening with
its [Note]) -> steptime.py (the step as the engine schedules it) -> plan.py (plans, recommendation,
the sharding factor for ``"auto"``, JSON) -> cli.py (``flatshard plan``). models.py turns presets,
config numbers or a module into unit sizes; calibration.py reads measured link figures;
quantities.py parses "7B" and "40GB".
docs/planner.md has the formulas and the documents' figures, each with the command that prints it.
"""

from flatshard.planner.calibration import links_from_calibration, read_calibration
from flatshard.planner.comm import CollectiveCounts, CommEstimate, UnitComm, group_link
from flatshard.planner.errors import PlanError
from flatshard.planner.inputs import (
    BF16_MIXED,
    EXCHANGES,
    FP32,
    OPTIMIZERS,
    PRECISIONS,
    Links,
    PlanInputs,
    PrecisionRecipe,
    Strategy,
)
from flatshard.planner.json_form import to_json_dict
from flatshard.planner.memory import MemoryEstimate, activation_bytes, activations_missing, activations_note
from flatshard.planner.models import (
    PRESETS,
    ModelShape,
    ModuleLayout,
    layout_from_module,
    preset,
    read_hf_config,
    shape_from_hf_config,
)
from flatshard.planner.offload import OffloadEstimate, offload_estimate
from flatshard.planner.plan import (
    STEP_ERROR,
    PlanReport,
    Recommendation,
    StrategyPlan,
    choose_sharding_factor,
    notes,
    plan,
    plan_strategy,
    recommend_offload,
    strategies_at,
)
from flatshard.planner.quantities import parse_bandwidth, parse_bytes, parse_count
from flatshard.planner.steptime import TimeEstimate, schedule_label

__all__ = [
    "BF16_MIXED",
    "EXCHANGES",
    "FP32",
    "OPTIMIZERS",
    "PRECISIONS",
    "PRESETS",
    "STEP_ERROR",
    "CollectiveCounts",
    "CommEstimate",
    "Links",
    "MemoryEstimate",
    "ModelShape",
    "ModuleLayout",
    "OffloadEstimate",
    "PlanError",
    "PlanInputs",
    "PlanReport",
    "PrecisionRecipe",
    "Recommendation",
    "Strategy",
    "StrategyPlan",
    "TimeEstimate",
    "UnitComm",
    "activation_bytes",
    "activations_missing",
    "activations_note",
    "choose_sharding_factor",
    "group_link",
    "layout_from_module",
    "links_from_calibration",
    "notes",
    "offload_estimate",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "plan",
    "plan_strategy",
    "preset",
    "read_calibration",
    "read_hf_config",
    "recommend_offload",
    "schedule_label",
    "shape_from_hf_config",
    "strategies_at",
    "to_json_dict",
]
