"""Plans for every strategy and sharding factor, and the recommendation (the JSON form: json_form.py).

Reading path: ``plan(inputs)`` -> one ``plan_strategy`` per (strategy, F) -> ``memory_estimate``
(memory.py), ``comm_estimate`` (comm.py), ``time_estimate`` (steptime.py), ``offload_estimate``
(offload.py: the same plan with CPU offload) -> ``recommend`` and ``recommend_offload``.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.planner.comm import CommEstimate, comm_estimate
from flatshard.planner.errors import PlanError
from flatshard.planner.inputs import PlanInputs, Strategy
from flatshard.planner.memory import MemoryEstimate, activations_missing, activations_note, memory_estimate
from flatshard.planner.offload import OffloadEstimate, offload_estimate
from flatshard.planner.quantities import fmt_bytes, fmt_seconds
from flatshard.planner.steptime import TimeEstimate, compute_known, time_estimate

# [Note: planner private strategy margin]
# _HYBRID_SHARD_ZERO2 is private (the leading underscore PyTorch gives it), so the recommendation takes it
# over the public plan at the same F only when the planner can tell the two apart: when its predicted step
# is shorter by more than STEP_ERROR, the error every step prediction is judged by against a measured step
# (bench/cluster/predict.py's TOLERANCE; docs/planner.md, "Checked against a cluster"). The pair itself was
# measured so: predicted within 2% of each other, HYBRID_SHARD and _HYBRID_SHARD_ZERO2 measured 10% apart
# one way in one run and 20% the other way in the run before (docs/multi_node.md). Without compute the
# times are communication only, which says nothing of how far apart the steps are: the public one then.
STEP_ERROR = 0.25


@dataclass(frozen=True)
class StrategyPlan:
    strategy: Strategy
    sharding_factor: int
    replicas: int
    memory: MemoryEstimate
    fits: bool
    comm: CommEstimate
    time: TimeEstimate
    offload: OffloadEstimate | None  # the same with CPUOffload(offload_params=True); None: not built with pieces
    optimizer_across_replicas: bool = False  # shard_optimizer_across_replicas=True (PlanInputs)

    @property
    def label(self) -> str:
        """The strategy's name, "+OptR" added with the optimizer state across replicas."""
        return self.strategy.value + ("+OptR" if self.optimizer_across_replicas else "")


@dataclass(frozen=True)
class Recommendation:
    """R4: the smallest F whose peak fits, the fastest plan at that F (a private strategy only by more
    than STEP_ERROR, [Note: planner private strategy margin]). ``strategy`` and
    ``sharding_factor`` are None when nothing fits; ``why`` then says what would help."""

    strategy: Strategy | None
    sharding_factor: int | None
    why: str
    optimizer_across_replicas: bool = False  # the recommended plan is a "+OptR" one


@dataclass(frozen=True)
class PlanReport:
    inputs: PlanInputs
    plans: tuple[StrategyPlan, ...]
    recommendation: Recommendation

    def plan_for(
        self, strategy: Strategy | str, sharding_factor: int | None = None, optimizer_across_replicas: bool = False
    ) -> StrategyPlan:
        """The plan of ``strategy`` (at ``sharding_factor`` for the hybrids; the "+OptR" one with
        ``optimizer_across_replicas``)."""
        s = Strategy(strategy)
        for p in self.plans:
            if p.strategy is s and sharding_factor in (None, p.sharding_factor):
                if p.optimizer_across_replicas == optimizer_across_replicas:
                    return p
        raise KeyError(f"no {s.value}{'+OptR' if optimizer_across_replicas else ''} plan at F={sharding_factor}")


def strategies_at(world_size: int, f: int) -> tuple[Strategy, ...]:
    """F = 1 is NO_SHARD, F = W is FULL_SHARD and SHARD_GRAD_OP, anything between is hybrid."""
    if f == 1:
        return (Strategy.NO_SHARD,)
    if f == world_size:
        return (Strategy.FULL_SHARD, Strategy.SHARD_GRAD_OP)
    return (Strategy.HYBRID_SHARD, Strategy._HYBRID_SHARD_ZERO2)


def plan_strategy(inputs: PlanInputs, strategy: Strategy | str, sharding_factor: int) -> StrategyPlan:
    """The plan of one strategy at one sharding factor (which must suit the strategy); a hybrid at
    1 < F < W with ``inputs.optimizer_across_replicas`` is planned with its optimizer state across replicas."""
    s, f = Strategy(strategy), sharding_factor
    if f < 1 or inputs.world_size % f:
        raise PlanError(
            f"sharding factor F={f} does not divide world size W={inputs.world_size}", "pass an F that divides W"
        )
    if s not in strategies_at(inputs.world_size, f):
        raise PlanError(
            f"{s.value} does not run at F={f} with W={inputs.world_size}",
            "NO_SHARD is F=1, FULL_SHARD and SHARD_GRAD_OP are F=W, the hybrids 1<F<W",
        )
    pieces = inputs.across_replicas(s, f)
    memory = memory_estimate(inputs, s, f, pieces)
    comm = comm_estimate(inputs, s, f, pieces)
    time = time_estimate(inputs, comm, f)
    return StrategyPlan(
        s,
        f,
        inputs.world_size // f,
        memory,
        memory.peak <= inputs.budget_bytes,
        comm,
        time,
        # the CPU steps instead; the engine builds no CPU offload with the optimizer state across replicas
        None if pieces else offload_estimate(inputs, s, f, memory, time.expected_s - time.optimizer_s),
        pieces,
    )


def plan(inputs: PlanInputs) -> PlanReport:
    """Every strategy at every sharding factor F dividing W (ascending F), and the recommendation. With
    ``inputs.optimizer_across_replicas`` each hybrid F also has its "+OptR" plans, after the plain ones."""
    plain = inputs.replace(optimizer_across_replicas=False) if inputs.optimizer_across_replicas else inputs
    plans = []
    for f in inputs.factors():
        strategies = strategies_at(inputs.world_size, f)
        plans += [plan_strategy(plain, s, f) for s in strategies]
        plans += [plan_strategy(inputs, s, f) for s in strategies if inputs.across_replicas(s, f)]
    return PlanReport(inputs, tuple(plans), recommend(inputs, plans))


def _budget_text(inputs: PlanInputs) -> str:
    return (
        f"{fmt_bytes(inputs.budget_bytes)} ({fmt_bytes(inputs.device_memory_bytes)} less "
        f"{inputs.headroom:.0%} headroom)"
    )


def _remedies(inputs: PlanInputs, best: StrategyPlan) -> str:
    """What could make the smallest peak fit, leaving out what is already in use."""
    out = ["more GPUs"]
    if best.memory.activations and not inputs.activation_checkpointing:
        out.append("activation checkpointing")
    if best.memory.activations and inputs.micro_batch > 1:
        out.append("a smaller micro-batch")
    if best.memory.gather_buffer + best.memory.unsharded_grad > best.memory.steady // 4:
        units = len(inputs.unit_elements) + (1 if inputs.root_elements else 0)
        if inputs.units_defaulted:
            out.append(
                "more, smaller units (--units defaulted to 1, the whole model gathered at once: "
                "pass --units M, e.g. one per layer)"
            )
        else:
            out.append(f"more, smaller units (now {units})")
    return "try " + ", ".join(out)


def notes(inputs: PlanInputs) -> list[str]:
    """What the figures leave out or assume, in sentences: activations not counted, units defaulted,
    shard boundaries that needed parameter shapes the inputs lack, device_flops that cannot count."""
    out = []
    note = activations_note(inputs)
    if note:
        out.append(note)
    if inputs.boundaries_note:
        out.append(inputs.boundaries_note)
    if inputs.units_defaulted:
        out.append(
            "--units defaulted to 1: the whole model is one unit, gathered at once; pass --units M (e.g. one "
            "per layer) for M units"
        )
    if inputs.optimizer_across_replicas:
        out.append(_across_replicas_note(inputs))
    # [Note: a flag for the other schedule]
    # The expected step is the overlapped one with prefetch and the scheduled one without (steptime.py); a
    # setting of the other one's model changes only --full's and --json's figures, so the summary says so
    # rather than printing an unchanged step.
    if not inputs.overlap_all_reduce and inputs.prefetch_depth == 0:
        out.append(
            "--exposed-all-reduce changes only the overlapped step, which is the expected one with --prefetch 1 "
            "or more; at prefetch 0 it shows in --full and --json only"
        )
    if not inputs.inter_node_in_flight and inputs.prefetch_depth >= 1:
        out.append(
            "--no-inter-node-in-flight changes only the scheduled step, which is the expected one at --prefetch 0; "
            "with prefetch it shows in --full and --json only"
        )
    if inputs.device_flops and inputs.compute_time_s is not None:
        out.append("device_flops is not used: compute_time_s gives the compute")
    elif inputs.device_flops and not compute_known(inputs):
        out.append("device_flops is not used: compute is 6 P tokens FLOPs, and micro_batch x seq_len is 0")
    return out


def _across_replicas_note(inputs: PlanInputs) -> str:
    w = inputs.world_size
    if not any(1 < f < w for f in inputs.factors()):
        return f"no +OptR plan: the optimizer state across replicas needs a hybrid sharding factor 1 < F < {w}"
    return (
        "+OptR: the hybrid with shard_optimizer_across_replicas=True: parameters 1/F per rank as the plain "
        f"hybrid, gradients and optimizer state 1/{w}; across replicas a reduce-scatter in backward and, in the "
        "next forward, an all-gather of the updated pieces instead of the all-reduce"
        + ("; it has no CPU offload figures (the engine builds the two only apart)" if inputs.offload else "")
    )


def _host_budget_text(inputs: PlanInputs) -> str:
    return (
        f"{fmt_bytes(inputs.host_budget_bytes or 0)} of host memory per node "
        f"({fmt_bytes(inputs.host_memory_bytes or 0)} less {inputs.headroom:.0%})"
    )


def _offload_text(p: StrategyPlan, o: OffloadEstimate) -> str:
    return (
        f"{p.strategy.value} at F={p.sharding_factor} peaks at {fmt_bytes(o.device_peak)} on the device and "
        f"needs {fmt_bytes(o.host_per_node)} of host memory per node ({fmt_bytes(o.host_per_rank)} per rank), "
        f"about {fmt_seconds(o.step_time_s)} per step"
    )


def recommend_offload(inputs: PlanInputs, plans: tuple[StrategyPlan, ...] | list[StrategyPlan]) -> Recommendation:
    """The R4 rule for the plans with CPU offload: the smallest F whose device peak and host bytes per
    node both fit, then the fastest. With host memory unknown nothing is judged: ``strategy`` is None
    and ``why`` names the plan that fits the device with the least host memory per node."""
    # each plan with its estimate; not the "+OptR" plans: not built with offload
    offloaded = [(p, p.offload) for p in plans if p.offload is not None]
    if not offloaded:
        return Recommendation(None, None, "no plans")
    device_ok = [(p, o) for p, o in offloaded if o.device_fits]
    if not device_ok:
        best, o = min(offloaded, key=lambda po: po[1].device_peak)
        return Recommendation(
            None,
            None,
            (
                f"CPU offload does not fit either: its smallest device peak is {fmt_bytes(o.device_peak)} "
                f"({best.strategy.value}, F={best.sharding_factor}), more than {_budget_text(inputs)}"
            ),
        )
    least = min(device_ok, key=lambda po: (po[1].host_per_node, po[1].step_time_s))
    if inputs.host_memory_bytes is None:
        return Recommendation(
            None,
            None,
            (
                f"CPU offload fits the device: {_offload_text(*least)}; host memory unknown: pass --host-mem "
                f"(per node) to judge"
            ),
        )
    fitting = [(p, o) for p, o in device_ok if o.fits]
    if not fitting:
        return Recommendation(
            None,
            None,
            (f"CPU offload does not fit either: {_offload_text(*least)}, more than {_host_budget_text(inputs)}"),
        )
    f = min(p.sharding_factor for p, _ in fitting)
    best, o = min(
        ((p, o) for p, o in fitting if p.sharding_factor == f), key=lambda po: (po[1].step_time_s, po[1].device_peak)
    )
    return Recommendation(
        best.strategy,
        f,
        (
            f"CPU offload fits: F={f} is the smallest sharding factor that fits both {fmt_bytes(inputs.budget_bytes)} "
            f"per device and {_host_budget_text(inputs)}: {_offload_text(best, o)}"
        ),
    )


def recommend(inputs: PlanInputs, plans: tuple[StrategyPlan, ...] | list[StrategyPlan]) -> Recommendation:
    """R4 of the PyTorch FSDP paper: the smallest F that fits, then the fastest at that F; a private
    strategy only when faster by more than STEP_ERROR ([Note: planner private strategy margin])."""
    fitting = [p for p in plans if p.fits]
    if not fitting:
        best = min(plans, key=lambda p: p.memory.peak)
        verdict = recommend_offload(inputs, plans).why
        counted = "" if not activations_missing(inputs) else ", activations not counted"
        return Recommendation(
            None,
            None,
            (
                f"nothing fits in {_budget_text(inputs)}: the smallest peak is {fmt_bytes(best.memory.peak)} "
                f"({best.label}, F={best.sharding_factor}{counted}); {_remedies(inputs, best)}; {verdict}"
            ),
        )
    f = min(p.sharding_factor for p in fitting)
    at_f = sorted((p for p in fitting if p.sharding_factor == f), key=lambda p: (p.time.expected_s, p.memory.peak))
    best, margin = _public_unless_clearly_faster(inputs, at_f)
    smaller = [p for p in plans if p.sharding_factor < f]
    why = (
        f"F={f} is the smallest sharding factor whose peak fits in {_budget_text(inputs)}: "
        f"{best.label} peaks at {fmt_bytes(best.memory.peak)}"
    )
    if smaller:
        worst = min(smaller, key=lambda p: p.memory.peak)
        why += f"; F={worst.sharding_factor} would need {fmt_bytes(worst.memory.peak)}"
    if margin:
        why += margin
    elif len(at_f) > 1:
        why += (
            f"; {best.label} is estimated faster than {at_f[1].label} "
            f"({fmt_seconds(best.time.expected_s)} vs {fmt_seconds(at_f[1].time.expected_s)} per step)"
        )
    elif len([p for p in plans if p.sharding_factor == f]) > 2:  # "+OptR" plans too
        why += "; the other plans at this F do not fit"
    elif len([p for p in plans if p.sharding_factor == f]) > 1:
        why += "; the other strategy at this F does not fit"
    if inputs.optimizer_across_replicas:
        why += _across_replicas_why(inputs, best, [p for p in plans if p.sharding_factor == f])
    if activations_missing(inputs):
        why += "; activations are not counted (the peaks leave them out)"
    return Recommendation(best.strategy, f, why, best.optimizer_across_replicas)


def _public_unless_clearly_faster(inputs: PlanInputs, at_f: list[StrategyPlan]) -> tuple[StrategyPlan, str]:
    """The plan to recommend among ``at_f`` (the plans that fit at the chosen F, fastest first) and, when
    the fastest is a private strategy, why it is or is not the one ([Note: planner private strategy margin])."""
    fastest = at_f[0]
    public = [p for p in at_f if not p.strategy.value.startswith("_")]
    if not fastest.strategy.value.startswith("_") or not public:
        return fastest, ""
    other = public[0]
    shorter = 1 - fastest.time.expected_s / other.time.expected_s if other.time.expected_s > 0 else 0.0
    times = f"{fmt_seconds(fastest.time.expected_s)} vs {fmt_seconds(other.time.expected_s)} per step"
    error = (
        f"the planner's step error of {STEP_ERROR:.0%} (each step prediction is judged within {STEP_ERROR:.0%} "
        'of the measured step: docs/planner.md, "Checked against a cluster")'
    )
    if compute_known(inputs) and shorter > STEP_ERROR:
        return fastest, (
            f"; {fastest.label} (private) is predicted {shorter:.1%} faster than {other.label} ({times}), "
            f"more than {error}"
        )
    basis = "" if compute_known(inputs) else ", communication only: compute not known"
    peak = fastest.memory.peak
    return other, (
        f"; {other.label}, the public strategy: {fastest.label} (private, peak {fmt_bytes(peak)}, "
        f"{peak / inputs.budget_bytes:.0%} of the budget) is predicted {shorter:.1%} faster ({times}{basis}), "
        f"within {error}"
    )


def _across_replicas_why(inputs: PlanInputs, best: StrategyPlan, at_f: list[StrategyPlan]) -> str:
    """Why the recommendation is, or is not, a "+OptR" plan (the optimizer state across replicas)."""
    w, f = inputs.world_size, best.sharding_factor
    if best.optimizer_across_replicas:
        plain = next(p for p in at_f if p.strategy is best.strategy and not p.optimizer_across_replicas)
        out = (
            f"; +OptR is shard_optimizer_across_replicas=True: gradients and optimizer state split over all {w} "
            f"ranks, not {f}, so it holds {fmt_bytes(plain.memory.steady - best.memory.steady)} less per rank "
            f"between steps than {plain.label}"
        )
        if not plain.fits:
            return out + f", which peaks at {fmt_bytes(plain.memory.peak)} and does not fit"
        return out + f" (estimated {fmt_seconds(plain.time.expected_s)} per step)"
    others = [p for p in at_f if p.optimizer_across_replicas]
    if not others:
        return f"; no +OptR plan at F={f} (the optimizer state across replicas needs a hybrid, 1 < F < {w})"
    o = min(others, key=lambda p: (p.time.expected_s, p.memory.peak))
    verdict = "fits" if o.fits else "does not fit"
    return (
        f"; {o.label} {verdict}, estimated {fmt_seconds(o.time.expected_s)} per step, peak {fmt_bytes(o.memory.peak)}"
    )


def choose_sharding_factor(
    inputs: PlanInputs, *, reshard_after_forward: bool = True, by_time: bool = False
) -> tuple[int, str]:
    """The sharding factor for ``sharding_factor="auto"``, among the F dividing W whose peak fits
    ``inputs.device_memory_bytes`` less ``headroom``, for the FULL_SHARD family
    (``reshard_after_forward=True``: NO_SHARD, HYBRID_SHARD, FULL_SHARD) or the SHARD_GRAD_OP
    family (False: NO_SHARD, _HYBRID_SHARD_ZERO2, SHARD_GRAD_OP). With ``by_time`` (the caller gave
    link figures: ``inputs.links``, ``gpus_per_node``, ``exchange``) the one with the smallest expected
    step time ([Note: planner step schedule]), the smaller F on a tie; without, the smallest F (the
    paper's R4), time not considered. Returns (F, why). When no F fits it returns (W, why) with
    ``why`` starting "nothing fits": F = W needs the least memory, and the caller decides whether to
    go on. With ``inputs.optimizer_across_replicas`` only the hybrids' factors 1 < F < W are candidates
    (the "+OptR" plans; the engine splits the optimizer state over replicas nowhere else), and a W with
    no such F is a PlanError."""
    w = inputs.world_size
    factors = inputs.factors()
    if inputs.optimizer_across_replicas:
        factors = tuple(f for f in factors if 1 < f < w)
        if not factors:
            raise PlanError(
                f"optimizer_across_replicas needs 1 < F < W; W={w} has no such F",
                "turn optimizer_across_replicas (shard_optimizer_across_replicas) off, or use a world size with "
                "a divisor between 1 and W (e.g. 2 nodes of 2 ranks)",
            )
    family = []
    for f in factors:
        s = [x for x in strategies_at(w, f) if f == 1 or x.reshard_after_forward == reshard_after_forward][0]
        family.append(plan_strategy(inputs, s, f))
    fitting = [p for p in family if p.fits]
    if not fitting:
        last = family[-1]
        return last.sharding_factor, (
            f"nothing fits in {_budget_text(inputs)}: even F={last.sharding_factor} peaks at "
            f"{fmt_bytes(last.memory.peak)}"
        )
    if not by_time:
        p = fitting[0]
        return p.sharding_factor, (
            f"F={p.sharding_factor} ({p.label}) is the smallest sharding factor whose peak "
            f"{fmt_bytes(p.memory.peak)} fits in {_budget_text(inputs)}; step time not considered (no link figures)"
        )
    best = min(fitting, key=lambda p: (p.time.expected_s, p.sharding_factor))
    others = ", ".join(
        f"F={p.sharding_factor} {p.label} {fmt_seconds(p.time.expected_s)}" for p in fitting if p is not best
    )
    why = f"F={best.sharding_factor} ({best.label}): predicted {fmt_seconds(best.time.expected_s)} per step"
    why += f", the fastest of those that fit ({others})" if others else ", the only one that fits"
    why += f"; its peak {fmt_bytes(best.memory.peak)} fits in {_budget_text(inputs)}"
    too_big = [p for p in family if not p.fits]
    if too_big:
        why += "; " + ", ".join(f"F={p.sharding_factor} peaks at {fmt_bytes(p.memory.peak)}" for p in too_big)
    return best.sharding_factor, why + _time_basis(inputs)


def _time_basis(inputs: PlanInputs) -> str:
    """What the predicted step times rest on, said after a choice by time."""
    links = inputs.links
    node = links.node_bandwidth(inputs.ranks_per_node)
    out = (
        f"; predicted for links of {fmt_bytes(links.inter_bandwidth)}/s per rank and {fmt_bytes(node)}/s per node "
        f"between nodes of {inputs.ranks_per_node} ranks, {fmt_bytes(links.intra_bandwidth)}/s within, "
        f"{inputs.exchange} all-gathers and reduce-scatters"
    )
    if not compute_known(inputs):
        out += "; compute not known: the times are communication"
        out += " and the optimizer step only" if inputs.optimizer_time_s else " only"
    return out
