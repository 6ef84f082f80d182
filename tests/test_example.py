"""examples/train_gpt.py end to end: launched as users launch it (one command, 2 local processes through
torchrun's machinery), checked through its --json figures, its log lines and its metrics file.

A tiny GPT with odd widths (dim 33, so the units' element counts do not divide by 2 and padding is
exercised) trains for a few steps. The figures must show: a finite, falling loss; per-rank steady bytes
equal to the per-unit formula (flat shard + grad shard of S_u fp32 elements, AdamW's two moments per
owned element and one fp32 step per parameter), within padding of 16·P/F, and equal to the planner's
figure for rank 0 (the fullest shard); and bytes sent per step equal to the strategy's formula, collective
by collective, measured and planned alike. The formulas are recomputed here from the layout figures, not
read back from the script. A second pair of runs, in bf16, checks what a log file shows (a plain line
per report when stdout is not a terminal), the metrics file, MFU known and unknown, checkpoints every N
steps with keep_last, and that --resume continues bitwise where the uninterrupted run went.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flatshard import checkpoint
from tests.helpers.dist import run_launcher
from tests.helpers.sockets import is_loopback, socket_table_or_skip
from tests.helpers.train_gpt import MASTER_ADDR, WORLD, figure_run

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "examples" / "train_gpt.py"
TIMEOUT_S = 150  # one run takes ~12 s on two cores; a hang must fail, not wait
B = 4  # bytes per fp32 element


PLANNED_KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["FULL_SHARD", "NO_SHARD"])
def test_train_gpt_figures(strategy):
    fig = figure_run(strategy).figures  # shared with the loopback test below, which checks its sockets
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
        if r == 0:  # the planner's figure (what the table prints beside it) is the fullest shard's, rank 0's
            assert mem["planned_steady_bytes"] == expected
        assert mem["planned_steady_per_rank"][r] == expected  # and every rank's, padding left out
        assert mem["steady_bytes"][r] <= mem["planned_steady_bytes"]
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
    # (the first step's order checks, kind "order_check", are collectives too, but move no parameters)
    moved = {k for k in fig["comm_per_step"] if k.split("/")[1] in PLANNED_KINDS}
    assert moved == set(want), fig["comm_per_step"]
    for key, (nbytes, calls) in want.items():
        assert fig["comm_per_step"][key] == pytest.approx(nbytes, rel=1e-12), key
        assert fig["comm_count_per_step"][key] == calls, key
        if not key.startswith("optimizer"):  # the planner plans parameter and gradient traffic, by phase
            assert fig["comm_planned_calls"][key.rpartition("/")[0]] == calls, key
    for kind in PLANNED_KINDS:  # the planner's bytes per collective kind, both phases together
        got = sum(v for k, (v, _) in want.items() if k.split("/")[1] == kind and not k.startswith("optimizer"))
        assert fig["comm_planned"][kind] == pytest.approx(got, rel=1e-12, abs=1e-9), kind
    assert fig["comm_fsdp_per_step"] == pytest.approx(headline, rel=1e-12)
    assert fig["comm_fsdp_planned"] == pytest.approx(headline, rel=1e-12)


# ---------------------------------------------------------------- a local launch listens on loopback only
# ([Note: loopback-only local launch] in examples/local_launch.py) The figure runs above are watched while
# they go: the socket table (/proc/net/tcp and tcp6) read every 50 ms, keeping every listening socket held
# by the launcher or a process it started (the rendezvous store, each rank's gloo listener). Every one must
# be on 127.0.0.1 (or ::1), never 0.0.0.0 or ::, whether MASTER_ADDR is unset or 127.0.0.1. Here, beside
# the figure tests, so that one worker of the suite launches them once (tests/helpers/train_gpt.py).
@pytest.mark.slow
@pytest.mark.parametrize("master_addr", [None, "127.0.0.1"])
def test_a_local_run_listens_on_loopback_only(master_addr):
    socket_table_or_skip()
    (strategy,) = [s for s, addr in MASTER_ADDR.items() if addr == master_addr]
    run = figure_run(strategy)
    seen = run.listeners
    exposed = sorted((a, p) for a, p, _ in seen if not is_loopback(a))
    assert not exposed, f"listening beyond loopback: {exposed}"
    # what was seen is the job's: the launcher's store and a gloo listener in each of the ranks
    holders = {pid for _, _, pid in seen}
    assert run.launcher in holders, f"no listener of the launcher seen (the rendezvous store): {sorted(seen)}"
    assert len(holders - {run.launcher}) == WORLD, f"expected a listener in each of {WORLD} ranks: {sorted(seen)}"


# ---------------------------------------------------------------- logs, metrics, checkpoints, resume
LINE = re.compile(
    r"^step +(\d+)/12  loss (\d+\.\d{4})  lr \S+  [\d.]+ ms/step  [\d,]+ tok/s  mem/rank [\d.]+ \S+ "
    r"\(peak [\d.]+ \S+\)  (MFU [\d.]+%|MFU unknown)$"
)
METRIC_KEYS = {"step", "elapsed_s", "loss", "lr", "step_ms", "tokens_per_s", "memory", "mfu", "comm_bytes_per_step"}


def run_logged(tmp_path: Path, name: str, *extra: str) -> tuple[str, dict, list[dict]]:
    """A 12-step bf16 run, reports every 2 steps, a checkpoint every 4 (2 kept), stdout not a terminal."""
    cmd = [
        sys.executable,
        str(SCRIPT),
        *("--nproc", str(WORLD), "--model", "tiny", "--dim", "33", "--heads", "3", "--precision", "bf16"),
        *("--steps", "12", "--batch-size", "4", "--log-interval", "2", "--eval-batches", "1", "--sample-tokens", "0"),
        *("--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "4", "--keep-last", "2"),
        *("--metrics", str(tmp_path / f"{name}.jsonl"), "--json", str(tmp_path / f"{name}.json"), *extra),
    ]
    log = run_launcher(cmd, ROOT, TIMEOUT_S, "train_gpt.py")
    fig = json.loads((tmp_path / f"{name}.json").read_text())
    metrics = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
    return log, fig, metrics


def _steps_kept(tmp_path: Path) -> list[str]:
    return sorted(p.name for p in (tmp_path / "ckpt").iterdir() if p.name.startswith("step-"))


@pytest.mark.slow
def test_log_lines_metrics_checkpoints_and_resume(tmp_path):
    log, fig, metrics = run_logged(tmp_path, "first", "--peak-tflops", "1")
    assert "\x1b[" not in log, "no terminal codes in a log file"
    lines = [LINE.match(line) for line in log.splitlines() if line.startswith("step ")]
    assert all(lines), [line for line in log.splitlines() if line.startswith("step ")]
    assert [int(m.group(1)) for m in lines] == [1, 3, 5, 7, 9, 11, 12]  # every 2 steps and the last
    assert [float(m.group(2)) for m in lines] == [round(loss, 4) for _, loss in fig["losses"]]
    assert all(m.group(3).startswith("MFU ") and m.group(3) != "MFU unknown" for m in lines)
    # the metrics file: one JSON object per report, the same figures
    assert [m["step"] for m in metrics] == [1, 3, 5, 7, 9, 11, 12] and all(set(m) == METRIC_KEYS for m in metrics)
    assert [m["loss"] for m in metrics] == [loss for _, loss in fig["losses"]]
    for m in metrics:
        assert len(m["memory"]["now"]) == WORLD and m["memory"]["device_peak"] is None  # CPU: no allocator peak
        assert all(0 < now <= peak for now, peak in zip(m["memory"]["now"], m["memory"]["peak"]))
        assert m["mfu"] > 0 and m["tokens_per_s"] > 0 and m["comm_bytes_per_step"] > 0
    assert fig["mfu"] > 0 and fig["precision"] == "bf16"
    # bf16 gathers and reductions: 2 bytes an element on the wire (the planner says the same)
    ring = (WORLD - 1) / WORLD
    padded = fig["P_padded"]
    assert fig["comm_per_step"]["forward/all_gather/shard"] == pytest.approx(padded * 2 * ring, rel=1e-12)
    assert fig["comm_planned"]["reduce_scatter"] == pytest.approx(padded * 2 * ring, rel=1e-12)
    # a checkpoint every 4 steps and at the end, the last 2 kept
    assert _steps_kept(tmp_path) == ["step-00000008", "step-00000012"]
    assert checkpoint.latest(tmp_path / "ckpt").endswith("step-00000012")

    # the run "died" after step 8's checkpoint: --resume continues from it, bitwise as the first run went
    shutil.rmtree(tmp_path / "ckpt" / "step-00000012")
    log, again, metrics = run_logged(tmp_path, "again", "--resume")
    assert f"resuming from {tmp_path / 'ckpt' / 'step-00000008'} at step 8" in log
    assert again["start_step"] == 8 and [s for s, _ in again["losses"]] == [8, 10, 11]
    first = dict(fig["losses"])
    assert [(s, first[s]) for s in (10, 11)] == [(s, loss) for s, loss in again["losses"] if s >= 10]
    assert "MFU unknown" in log and all(m["mfu"] is None for m in metrics) and again["mfu"] is None
    assert _steps_kept(tmp_path) == ["step-00000008", "step-00000012"]


# ---------------------------------------------------------------- the fully_shard front end
@pytest.mark.slow
def test_fully_shard_front_end_trains_as_the_wrapper_and_resumes_bitwise(tmp_path):
    """--front-end fully_shard: fully_shard on each block, then the root, on the FULL_SHARD figure run's GPT
    and arguments. Its losses agree with the wrapper's run within 1e-5 relative, every step reported; the
    bytes each rank holds after a step and sends per step are the planner's under fully_shard's chunks, rank
    by rank; and a run resumed from its step-10 checkpoint (flatshard.checkpoint on fully_shard's DTensors,
    written with --async-save while steps 11-20 ran) reports the later losses bitwise as the uninterrupted
    run did."""

    def run(name: str, *extra: str) -> tuple[str, dict]:
        cmd = [sys.executable, str(SCRIPT), "--nproc", str(WORLD), "--front-end", "fully_shard"]
        cmd += ["--model", "tiny", "--dim", "33", "--heads", "3", "--steps", "20", "--batch-size", "8"]
        cmd += ["--log-interval", "5", "--eval-batches", "2", "--sample-tokens", "8", "--quiet"]
        cmd += ["--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "10", "--json", str(tmp_path / name), *extra]
        log = run_launcher(cmd, ROOT, TIMEOUT_S, "train_gpt.py --front-end fully_shard")
        return log, json.loads((tmp_path / name).read_text())

    _, fig = run("first.json", "--async-save")
    wrapper = figure_run("FULL_SHARD").figures
    assert fig["front_end"] == "fully_shard" and wrapper["front_end"] == "wrapper"
    assert [s for s, _ in fig["losses"]] == [s for s, _ in wrapper["losses"]] == [0, 5, 10, 15, 19]
    assert [v for _, v in fig["losses"]] == pytest.approx([v for _, v in wrapper["losses"]], rel=1e-5)
    assert fig["val_loss"] == pytest.approx(wrapper["val_loss"], rel=1e-5)
    mem = fig["memory"]
    assert fig["shard_boundaries"] == "chunks" and mem["steady_bytes"] == mem["planned_steady_per_rank"], mem
    for kind in ("all_gather", "reduce_scatter"):
        measured = sum(v for k, v in fig["comm_per_step"].items() if k.split("/")[1] == kind)
        assert measured == pytest.approx(fig["comm_planned"][kind], rel=1e-12), (kind, fig["comm_per_step"])

    assert _steps_kept(tmp_path) == ["step-00000010", "step-00000020"]
    shutil.rmtree(tmp_path / "ckpt" / "step-00000020")
    log, again = run("again.json", "--resume")
    assert f"resuming from {tmp_path / 'ckpt' / 'step-00000010'} at step 10" in log, log[-2000:]
    first = dict(fig["losses"])
    assert [(s, first[s]) for s in (15, 19)] == [(s, v) for s, v in again["losses"] if s >= 15]


# ---------------------------------------------------------------- arguments, checked before any rank starts
def _example(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_help_shows_the_defaults(monkeypatch, capsys):
    example = _example(monkeypatch)
    with pytest.raises(SystemExit) as exc:
        example.parse_args(["--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for default in ("(default: 240)", "(default: FULL_SHARD)", "(default: cpu)", "(default: fp32)", "(default: 3)"):
        assert default in out, default


def _bad_arguments(tmp_path: Path) -> list[tuple[list[str], str]]:
    import torch

    cases = [
        (["--nproc", "0"], "--nproc must be at least 1"),
        (["--dim", "33", "--heads", "2"], "must be a multiple of the number of heads"),
        (["--save-every", "5"], "need --ckpt-dir"),
        (["--resume"], "need --ckpt-dir"),
        (["--async-save"], "--async-save needs --save-every N"),
        (["--resume", str(tmp_path / "nothing")], "--resume "),
        (["--sharding-factor", "3"], "--sharding-factor 3 must divide the world size 2"),
        (["--peak-tflops", "0"], "--peak-tflops must be positive"),
        (["--precision", "fp16"], "invalid choice: 'fp16'"),
        (["--front-end", "fully_shard", "--strategy", "NO_SHARD"], "--front-end fully_shard has no NO_SHARD"),
        (["--front-end", "fully_shard", "--strategy", "HYBRID_SHARD"], "needs --sharding-factor F"),
    ]
    if not torch.cuda.is_available():
        cases.append((["--device", "cuda"], "torch sees no CUDA device here"))
    return cases


def test_bad_arguments_are_one_message(monkeypatch, capsys, tmp_path):
    example = _example(monkeypatch)
    for argv, needle in _bad_arguments(tmp_path):
        with pytest.raises(SystemExit) as exc:
            example.parse_args(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2, argv
        assert err.count("error:") == 1 and needle in err and "Traceback" not in err, (argv, err)


def test_bad_arguments_stop_the_launcher_before_any_rank(tmp_path):
    cmd = [sys.executable, str(SCRIPT), "--nproc", "2", "--dim", "33", "--heads", "2"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.count("error:") == 1 and "multiple of the number of heads" in out.stderr
    assert "Traceback" not in out.stderr and "torch.distributed" not in out.stderr  # torchrun never started


# ---------------------------------------------------------------- Muon on owned matrices
@pytest.mark.slow
def test_muon_trains_and_resumes_bitwise(tmp_path):
    """--optimizer muon: shard_boundaries="params", Muon on the matrices each rank owns and AdamW on the
    rest (examples/owned_optim.py); the loss falls, every element is owned by one rank, and a run resumed
    from its step-4 checkpoint goes on bitwise as the uninterrupted run went."""

    def run(name: str, *extra: str) -> tuple[str, dict]:
        cmd = [
            sys.executable,
            str(SCRIPT),
            *("--nproc", str(WORLD), "--optimizer", "muon", "--model", "tiny", "--dim", "33", "--heads", "3"),
            *(
                "--steps",
                "8",
                "--batch-size",
                "4",
                "--log-interval",
                "1",
                "--eval-batches",
                "1",
                "--sample-tokens",
                "0",
            ),
            *("--ckpt-dir", str(tmp_path / "ckpt"), "--save-every", "4", "--quiet", "--json", str(tmp_path / name)),
            *extra,
        ]
        log = run_launcher(cmd, ROOT, TIMEOUT_S, "train_gpt.py --optimizer muon")
        return log, json.loads((tmp_path / name).read_text())

    _, fig = run("first.json")
    assert fig["optimizer"] == "muon" and fig["shard_boundaries"] == "params" and fig["world"] == WORLD
    losses = [loss for _, loss in fig["losses"]]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0] - 0.3, losses
    mem = fig["memory"]
    assert sum(mem["local_numel"]) == fig["P"] and min(mem["local_numel"]) > 0  # each element on one rank
    for r, held in enumerate(mem["per_rank"]):
        assert held["params"] == held["grads"] == B * mem["local_numel"][r]  # whole parameters, no padding
        assert held["optimizer"] > 0  # every rank steps what it owns
        # the planner cuts the units as the engine did: each rank's parameters (with AdamW's state, which
        # it models, in place of Muon's)
        assert mem["planned_steady_per_rank"][r] == 4 * B * mem["local_numel"][r] + B * fig["n_state_params"]
    assert mem["planned_steady_bytes"] == max(mem["planned_steady_per_rank"])

    shutil.rmtree(tmp_path / "ckpt" / "step-00000008")
    log, again = run("again.json", "--resume")
    assert f"resuming from {tmp_path / 'ckpt' / 'step-00000004'} at step 4" in log
    first = dict(fig["losses"])
    assert [(s, first[s]) for s in range(4, 8)] == [(s, loss) for s, loss in again["losses"]]
