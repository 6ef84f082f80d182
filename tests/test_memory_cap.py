"""Under a memory cap enforced by the kernel (one cgroup per process), flatshard trains a GPT whose full
training state (16·P bytes with AdamW) exceeds the cap, and the same model without flatshard is killed.

A scaled-down run of examples/big_model.py (W = 2, 16·P ≈ 1.05 × the cap, one step), so that it fits the
test budget; the example's default run (W = 4, 16·P = 2 × a 1.5 GiB cap) is the full proof, with its
figures in docs/big_models.md. Skipped only where memory cgroups cannot be created (no controller
mounted, or not root), with the reason."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "big_model.py"
GiB = 1 << 30


def _example():
    spec = importlib.util.spec_from_file_location("big_model", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # top level imports only the standard library
    return module


@pytest.mark.slow
def test_capped_run_trains_where_the_unsharded_model_is_killed(tmp_path):
    big = _example()
    reason = big.unavailable_reason()
    if reason:
        pytest.skip(f"memory cgroups unavailable: {reason}")
    cap = 1.3
    argv = [
        "--world",
        "2",
        "--cap",
        f"{cap}GiB",
        "--layers",
        "13",
        "--dim",
        "768",
        "--heads",
        "12",
        "--block-size",
        "8",
        "--steps",
        "1",
        "--allow-small",
        "--json",
        str(tmp_path / "fig.json"),
    ]
    run = subprocess.run([sys.executable, str(EXAMPLE), *argv], capture_output=True, text=True, timeout=240)
    assert (tmp_path / "fig.json").exists(), f"no figures; exit {run.returncode}\n{run.stdout}\n{run.stderr[-3000:]}"
    fig = json.loads((tmp_path / "fig.json").read_text())
    P, W, cap_bytes = fig["P"], fig["world"], fig["cap"]
    assert cap_bytes == int(cap * GiB) and W == 2
    assert 16 * P > cap_bytes, "one process cannot hold the training state"
    assert fig["exit_codes"] == [0, 0] and all(k <= 0 for k in fig["oom_kills"]), (
        fig["exit_codes"],
        fig["oom_kills"],
        run.stderr[-3000:],
    )
    assert len(fig["ranks"]) == W
    for r in fig["ranks"]:
        assert all(math.isfinite(v) for v in r["losses"]), r["losses"]
        assert 0 < fig["cgroup_peak"][r["rank"]] <= cap_bytes
        steady = r["peak"]["params"] + r["peak"]["optimizer"] + r["peak"]["grads"]
        assert abs(steady - 16 * P / W) < 0.02 * 16 * P / W, (steady, 16 * P / W)  # 16·P/W, plus padding
        assert r["peak"]["activations"] > 0 and r["peak"]["gathered"] > 0
    base = fig["baseline"]
    killed = base["exit_code"] in (-9, 137) or base["oom_kills"] > 0
    assert killed, f"the model without flatshard ran under the cap: {base}"
    assert [what for what, _ in base.get("reached", [])][-1:] != ["optimizer step"], base
    assert "killed by the kernel" in run.stdout and f"W = {W} ranks" in run.stdout, run.stdout
