"""The planner's step times from a calibration, beside the measured ones: the table and the JSON of
``make cluster``, and the same recomputed offline from the committed results.

    python -m bench.cluster.predict          # the committed runs (bench/results/cluster_*.json and
                                             # slow_link_*.json) predicted again by today's planner; no root

Every prediction comes from ``flatshard.planner``'s public API (``PlanInputs``, ``Links``,
``plan_strategy``, ``links_from_calibration``); nothing here adjusts the planner's figures.

[Note: cluster predictions]
The planner is given what the calibration measured and nothing else: the links (``links_from_calibration``:
within a node from the pairs, one rank's rate across from the single flow, the node's link from every rank
sending at once), the forward + backward time of one rank as ``compute_time_s`` and its AdamW step as
``optimizer_time_s``, the model's units (``PlanInputs.from_module`` on the GPT, one unit per Block, the rest
in the root), fp32, AdamW, the topology (W = N·P, ``gpus_per_node`` = P), ``exchange="direct"`` (flatshard
on gloo) and the engine's ``inter_node_in_flight`` as the system ran it (off for a system named "..., in
flight off" and for runs of an engine older than the setting). Its prediction for a flatshard system is
``plan_strategy(...).time.expected_s`` for that strategy and F (for "..., optimizer across replicas",
``shard_optimizer_across_replicas=True``, the same with ``optimizer_across_replicas=True``: the "+OptR"
plan); for the run with no communication it is the same inputs at W = 1. DDP, FSDP2 and int8 compression are
not what the planner models; their rows show the planner's figure for the strategy they share, for
reference, and take no part in the verdicts. The verdicts: every flatshard prediction within 25% of the
measured step, and the planner's order of flatshard's systems equal to the measured order, where two systems
measured within 5% of each other are a tie (run to run, medians move about that much).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench import compare
from flatshard.planner import STEP_ERROR, PlanInputs, links_from_calibration, plan_strategy

TOLERANCE = STEP_ERROR  # the planner's own: it recommends a private strategy only beyond it
TIE = 0.05
RESULTS = Path(__file__).resolve().parents[1] / "results"
RATES = ("1gbit", "200mbit")
# Runs of the engine before inter_node_in_flight (d1d9bb4), by the commit their JSON records: every
# reduction there finished before the next unit computed (the first committed cluster runs, 2d9a36d).
BEFORE_IN_FLIGHT = ("2d9a36d",)
PIECES = "optimizer across replicas"  # a system's suffix for shard_optimizer_across_replicas=True (worker.py)


def planned_as(name: str, world: int, nproc: int) -> tuple[str, int] | None:
    """The planner's (strategy, F) for a system of the worker, or None (no communication)."""
    if "ZERO2" in name:
        return "_HYBRID_SHARD_ZERO2", nproc
    if "HYBRID" in name or "HSDP" in name:
        return "HYBRID_SHARD", nproc
    for strategy, f in (("FULL_SHARD", world), ("SHARD_GRAD_OP", world), ("NO_SHARD", 1)):
        if strategy in name:
            return strategy, f
    if name == "DDP":
        return "NO_SHARD", 1
    return None


def modelled(name: str) -> bool:
    """flatshard's strategies as such (", in flight off" and ", optimizer across replicas" included) and the
    no-communication run; not other libraries' schedules, nor a variant the planner does not model (", int8")."""
    if name == "no communication":
        return True
    return name.startswith("flatshard") and name.split(", ")[1:] in ([], ["in flight off"], [PIECES])


def across_replicas(name: str) -> bool:
    """Whether a system ran with shard_optimizer_across_replicas=True (the planner's "+OptR" plans)."""
    return PIECES in name.split(", ")[1:]


def planner_inputs(
    result: dict, world: int | None = None, in_flight: bool = True, links_from=None, across: bool = False
) -> PlanInputs:
    """The planner's inputs for the measured job (or the same model and compute at ``world`` ranks).
    ``links_from``: another result whose calibration holds the links (a run measured without one);
    ``across``: the optimizer state across replicas (``optimizer_across_replicas``)."""
    gpt = compare.load_gpt_module()
    cfg = compare.sizes()[result["size"]]
    w = world or result["nodes"] * result["nproc"]
    links, _ = links_from_calibration(links_from or result, result["nproc"])
    compute = result["calibration"]["compute"]
    return PlanInputs.from_module(
        gpt.GPT(cfg),
        [gpt.Block],
        world_size=w,
        gpus_per_node=min(result["nproc"], w),
        precision="fp32",
        optimizer="adam",
        micro_batch=result["batch_size"],
        seq_len=result["block_size"],
        compute_time_s=compute["forward_backward_s"],
        optimizer_time_s=compute["optimizer_step_s"],
        links=links,
        exchange="direct",
        inter_node_in_flight=in_flight,
        optimizer_across_replicas=across,
    )


def predict(result: dict, in_flight: bool = True, links_from: dict | None = None) -> dict:
    """Per system: measured median step, the planner's prediction, their ratio, and the bytes across.
    ``in_flight``: whether the engine that ran had ``inter_node_in_flight`` (by default on)."""
    world, nproc = result["nodes"] * result["nproc"], result["nproc"]
    inputs = {
        (on, across): planner_inputs(result, in_flight=on, links_from=links_from, across=across)
        for on in (True, False)
        for across in (False, True)
    }
    alone = planner_inputs(result, world=1, links_from=links_from)
    floor = result["systems"].get("no communication", {}).get("step_s_median")
    rows = {}
    for name, fig in result["systems"].items():
        measured = fig["step_s_median"]
        how = planned_as(name, world, nproc)
        on, across = in_flight and "in flight off" not in name, across_replicas(name)
        plan = plan_strategy(alone, "NO_SHARD", 1) if how is None else plan_strategy(inputs[on, across], *how)
        rows[name] = {
            "planned_as": [*how, *([PIECES] if plan.optimizer_across_replicas else [])]
            if how
            else ["NO_SHARD", 1, "W=1"],
            "in_flight": on,
            "optimizer_across_replicas": plan.optimizer_across_replicas,
            "modelled": modelled(name),
            "measured_s": measured,
            "predicted_s": plan.time.expected_s,
            "predicted_serial_s": plan.time.serial_s,
            "predicted_comm_s": plan.time.comm_s,
            "error": plan.time.expected_s / measured - 1,
            "ratio_to_compute": measured / floor if floor else None,
            "planner_node_link_bytes": plan.comm.node_link,
            "planner_inter_node_bytes_per_rank": plan.comm.inter_node,
            "link_tx_bytes_per_step_per_node": result["link_tx_bytes_per_step_per_node"].get(name),
        }
    out = {"rows": rows, "verdicts": verdicts(rows), "planner_inputs": _inputs_summary(inputs[in_flight, False])}
    if "collectives" in result["calibration"]:
        out["collectives"] = collective_predictions(result, inputs[in_flight, False])
    return out


def collective_predictions(result: dict, inputs: PlanInputs) -> dict:
    """Per collective of the calibration: measured seconds and the planner's for one root-less unit of
    the same size (``CommEstimate`` of a one-unit model: the first forward all-gather, the backward's
    reduce-scatter, the all-reduces), with the planner's link class for its group."""
    cal = result["calibration"]["collectives"]
    world, nproc = result["nodes"] * result["nproc"], result["nproc"]
    one = inputs.replace(
        unit_elements=(cal["unit_numel"],), root_elements=0, unit_param_shapes=None, root_param_shapes=None
    )
    full, sgo, ddp = (
        plan_strategy(one, s, f).comm for s, f in (("FULL_SHARD", world), ("SHARD_GRAD_OP", world), ("NO_SHARD", 1))
    )
    planned = {
        "all_gather, F=W (spans nodes)": (full.first_forward_s, full.shard_link),
        "reduce_scatter, F=W (spans nodes)": (sgo.backward_s, sgo.shard_link),
        "all_reduce, W ranks (NO_SHARD)": (ddp.all_reduce_s, ddp.replicate_link),
    }
    if nproc > 1 and world > nproc:
        hyb = plan_strategy(one, "HYBRID_SHARD", nproc).comm
        zero2 = plan_strategy(one, "_HYBRID_SHARD_ZERO2", nproc).comm
        planned["all_gather, F=P (in node)"] = (hyb.first_forward_s, hyb.shard_link)
        planned["reduce_scatter, F=P (in node)"] = (zero2.backward_s - zero2.all_reduce_s, zero2.shard_link)
        planned["all_reduce, replicate R=N (T/P elements)"] = (hyb.all_reduce_s, hyb.replicate_link)
    return {
        name: {"measured_s": cal["seconds"][name], "predicted_s": t, "planner_link": link}
        for name, (t, link) in planned.items()
        if name in cal["seconds"]
    }


def verdicts(rows: dict) -> dict:
    judged = {n: r for n, r in rows.items() if r["modelled"]}
    flat = [n for n in judged if n.startswith("flatshard")]
    within = {n: abs(r["predicted_s"] / r["measured_s"] - 1) <= TOLERANCE for n, r in judged.items()}
    misordered = _misordered(rows, flat)
    return {
        "measured_order": sorted(flat, key=lambda n: rows[n]["measured_s"]),
        "predicted_order": sorted(flat, key=lambda n: rows[n]["predicted_s"]),
        "within_25_percent": within,
        "all_within": all(within.values()),
        "misordered_pairs": misordered,
        "same_order_but_ties": all(m["measured_gap"] <= TIE for m in misordered),
    }


def _misordered(rows: dict, names: list[str]) -> list[dict]:
    """Pairs the planner orders the other way from the measurement, with how far apart they measured."""
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ma, mb = rows[a]["measured_s"], rows[b]["measured_s"]
            pa, pb = rows[a]["predicted_s"], rows[b]["predicted_s"]
            if (ma - mb) * (pa - pb) < 0 or (pa == pb and ma != mb):
                out.append({"pair": [a, b], "measured_gap": abs(ma - mb) / min(ma, mb)})
    return out


def _inputs_summary(inputs: PlanInputs) -> dict:
    links = inputs.links
    return {
        "world_size": inputs.world_size,
        "gpus_per_node": inputs.gpus_per_node,
        "params": inputs.params,
        "units": len(inputs.unit_elements) + (1 if inputs.root_elements else 0),
        "compute_time_s": inputs.compute_time_s,
        "optimizer_time_s": inputs.optimizer_time_s,
        "intra_bandwidth_Bps": links.intra_bandwidth,
        "inter_bandwidth_Bps": links.inter_bandwidth,
        "inter_node_bandwidth_Bps": links.node_bandwidth(inputs.ranks_per_node),
        "intra_latency_s": links.intra_latency_s,
        "inter_latency_s": links.inter_latency_s,
        "exchange": inputs.exchange,
        "inter_node_in_flight": inputs.inter_node_in_flight,
        "prefetch_depth": inputs.prefetch_depth,
    }


# ---- the committed runs, offline ------------------------------------------------------------------------
def committed(rate: str, kind: str = "cluster") -> dict:
    """The planner's predictions for a committed result: ``kind`` "cluster" (its own calibration; a run
    of the engine before inter_node_in_flight predicted with it off) or "slow_link" (no link calibration
    of its own: the links of cluster_<rate>.json, its own compute and optimizer figures)."""
    name = f"{kind}_{rate}.json"
    report = json.loads((RESULTS / name).read_text())
    result = report["result"]
    before = str(report.get("commit") or "").startswith(BEFORE_IN_FLIGHT)
    links_from = None
    if kind != "cluster":
        links_from = json.loads((RESULTS / f"cluster_{rate}.json").read_text())["result"]
    return predict(result, in_flight=not before, links_from=links_from)


def table(prediction: dict) -> list[str]:
    """A Markdown table of one prediction: system, measured, predicted, ratio, bytes across per node."""
    out = [
        "| system | measured ms | predicted ms | predicted / measured | link MB/step/node (kernel) | planner MB/node |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in prediction["rows"].items():
        ratio = r["predicted_s"] / r["measured_s"]
        mark = ("" if abs(ratio - 1) <= TOLERANCE else " **off**") if r["modelled"] else " (not modelled)"
        kernel = r["link_tx_bytes_per_step_per_node"]
        out.append(
            f"| {name} | {r['measured_s'] * 1e3:,.0f} | {r['predicted_s'] * 1e3:,.0f} | {ratio:.2f}{mark} | "
            f"{'' if kernel is None else f'{max(kernel) / 1e6:,.1f}'} | {r['planner_node_link_bytes'] / 1e6:,.1f} |"
        )
    return out


def summary(prediction: dict) -> str:
    v = prediction["verdicts"]
    within = v["within_25_percent"]
    off = [n for n, ok in within.items() if not ok]
    gaps = ", ".join(f"{' / '.join(m['pair'])} ({m['measured_gap']:.0%} apart measured)" for m in v["misordered_pairs"])
    if not v["misordered_pairs"]:
        order = "the measured order"
    else:
        order = ("the measured order but for ties: " if v["same_order_but_ties"] else "a DIFFERENT order: ") + gaps
    return (
        f"within 25%: {sum(within.values())}/{len(within)}"
        + (f" (off: {', '.join(off)})" if off else "")
        + f"; {order}"
    )


def main() -> int:
    for kind in ("cluster", "slow_link"):
        for rate in RATES:
            prediction = committed(rate, kind)
            how = "own calibration" if kind == "cluster" else f"links of cluster_{rate}.json"
            print(f"\n{kind}_{rate}.json ({how})\n")
            print("\n".join(table(prediction)))
            print(f"\n{summary(prediction)}")
    return 0


# ---- printing (make cluster) ----------------------------------------------------------------------------
def print_report(report: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console() if Console().is_terminal else Console(width=200)
    r = report["result"]
    cal, pred = r["calibration"], report["prediction"]
    console.print(
        f"[bold]{report['rate']}[/bold] between nodes, {r['nodes']} nodes x {r['nproc']} ranks, GPT {r['size']} "
        f"({r['P'] / 1e6:.2f}M parameters), fp32, batch {r['batch_size']}x{r['block_size']} per rank; "
        f"load average {report['load_average_before'][0]:.2f} before, {report['load_average_after'][0]:.2f} after"
    )
    c = Table(title="calibration (every rank at once; per rank, per direction)")
    for col in ("link class", "latency", "bandwidth", "4 B", "1 MiB", "8 MiB"):
        c.add_column(col, justify="right")
    for name, fig in cal["links"].items():
        s = fig["seconds"]
        c.add_row(
            name,
            f"{fig['latency_s'] * 1e6:,.0f} us",
            f"{fig['bandwidth_Bps'] / 1e6:,.1f} MB/s",
            *(f"{s[k] * 1e3:,.2f} ms" for k in ("4B", "1MiB", "8MiB")),
        )
    console.print(c)
    comp = cal["compute"]
    flops = 6 * r["P"] * r["batch_size"] * r["block_size"] / comp["forward_backward_s"]
    console.print(
        f"compute, one rank (all ranks at once): forward+backward {comp['forward_backward_s'] * 1e3:,.1f} ms "
        f"({flops / 1e9:,.2f} GFLOP/s at 6·P·tokens), AdamW step {comp['optimizer_step_s'] * 1e3:,.1f} ms"
    )
    k = Table(
        title=f"one unit's collectives ({cal['collectives']['unit_numel'] / 1e6:.2f}M fp32 elements), all ranks at once"
    )
    for col in ("collective", "measured ms", "planner ms", "planner / measured", "planner's link"):
        k.add_column(col, justify="right")
    for name, row in pred.get("collectives", {}).items():
        k.add_row(
            name,
            f"{row['measured_s'] * 1e3:,.1f}",
            f"{row['predicted_s'] * 1e3:,.1f}",
            f"{row['predicted_s'] / row['measured_s']:.2f}",
            row["planner_link"],
        )
    console.print(k)
    t = Table(title="median step of the slowest rank, measured (interleaved) and predicted (flatshard.planner)")
    for col in ("system", "measured ms", "/ compute", "planner ms", "/ measured", "link MB/node", "planner MB/node"):
        t.add_column(col, justify="right")
    for name, row in pred["rows"].items():
        ratio = row["predicted_s"] / row["measured_s"]
        mark = "" if not row["modelled"] else (" ok" if abs(ratio - 1) <= TOLERANCE else " OFF")
        how, link = row["planned_as"], row["link_tx_bytes_per_step_per_node"]
        t.add_row(
            name,
            f"{row['measured_s'] * 1e3:,.0f}",
            "" if row["ratio_to_compute"] is None else f"{row['ratio_to_compute']:.2f}",
            f"{row['predicted_s'] * 1e3:,.0f}" + ("" if row["modelled"] else f" ({how[0]})"),
            f"{ratio:.2f}{mark}",
            "" if link is None else f"{max(link) / 1e6:,.1f}",
            f"{row['planner_node_link_bytes'] / 1e6:,.1f}",
        )
    console.print(t)
    console.print(
        "planner: plan_strategy(...).time.expected_s ([Note: cluster predictions]). DDP, FSDP2 and int8 are not what "
        "the planner models: their figures are their strategy's, for reference. link MB/node: bytes the node's link "
        "interface sent per step (kernel counter); planner MB/node: what the planner says crosses "
        "(CommEstimate.node_link)"
    )
    console.print(f"measured order: {' < '.join(pred['verdicts']['measured_order'])}")
    console.print(f"planner: {summary(pred)}")
    agree = report["losses_agree"]
    bad = [n for n, a in agree.items() if not a["agree"]]
    worst = max((a["max_rel_diff"] for a in agree.values()), default=float("nan"))
    console.print(
        f"losses: every system but 'no communication' equals flatshard FULL_SHARD's within 1e-4 "
        f"(worst {worst:.1e})" + (f"; DIFFERENT: {', '.join(bad)}" if bad else "")
    )


if __name__ == "__main__":
    sys.exit(main())
