"""The JSON form of a plan (``flatshard plan --json``, ``to_json_dict``): the inputs, every plan, its
CPU-offload twin, the recommendations and the notes, as plain dicts."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from flatshard.planner.inputs import PlanInputs
from flatshard.planner.memory import activations_missing
from flatshard.planner.plan import PlanReport, Recommendation, StrategyPlan, notes, recommend_offload
from flatshard.planner.steptime import schedule_label


def _inputs_json(inputs: PlanInputs) -> dict[str, Any]:
    out = asdict(inputs)
    del out["unit_param_shapes"], out["root_param_shapes"]  # per parameter: said by the next two keys
    out["param_shapes_known"] = inputs.shapes_known
    out["shard_boundaries_modelled"] = inputs.boundaries_modelled  # "flat" when only unit sizes are known
    out["precision"] = inputs.recipe.name if isinstance(inputs.precision, str) else asdict(inputs.recipe)
    out["params"] = inputs.params
    out["units"] = len(inputs.unit_elements) + (1 if inputs.root_elements else 0)
    out["budget_bytes"] = inputs.budget_bytes
    out["unit_elements"] = list(inputs.unit_elements)
    if inputs.sharding_factors is not None:
        out["sharding_factors"] = list(inputs.sharding_factors)
    return out


def _plan_json(p: StrategyPlan, activations_counted: bool, across: bool = False) -> dict[str, Any]:
    """One plan; ``across`` (the inputs' optimizer_across_replicas): with "optimizer_across_replicas"
    and "comm_bytes_by_collective" ("phase/kind/group" -> bytes per rank, the recorder's names)."""
    m, c = p.memory, p.comm
    extra = {}
    if across:
        extra = {
            "optimizer_across_replicas": p.optimizer_across_replicas,
            "comm_bytes_by_collective": {k: b for k, (_, b) in c.by_collective.items()},
        }
    return {
        "strategy": p.strategy.value,
        "sharding_factor": p.sharding_factor,
        "replicas": p.replicas,
        "memory_bytes": {
            "params": m.params,
            "grads": m.grads,
            "optimizer": m.optimizer,
            "gather_buffer": m.gather_buffer,
            "activations": m.activations if activations_counted else None,  # None: not counted
            "steady": m.steady,  # the largest rank's
            "steady_min": min(m.steady_per_rank, default=m.steady),  # the smallest rank's
            "peak": m.peak,
        },
        "fits": p.fits,
        "comm_bytes_per_step": {
            "all_gather": c.all_gather,
            "reduce_scatter": c.reduce_scatter,
            "all_reduce": c.all_reduce,
            "intra_node": c.intra_node,
            "inter_node": c.inter_node,
            "total": c.total,
            "node_link": c.node_link,  # what the busiest node's link sends to other nodes, all its ranks
        },
        "step_time_s": p.time.expected_s,
    } | extra


def _offload_json(p: StrategyPlan, activations_counted: bool) -> dict[str, Any] | None:
    o = p.offload
    if o is None:  # a "+OptR" plan: the engine builds no CPU offload with it
        return None
    return {
        "device_bytes": {
            "gather_buffer": o.gather_buffer,
            "unsharded_grad": o.unsharded_grad,
            "staging": o.staging,
            "reduced": o.reduced,
            "activations": o.activations if activations_counted else None,
            "forward_peak": o.forward_peak,
            "peak": o.device_peak,
        },
        "host_bytes": {
            "params": o.host_params,
            "grads": o.host_grads,
            "optimizer": o.host_optimizer,
            "per_rank": o.host_per_rank,
            "per_node": o.host_per_node,
            "pinned": o.host_pinned,
        },
        "device_fits": o.device_fits,
        "host_fits": o.host_fits,
        "fits": o.fits,
        "copy_bytes_per_step": {"host_to_device": o.host_to_device, "device_to_host": o.device_to_host},
        "copy_time_s": o.copy_s,
        "optimizer_bytes": o.optimizer_bytes,
        "optimizer_time_s": o.optimizer_s,
        "step_time_s": o.step_time_s,
    }


def _recommendation_json(rec: Recommendation, across: bool = False) -> dict[str, Any]:
    out = {"strategy": rec.strategy.value if rec.strategy else None, "sharding_factor": rec.sharding_factor}
    out |= {"optimizer_across_replicas": rec.optimizer_across_replicas} if across else {}
    return out | {"why": rec.why}


def to_json_dict(report: PlanReport) -> dict[str, Any]:
    """The report as ``flatshard plan --json`` prints it: exactly the keys inputs, plans, recommendation,
    activations_counted (False: every plan's "activations" is None and its peaks leave them out),
    step_schedule (the schedule every "step_time_s" assumes: a sentence starting "scheduled" or
    "overlapped") and notes (sentences on what the figures leave out or assume); with ``inputs.offload``
    each plan also has "offload" and the report "offload_recommendation" (a "+OptR" plan's "offload" is
    null); with ``inputs.optimizer_across_replicas`` each plan and the recommendation say whether they
    are "+OptR" (``optimizer_across_replicas``) and each plan has its bytes per collective."""
    offload = report.inputs.offload
    counted = not activations_missing(report.inputs)
    across = report.inputs.optimizer_across_replicas
    plans = [
        _plan_json(p, counted, across) | ({"offload": _offload_json(p, counted)} if offload else {})
        for p in report.plans
    ]
    out = {
        "inputs": _inputs_json(report.inputs),
        "plans": plans,
        "recommendation": _recommendation_json(report.recommendation, across),
        "activations_counted": counted,
        "step_schedule": schedule_label(report.inputs),
        "notes": notes(report.inputs),
    }
    if offload:
        out["offload_recommendation"] = _recommendation_json(recommend_offload(report.inputs, report.plans))
    return out
