"""examples/train_gpt.py end to end: launched as users launch it (one command, 2 local processes through
torchrun's machinery), checked through its --json figures.

A tiny GPT with odd widths (dim 33, so the units' element counts do not divide by 2 and padding is
exercised) trains for a few steps. The figures must show: a finite, falling loss; per-rank steady bytes
equal to the per-unit formula (flat shard + grad shard of S_u fp32 elements, AdamW's two moments per
owned element and one fp32 step per parameter) and within padding of 16·P/F; and bytes sent per step
equal to the strategy's formula, collective by collective. The formulas are recomputed here from the
layout figures, not read back from the script.
"""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from tests.dist import run_launcher

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
TIMEOUT_S = 150  # one run takes ~12 s on two cores; a hang must fail, not wait
B = 4  # bytes per fp32 element
WORLD = 2


def run_example(tmp_path: Path, strategy: str) -> dict:
    out = tmp_path / "out.json"
    cmd = [
        sys.executable,
        str(SCRIPT),
        "--nproc",
        str(WORLD),
        "--strategy",
        strategy,
        "--model",
        "tiny",
        "--dim",
        "33",
        "--heads",
        "3",
        "--steps",
        "20",
        "--batch-size",
        "8",
        "--log-interval",
        "5",
        "--eval-batches",
        "2",
        "--sample-tokens",
        "8",
        "--quiet",
        "--json",
        str(out),
    ]
    log = run_launcher(cmd, ROOT, TIMEOUT_S, "train_gpt.py")
    assert out.exists(), f"no JSON written:\n{log[-4000:]}"
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_train_gpt_figures(tmp_path, strategy):
    fig = run_example(tmp_path, strategy)
    assert fig["world"] == WORLD and fig["strategy"] == strategy and fig["steps"] == 20

    # loss: finite, starts near ln(256) (uniform over bytes), falls
    losses = [loss for _, loss in fig["losses"]]
    assert [s for s, _ in fig["losses"]] == [0, 5, 10, 15, 19]
    assert all(math.isfinite(x) for x in losses) and math.isfinite(fig["val_loss"])
    assert abs(losses[0] - math.log(256)) < 0.5, losses
    assert losses[-1] < losses[0] - 0.5, losses
    assert isinstance(fig["sample"], str) and fig["sample"].startswith("def ")

    P, padded, M = fig["P"], fig["P_padded"], fig["units"]
    F = 1 if strategy == "NO_SHARD" else WORLD  # sharding factor
    S = fig["unit_shard_numel"]
    assert len(S) == M and sum(S) * F == padded
    if F > 1:
        assert padded > P, "dim 33 is meant to exercise padding"

    # memory per rank after a step: exactly the per-unit formula, and 16·P/F up to padding and step counters
    mem, n_state = fig["memory"], fig["n_state_params"]
    assert mem["ideal_bytes"] == 16 * P / F
    assert sum(mem["local_numel"]) == P * WORLD // F  # each element owned once per replica
    for r in range(WORLD):
        held = mem["per_rank"][r]
        assert held["params"] == held["grads"] == B * sum(S), (r, held)
        assert held["gathered"] == 0, (r, held)  # every unit resharded after the step
        expected = 2 * B * sum(S) + 2 * B * mem["local_numel"][r] + B * n_state
        assert held["params"] + held["grads"] + held["optimizer"] == mem["steady_bytes"][r] == expected, (
            r,
            held,
            expected,
        )
        assert mem["formula_bytes"][r] == expected  # what the table prints beside it
        assert abs(expected - 16 * P / F) <= 2 * B * (padded - P) + B * n_state
        assert mem["peak_bytes"][r] >= expected

    # bytes sent per rank per step, collective by collective, against the formulas
    ring = (WORLD - 1) / WORLD
    root = fig["root_padded"]
    if strategy == "FULL_SHARD":
        want = {
            "forward/all_gather/shard": (padded * B * ring, M),
            "backward/all_gather/shard": ((padded - root) * B * ring, M - 1),  # the root stays gathered
            "backward/reduce_scatter/shard": (padded * B * ring, M),
            "optimizer/all_reduce/shard": (2 * B * ring, 1),
        }  # clip_grad_norm_: one fp32 scalar
        headline = 3 * padded * B * ring - root * B * ring
    else:
        want = {"backward/all_reduce/replicate": (2 * P * B * ring, M)}
        headline = 2 * P * B * ring
    assert set(fig["comm_per_step"]) == set(want), fig["comm_per_step"]
    for key, (nbytes, calls) in want.items():
        assert fig["comm_per_step"][key] == pytest.approx(nbytes, rel=1e-12), key
        assert fig["comm_count_per_step"][key] == calls, key
        assert fig["comm_formula"][key] == pytest.approx(nbytes, rel=1e-12), key
    assert fig["comm_fsdp_per_step"] == pytest.approx(headline, rel=1e-12)
    assert fig["comm_fsdp_formula"] == pytest.approx(headline, rel=1e-12)
