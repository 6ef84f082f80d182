"""The planner's step times from a calibration, beside the measured ones: the table and the JSON of
``make cluster``. Every prediction comes from ``flatshard.planner``'s public API (``PlanInputs``,
``Links``, ``plan_strategy``); nothing here adjusts the planner's figures.

[Note: cluster predictions]
The planner is given what the calibration measured and nothing else: ``Links`` (per-rank bandwidth and
latency within a node and between nodes, [Note: cluster calibration] in cluster_calibrate.py), the
forward + backward time of one rank as ``compute_time_s``, the model's units (``PlanInputs.from_module``
on the GPT, one unit per Block, the rest in the root), fp32, AdamW, and the topology (W = N·P,
``gpus_per_node`` = P). Its prediction for a flatshard system is ``plan_strategy(...).time.expected_s``
for that strategy and F; for the run with no communication it is the same inputs at W = 1. DDP and
FSDP2 are not what the planner models (flatshard's schedule); their rows show the planner's figure for
the strategy they share, for reference, and take no part in the verdicts. The verdicts: every flatshard
prediction within 25% of the measured step, and the planner's order of flatshard's strategies equal to
the measured order.
"""

from __future__ import annotations

import math

import cluster_model
import compare

from flatshard.planner import Links, PlanInputs, plan_strategy

TOLERANCE = 0.25
TIE = 0.05  # two systems measured closer than this are a tie: run to run, medians move about that much


def planned_as(name: str, world: int, nproc: int) -> tuple[str, int] | None:
    """The planner's (strategy, F) for a system of the worker, or None (no communication)."""
    if "HYBRID" in name or "HSDP" in name:
        return "HYBRID_SHARD", nproc
    for strategy, f in (("FULL_SHARD", world), ("SHARD_GRAD_OP", world), ("NO_SHARD", 1)):
        if strategy in name:
            return strategy, f
    if name == "DDP":
        return "NO_SHARD", 1
    return None


def links_from(calibration: dict) -> Links:
    links = calibration["links"]
    intra = links.get("intra", links["inter"])  # one rank per node: no intra-node class
    return Links(
        intra_bandwidth=intra["bandwidth_Bps"],
        inter_bandwidth=links["inter"]["bandwidth_Bps"],
        intra_latency_s=intra["latency_s"],
        inter_latency_s=links["inter"]["latency_s"],
    )


def planner_inputs(result: dict, world: int | None = None) -> PlanInputs:
    """The planner's inputs for the measured job (or the same model and compute at ``world`` ranks)."""
    gpt = compare.load_gpt_module()
    cfg = compare.sizes()[result["size"]]
    w = world or result["nodes"] * result["nproc"]
    return PlanInputs.from_module(
        gpt.GPT(cfg),
        [gpt.Block],
        world_size=w,
        gpus_per_node=min(result["nproc"], w),
        precision="fp32",
        optimizer="adam",
        micro_batch=result["batch_size"],
        seq_len=result["block_size"],
        compute_time_s=result["calibration"]["compute"]["forward_backward_s"],
        links=links_from(result["calibration"]),
    )


def predict(result: dict) -> dict:
    """Per system: measured median step, the planner's prediction, their ratio, and the bytes."""
    world, nproc = result["nodes"] * result["nproc"], result["nproc"]
    inputs, alone = planner_inputs(result), planner_inputs(result, world=1)
    rows = {}
    for name, fig in result["systems"].items():
        measured = fig["step_s_median"]
        plan = None
        how = planned_as(name, world, nproc)
        if how is None:
            plan = plan_strategy(alone, "NO_SHARD", 1)
        else:
            plan = plan_strategy(inputs, *how)
        predicted = plan.time.expected_s
        proposed = _proposed(result, inputs, how)
        rows[name] = {
            "planned_as": list(how) if how else ["NO_SHARD", 1, "W=1"],
            "modelled": name.startswith("flatshard") or how is None,
            "measured_s": measured,
            "predicted_s": predicted,
            "predicted_serial_s": plan.time.serial_s,
            "predicted_overlapped_s": plan.time.overlapped_s,
            "predicted_comm_s": plan.time.comm_s,
            "error": predicted / measured - 1,
            "proposed_s": proposed["step_s"],
            "proposed_error": proposed["step_s"] / measured - 1,
            "proposed_node_crossing_bytes": proposed["node_crossing_bytes"],
            "ratio_to_compute": measured / result["systems"]["no communication"]["step_s_median"]
            if "no communication" in result["systems"]
            else None,
            "planner_inter_node_bytes_per_rank": plan.comm.inter_node,
            "planner_intra_node_bytes_per_rank": plan.comm.intra_node,
            "link_tx_bytes_per_step_per_node": result["link_tx_bytes_per_step_per_node"].get(name),
        }
    return {
        "rows": rows,
        "verdicts": verdicts(rows),
        "collectives": collective_predictions(result),
        "planner_inputs": _inputs_summary(inputs),
    }


def _proposed(result: dict, inputs: PlanInputs, how: tuple[str, int] | None) -> dict:
    """The step by bench/cluster_model.py's model ([Note: cluster link model]), for comparison only."""
    comp = result["calibration"]["compute"]
    link = cluster_model.link_model(result["calibration"], result["nproc"])
    strategy, f = how or ("NO_SHARD", 1)
    world = inputs.world_size if how else 1
    return cluster_model.step_time(
        link,
        strategy,
        world,
        f,
        inputs.root_elements,
        inputs.unit_elements,
        comp["forward_backward_s"],
        comp["optimizer_step_s"],
    )


def collective_predictions(result: dict) -> dict:
    """Per collective of the calibration: measured seconds and the planner's for one root-less unit of
    the same size (``CommEstimate`` of a one-unit model: the first forward all-gather, the backward's
    reduce-scatter, the all-reduces), with the planner's link class for its group."""
    cal = result["calibration"]["collectives"]
    world, nproc = result["nodes"] * result["nproc"], result["nproc"]
    one = PlanInputs(
        world_size=world,
        unit_elements=(cal["unit_numel"],),
        gpus_per_node=nproc,
        precision="fp32",
        links=links_from(result["calibration"]),
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
    modelled = {n: r for n, r in rows.items() if r["modelled"]}
    flat = [n for n in modelled if n.startswith("flatshard")]
    measured_order = sorted(flat, key=lambda n: rows[n]["measured_s"])
    out = {"measured_order": measured_order}
    for key, label in (("predicted_s", "planner"), ("proposed_s", "proposed")):
        within = {n: abs(r[key] / r["measured_s"] - 1) <= TOLERANCE for n, r in modelled.items()}
        order = sorted(flat, key=lambda n: rows[n][key])
        out[label] = {
            "within_25_percent": within,
            "all_within": all(within.values()),
            "order": order,
            "same_order": order == measured_order,
            "misordered_pairs": _misordered(rows, flat, key),
        }
        out[label]["same_order_but_ties"] = all(m["measured_gap"] <= TIE for m in out[label]["misordered_pairs"])
    return out


def _misordered(rows: dict, names: list[str], key: str) -> list[dict]:
    """Pairs the model orders the other way from the measurement, with how far apart they measured."""
    out = []
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            ma, mb, pa, pb = rows[a]["measured_s"], rows[b]["measured_s"], rows[a][key], rows[b][key]
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
        "intra_bandwidth_Bps": links.intra_bandwidth,
        "inter_bandwidth_Bps": links.inter_bandwidth,
        "intra_latency_s": links.intra_latency_s,
        "inter_latency_s": links.inter_latency_s,
        "prefetch_depth": inputs.prefetch_depth,
    }


# ---- printing ------------------------------------------------------------------------------------------
def _mb(x) -> str:
    return "" if x is None else f"{x / 1e6:,.1f}"


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
    for name, row in pred["collectives"].items():
        k.add_row(
            name,
            f"{row['measured_s'] * 1e3:,.1f}",
            f"{row['predicted_s'] * 1e3:,.1f}",
            f"{row['predicted_s'] / row['measured_s']:.2f}",
            row["planner_link"],
        )
    console.print(k)
    t = Table(title="median step of the slowest rank, measured (interleaved) and predicted (flatshard.planner)")
    for col in (
        "system",
        "measured ms",
        "/ compute",
        "planner ms",
        "/ measured",
        "proposed ms",
        "/ measured",
        "link MB/node",
        "proposed MB/node",
        "planner MB/rank",
    ):
        t.add_column(col, justify="right")
    for name, row in pred["rows"].items():
        ratio, ratio2 = row["predicted_s"] / row["measured_s"], row["proposed_s"] / row["measured_s"]
        mark = "" if not row["modelled"] else (" ok" if abs(ratio - 1) <= TOLERANCE else " OFF")
        mark2 = "" if not row["modelled"] else (" ok" if abs(ratio2 - 1) <= TOLERANCE else " OFF")
        how, link = row["planned_as"], row["link_tx_bytes_per_step_per_node"]
        t.add_row(
            name,
            f"{row['measured_s'] * 1e3:,.0f}",
            "" if row["ratio_to_compute"] is None else f"{row['ratio_to_compute']:.2f}",
            f"{row['predicted_s'] * 1e3:,.0f}" + ("" if row["modelled"] else f" ({how[0]})"),
            f"{ratio:.2f}{mark}",
            f"{row['proposed_s'] * 1e3:,.0f}",
            f"{ratio2:.2f}{mark2}",
            _mb(None if link is None else max(link)),
            _mb(row["proposed_node_crossing_bytes"]),
            _mb(row["planner_inter_node_bytes_per_rank"]),
        )
    console.print(t)
    console.print(
        "planner: plan_strategy(...).time.expected_s. proposed: bench/cluster_model.py ([Note: cluster link model]), "
        "not the planner. DDP and FSDP2 are not what the planner models: their figures are their strategy's, for "
        "reference. link MB/node: bytes the node's link interface sent per step (kernel counter); proposed MB/node: "
        "the bytes the proposed model says cross; planner MB/rank: the planner's inter-node bytes per rank"
    )
    v = pred["verdicts"]
    console.print(f"measured order: {' < '.join(v['measured_order'])}")
    for label in ("planner", "proposed"):
        w = v[label]
        gaps = ", ".join(
            f"{' / '.join(m['pair'])} ({m['measured_gap']:.0%} apart measured)" for m in w["misordered_pairs"]
        )
        if w["same_order"]:
            order = "same"
        else:
            order = ("same but for a tie: " if w["same_order_but_ties"] else "DIFFERENT: ") + gaps
        console.print(
            f"{label}: within 25% {sum(w['within_25_percent'].values())}/{len(w['within_25_percent'])}; order {order}"
        )
    agree = report["losses_agree"]
    bad = [n for n, a in agree.items() if not a["agree"]]
    worst = max((a["max_rel_diff"] for a in agree.values()), default=math.nan)
    console.print(
        f"losses: every system but 'no communication' equals flatshard FULL_SHARD's within 1e-4 "
        f"(worst {worst:.1e})" + (f"; DIFFERENT: {', '.join(bad)}" if bad else "")
    )
