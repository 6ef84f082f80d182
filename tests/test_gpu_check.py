"""bench/gpu/check.sh --cpu, the GPU check's dry run: launched as on the GPU machine (torchrun, here 2 gloo
ranks), it passes every check that runs on CPU and reports the CUDA-only ones as not run, never passed."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.helpers.dist import run_launcher

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 120  # ~20 s on two cores; a hang must fail, not wait


@pytest.mark.slow
def test_gpu_check_dry_run(tmp_path, monkeypatch):
    out = tmp_path / "gpu_check.json"
    monkeypatch.setenv("PYTHON", sys.executable)  # the script runs on this interpreter's torch
    # the compiled comparison compiles three systems (about a minute cold): tests/test_compile.py covers it
    cmd = ["bash", "bench/gpu/check.sh", "--cpu", "--steps", "2", "--sizes-mib", "1,4", "--json", str(out)]
    cmd += ["--skip", "fronts_compiled"]
    log = run_launcher(cmd, ROOT, TIMEOUT_S, "bench/gpu/check.sh --cpu")
    report = json.loads(out.read_text())
    status = {c["name"]: c["status"] for c in report["checks"]}
    assert status == {
        "parity_fp32": "PASS",
        "parity_bf16": "PASS",
        "offload_error": "PASS",
        "all_gather_bw": "PASS",
        "cpu_offload": "NOT RUN",
        "cpu_offload_state_dict": "NOT RUN",
        "fronts_eager": "PASS",
        "fronts_compiled": "NOT RUN",
        "overlap": "NOT RUN",
    }, log[-4000:]
    assert report["passed"] and report["mode"] == "cpu" and report["environment"]["world_size"] == 2
    why = {c["name"]: c["summary"] for c in report["checks"] if c["status"] == "NOT RUN"}
    assert why == {
        "cpu_offload": "needs CUDA",
        "cpu_offload_state_dict": "needs CUDA",
        "fronts_compiled": "skipped (--skip)",
        "overlap": "needs CUDA and at least 2 GPUs",
    }, why
    fronts = next(c for c in report["checks"] if c["name"] == "fronts_eager")["figures"]
    assert all(fronts[n]["max_rel_loss_diff_to_fsdp2"] <= 1e-4 for n in ("flatshard", "flatshard fully_shard"))
    bw = next(c for c in report["checks"] if c["name"] == "all_gather_bw")["figures"]
    assert [r["mib"] for r in bw["sizes"]] == [1, 4] and all(r["correct"] and r["busbw_GBps"] > 0 for r in bw["sizes"])
    assert "NOT RUN cpu_offload: needs CUDA" in log and "PASS    parity_fp32" in log
