"""Link figures from a measured calibration: what ``make cluster`` (bench/cluster/calibrate.py) writes.

A calibration holds, per link class, a latency (a 4-byte message) and a bandwidth (the slope between
1 MiB and 8 MiB), every rank communicating at once: "intra" (the ranks of a node in pairs), "inter"
(every rank of one node sending to another node at once: a rank's share of the node's link) and
"inter, one flow" (one rank sending alone: what one rank gets by itself). ``Links`` takes them as:
    intra_bandwidth, intra_latency_s  <- "intra"
    inter_bandwidth                   <- "inter, one flow" (or "inter" when it was not measured)
    inter_node_bandwidth              <- "inter" x ranks per node (every rank at once, summed)
    inter_latency_s                   <- "inter"
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from flatshard.planner.errors import PlanError
from flatshard.planner.inputs import Links


def find_calibration(doc: dict[str, Any]) -> tuple[dict[str, Any], int | None]:
    """(the calibration, the ranks per node it was measured with, if the document says) from a
    ``make cluster`` report (bench/results/cluster_<rate>.json), its "result", or a calibration."""
    if "result" in doc:
        doc = doc["result"]
    if "calibration" in doc:
        return doc["calibration"], doc.get("nproc")
    return doc, doc.get("ranks_per_node")


def links_from_calibration(doc: dict[str, Any], ranks_per_node: int | None = None) -> tuple[Links, int]:
    """``Links`` from a calibration (or a ``make cluster`` report holding one) and the ranks per node
    used for the node's link: the document's own when it records one, else ``ranks_per_node``."""
    calibration, recorded = find_calibration(doc)
    links = calibration.get("links") if isinstance(calibration, dict) else None
    if not isinstance(links, dict) or "inter" not in links:
        raise PlanError(
            "the calibration has no measured links (no links.inter)",
            "pass a bench/results/cluster_<rate>.json written by `make cluster`, or its result.calibration",
        )
    g = recorded or ranks_per_node
    if not g:
        raise PlanError("the calibration does not say how many ranks share a node", "pass --gpus-per-node")
    try:
        inter: dict[str, Any] = links["inter"]  # one link class: its latency_s and bandwidth_Bps
        intra = links.get("intra", inter)  # one rank per node: no intra-node class was measured
        alone = links.get("inter, one flow", inter)
        return (
            Links(
                intra_bandwidth=float(intra["bandwidth_Bps"]),
                inter_bandwidth=float(alone["bandwidth_Bps"]),
                intra_latency_s=float(intra["latency_s"]),
                inter_latency_s=float(inter["latency_s"]),
                inter_node_bandwidth=float(inter["bandwidth_Bps"]) * g,
            ),
            int(g),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise PlanError(
            f"the calibration's links are not as make cluster writes them ({exc!r})",
            "each link class needs latency_s and bandwidth_Bps",
        ) from exc


def read_calibration(path: str | Path, ranks_per_node: int | None = None) -> tuple[Links, int]:
    """``links_from_calibration`` of a JSON file."""
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise PlanError(
            f"cannot read the calibration {path}: {exc}", "pass a JSON file written by make cluster"
        ) from exc
    if not isinstance(doc, dict):
        raise PlanError(f"{path} holds no JSON object", "pass a JSON file written by make cluster")
    return links_from_calibration(doc, ranks_per_node)
