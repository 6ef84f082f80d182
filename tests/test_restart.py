"""Restart and resume, bitwise (docs/how-to/failures.md).

1. ``checkpoint.Checkpointer`` in a loop that draws from torch's, numpy's and Python's RNGs every step
   and reads its rows through a loader with a per-rank position of its own (``state=``): a run stopped
   after step 5 and resumed by fresh objects (other weights, other RNG states, the loader at 0) goes on
   bitwise as the uninterrupted run went (W = 2, one spawn); and the errors of ``state=``.
2. ``examples/train_gpt.py`` under torchrun's machinery (``--max-restarts``), W = 2, three jobs:
   the uninterrupted run; a run whose ranks are SIGKILLed six times, one fault per attempt, in forward,
   backward, the optimizer step, between steps, while a rank writes its checkpoint file and before the
   commit; and a run whose rank 1 is SIGSTOPped in backward. The faulted runs must restart once per
   fault, resume each time from the newest committed checkpoint, report every step's loss (recomputed
   steps too) equal to the uninterrupted run's to the bit, end with a final checkpoint whose rank files
   are byte-identical to its, and leave exactly keep_last checkpoints, verified, and no orphan file
   (bench/faults/soak.py's checks, which the soak runs at W = 4 with many more faults). After the SIGSTOP, rank 0
   must fail with an error naming itself, the unit and the phase within the collective timeout (10 s
   here, ``--collective-timeout``) + 30 s; torchrun's agent then waits 30 s for the stopped rank to
   obey SIGTERM before it kills it and restarts both. That run starts when collection ends, so its
   waiting passes while earlier tests run; the other two start together when this file needs them.
3. The same script with ``--front-end fully_shard``, 8 steps, killed four times (backward, a checkpoint
   being written, the optimizer step, before the commit): bitwise as its uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.faults import soak
from tests.helpers import early
from tests.helpers.cases import CHECKPOINT_KIND, build, checkpoint_error, make_optimizer
from tests.helpers.dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]
GLOBAL = 12  # rows of the global batch

# ---------------------------------------------------------------- 1. the Checkpointer, in one spawn


class Cursor:
    """A loader whose position is its own: rank r walks a shuffled order of the batch's rows, r + 1 rows
    a step, so every rank's position differs."""

    def __init__(self, rank: int):
        self.rank, self.at = rank, 0
        self.order = torch.randperm(GLOBAL, generator=torch.Generator().manual_seed(rank)).tolist()

    def take(self) -> list[int]:
        rows = [self.order[(self.at + i) % GLOBAL] for i in range(self.rank + 1)]
        self.at += self.rank + 1
        return rows

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def _seed(value: int) -> None:
    torch.manual_seed(value)
    np.random.seed(value)
    random.seed(value)


def _loop(ckpt, model, opt, batch, loss_fn, cursor, start: int, stop: int, steps: int) -> list[float]:
    """Steps start..stop-1; each rank's rows come from its cursor and one row from all three RNGs."""
    losses = []
    for step in range(start, stop):
        x, y = batch(step, GLOBAL)
        drawn = int(torch.randint(GLOBAL, ())) + int(np.random.randint(GLOBAL)) + random.randrange(GLOBAL)
        rows = cursor.take() + [drawn % GLOBAL]
        loss = loss_fn(model(x[rows]), y[rows])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        ckpt.step_done(step + 1, extra={"after": step}, final=step + 1 == steps)
    return losses


def checkpointer_worker(rank: int, world: int, tmp: str) -> dict:
    import torch.distributed as dist

    from flatshard import checkpoint

    steps = 7

    def start(directory: str, seed: int, init_seed: int):
        torch.manual_seed(init_seed)
        _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
        opt = make_optimizer("adamw", model)
        cursor = Cursor(rank)
        _seed(seed)
        ckpt = checkpoint.Checkpointer(directory, model, opt, every=3, keep_last=2, state={"loader": cursor})
        return ckpt, model, opt, batch, loss_fn, cursor

    # the uninterrupted run
    ckpt, model, opt, batch, loss_fn, cursor = start(f"{tmp}/u", 100 + rank, 0)
    assert ckpt.resume() == 0 and ckpt.resumed_from is None
    uninterrupted = _loop(ckpt, model, opt, batch, loss_fn, cursor, 0, steps, steps)
    final = {n: p.detach().clone() for n, p in model.named_parameters()}

    # the same run, stopped after step 5 (its last checkpoint: step 3) ...
    ckpt, model, opt, batch, loss_fn, cursor = start(f"{tmp}/i", 100 + rank, 0)
    first = _loop(ckpt, model, opt, batch, loss_fn, cursor, 0, 5, steps)
    # ... and resumed by fresh objects: other weights, other RNG states, the loader at its start
    ckpt, model, opt, batch, loss_fn, cursor = start(f"{tmp}/i", 999, 1234 + rank)
    at = ckpt.resume()
    assert (at, ckpt.extra, cursor.at) == (3, {"after": 2}, 3 * (rank + 1)), (at, ckpt.extra, cursor.at)
    assert ckpt.resumed_from == os.path.join(f"{tmp}/i", "step-00000003")
    second = _loop(ckpt, model, opt, batch, loss_fn, cursor, at, steps, steps)
    assert first == uninterrupted[:5] and second == uninterrupted[3:], (first, second, uninterrupted)
    for n, p in model.named_parameters():
        assert torch.equal(p.detach(), final[n]), n
    assert sorted(os.listdir(f"{tmp}/i")) == ["latest", "step-00000006", "step-00000007"]

    # errors, on every rank alike
    path = checkpoint.step_path(f"{tmp}/u", steps)
    messages = [checkpoint_error(lambda: checkpoint.load(path, model, opt, state={"sampler": cursor}))]
    assert "holds no loop state sampler (it holds loader)" in messages[-1], messages[-1]
    bad = checkpoint.Checkpointer(f"{tmp}/bad", model, opt, every=1, state={"loader": object()})
    messages.append(checkpoint_error(lambda: bad.step_done(1)))
    assert "has no state_dict() and load_state_dict()" in messages[-1], messages[-1]
    alone = [dist.new_group([r]) for r in range(world)][rank]  # a 1-rank job
    _, single, _, _ = build(CHECKPOINT_KIND, "FULL_SHARD", process_group=alone)
    messages.append(checkpoint_error(lambda: checkpoint.load(path, single, state={"loader": Cursor(rank)})))
    assert "was saved by 2 ranks and this job has 1" in messages[-1], messages[-1]
    for bad_every in (0, True, 2.5):
        with pytest.raises(ValueError, match="every must be a positive int"):
            checkpoint.Checkpointer(f"{tmp}/x", model, opt, every=bad_every)
    return {"messages": messages[:2]}


def test_checkpointer_restores_model_optimizer_rngs_and_loader_bitwise(tmp_path):
    results = run_distributed(checkpointer_worker, 2, str(tmp_path))
    assert results[0]["messages"] == results[1]["messages"]  # the same error on every rank


# ---------------------------------------------------------------- 2. train_gpt.py under torchrun restarts

fault_injection = soak.fault_injection
RUN = {"world": 2, "strategy": "FULL_SHARD", "steps": 14, "save_every": 3, "keep_last": 2, "timeout_s": 10}
KILLS = [  # one per attempt, at increasing steps; every kind of point but the ones after the commit
    "kill:forward:step=1:rank=1",  # before the first checkpoint: the restart starts over at 0
    "kill:backward:step=4:rank=0",
    "kill:checkpoint:step=5:rank=1",  # writing step-00000006: the restart resumes from step 3
    "kill:optimizer:step=7:rank=1",
    "kill:commit:step=8:rank=0",  # step-00000009's manifest written, not renamed: resumes from 6
    "kill:between:step=10:rank=1",
]
STOP = "stop:backward:step=4:rank=1"
JOB_TIMEOUT_S = 300  # each job, from its start; the killed one takes about 30 s on two idle cores


def _faults(specs: list[str]) -> list:
    return [fault_injection.parse(f"{s}:attempt={i}") for i, s in enumerate(specs)]


def _start_stopped():
    work = Path(tempfile.mkdtemp(prefix="flatshard-restart-"))
    return soak.Job(soak.train_command(work, "stopped", **RUN, faults=_faults([STOP])), work, "stopped")


def _end(job) -> None:
    if job.returncode is None:
        job.wait(0)  # kill what a failed test left running
    shutil.rmtree(job.workdir, ignore_errors=True)


# The stopped run is idle for most of its minute (the collective timeout, then torchrun's 30 s before it
# kills the stopped rank): in a run on one worker it starts when collection ends (tests/helpers/early.py),
# and that wait passes while the tests before this file run; under make test's two workers it starts with
# its test, and the other worker's tests run meanwhile ([Note: the suite on two workers]).
early.register("stopped_job", _start_stopped, _end)


@pytest.fixture(scope="module")
def stopped_job():
    job = early.take("stopped_job")
    yield job
    early.stop("stopped_job", job)


@pytest.fixture(scope="module")
def jobs(tmp_path_factory):
    """The uninterrupted run and the killed run, started together."""
    work = tmp_path_factory.mktemp("restart")
    started = {
        "reference": soak.Job(soak.train_command(work, "reference", **RUN), work, "reference"),
        "killed": soak.Job(soak.train_command(work, "killed", **RUN, faults=_faults(KILLS)), work, "killed"),
    }
    yield started
    for job in started.values():
        if job.returncode is None:
            job.wait(0)  # kill what a failed test left running


def _check(reference, faulted, specs: list[str]) -> dict:
    for job in (reference, faulted):
        job.wait(JOB_TIMEOUT_S)
    run = {k: v for k, v in RUN.items() if k not in ("strategy",)}
    result = soak.check_run(reference, faulted, _faults(specs), **run)
    assert result["problems"] == [], "\n".join(result["problems"])
    return result


@pytest.mark.slow
def test_restart_resumes_bitwise_after_a_kill_in_each_phase(jobs):
    result = _check(jobs["reference"], jobs["killed"], KILLS)
    assert result["restarts"] == len(KILLS) == 6
    # completed before each fault minus the step resumed at: (1-0)+(4-3)+(6-3)+(7-6)+(9-6)+(11-9)
    assert result["steps_recomputed"] == 11
    # every step's report and the recomputed ones', but the first attempt's one report: the second attempt
    # starts over at step 0, and so does its metrics file
    assert result["checkpoints_interrupted"] == 2 and result["losses_compared"] == 14 + 11 - 1
    assert result["losses_bitwise_equal"] and result["final_checkpoint_files_identical"]


@pytest.mark.slow
def test_a_stopped_rank_fails_every_other_rank_in_time_and_the_restart_recovers(jobs, stopped_job):
    result = _check(jobs["reference"], stopped_job, [STOP])
    (stop,) = result["stop_errors"]
    delay, what = stop["errors"][0]  # rank 0, the only other rank
    assert RUN["timeout_s"] <= delay <= RUN["timeout_s"] + soak.AGENT_GRACE_S, delay
    assert soak.UNIT_PHASE.search(what) and " in backward" in what, what  # names the unit and the phase
    assert result["restarts"] == 1 and result["final_checkpoint_files_identical"]


# ---------------------------------------------------------------- 3. the same under fully_shard
FS_RUN = {**RUN, "steps": 8}
FS_KILLS = [  # checkpoints after steps 3 and 6, and at the end
    "kill:backward:step=1:rank=0",  # before any checkpoint: starts over at 0
    "kill:checkpoint:step=2:rank=1",  # writing step-00000003, the first: starts over at 0 again
    "kill:optimizer:step=4:rank=1",  # resumes from step 3
    "kill:commit:step=5:rank=0",  # step-00000006's manifest written, not renamed: resumes from 3
]
FULLY_SHARD = ("--front-end", "fully_shard")


@pytest.mark.slow
def test_fully_shard_restart_resumes_bitwise_after_kills(tmp_path):
    """``train_gpt.py --front-end fully_shard`` under torchrun's restarts: killed in backward, while writing
    a checkpoint, in the optimizer step and before the commit, it resumes each time from the newest committed
    checkpoint (flatshard.checkpoint on fully_shard's DTensors), every step's loss bitwise equal to the
    uninterrupted fully_shard run's, the final checkpoint's files equal to its (their tensor bytes and headers,
    the headers' keys sorted: DCP writes them in an order that varies between runs; bench/faults/soak.py)."""
    reference = soak.Job(soak.train_command(tmp_path, "reference", **FS_RUN, extra=FULLY_SHARD), tmp_path, "reference")
    killed = soak.Job(
        soak.train_command(tmp_path, "killed", **FS_RUN, faults=_faults(FS_KILLS), extra=FULLY_SHARD),
        tmp_path,
        "killed",
    )
    try:
        for job in (reference, killed):
            job.wait(JOB_TIMEOUT_S)
        run = {k: v for k, v in FS_RUN.items() if k != "strategy"}
        result = soak.check_run(reference, killed, _faults(FS_KILLS), **run)
    finally:
        for job in (reference, killed):
            if job.returncode is None:
                job.wait(0)
    assert result["problems"] == [], "\n".join(result["problems"])
    assert result["restarts"] == len(FS_KILLS) == 4
    assert result["steps_recomputed"] == (1 - 0) + (3 - 0) + (4 - 3) + (6 - 3)
    assert result["losses_bitwise_equal"] and result["final_checkpoint_files_identical"]


# ---------------------------------------------------------------- fault specs and plans are checked
def test_fault_specs_and_plans(monkeypatch, capsys):
    with pytest.raises(ValueError, match="only rank 0 commits"):
        fault_injection.parse("kill:commit:step=3:rank=1")
    with pytest.raises(ValueError, match="ACTION must be one of kill, stop"):
        fault_injection.parse("pause:forward:step=3")
    f = fault_injection.parse("stop:checkpoint:step=4")
    assert fault_injection.problem([f], 2, 10, 3) == (
        "--inject-fault stop:checkpoint:step=4:rank=0:attempt=0: no checkpoint is saved after step 4 (--save-every 3)"
    )
    plan = soak.plan_faults(random.Random(0), 500, 12, 2, 10, 3, 4)
    assert [f.attempt for f in plan] == list(range(12)) and sum(f.action == "stop" for f in plan) == 2
    assert all(a.step < b.step for a, b in zip(plan, plan[1:]))  # each attempt reaches its fault
    assert fault_injection.problem(plan, 4, 500, 10) is None
    monkeypatch.syspath_prepend(str(ROOT / "examples"))
    spec = importlib.util.spec_from_file_location("train_gpt_under_test", ROOT / "examples" / "train_gpt.py")
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    for argv, needle in (
        (
            ["--max-restarts", "2", "--ckpt-dir", "x", "--save-every", "2"],
            "needs --save-every N --ckpt-dir DIR --resume",
        ),
        (["--inject-fault", "kill:forward:step=3:rank=2"], "rank 2 does not exist with 2 ranks"),
        (["--inject-fault", "kill:forward:rank=1"], "step=N is required"),
        (["--collective-timeout", "0"], "--collective-timeout must be positive"),
    ):
        with pytest.raises(SystemExit):
            example.parse_args(argv)
        err = capsys.readouterr().err
        assert err.count("error:") == 1 and needle in err, (argv, err)


# ---------------------------------------------------------------- the soak's figures in the docs
def test_docs_soak_figures_are_the_committed_result():
    """docs/how-to/failures.md's "Soak" quotes bench/results/soak.json, a run of both front ends in which
    every check passed and every phase was hit in each strategy."""
    from bench.tables import measured_at

    doc = json.loads((ROOT / "bench" / "results" / "soak.json").read_text())
    assert doc["passed"] and not any(r["problems"] for r in doc["runs"])
    for run in doc["runs"]:
        assert run["losses_bitwise_equal"] and run["final_checkpoint_files_identical"], run["strategy"]
        assert all(run["faults_by_phase"].values()), run["faults_by_phase"]
    page = (ROOT / "docs" / "how-to" / "failures.md").read_text()
    section = page[page.index("## Soak") :]
    section = " ".join(section[: section.index("\n## ", 10)].split())
    t, settings = doc["total"], doc["settings"]
    delays = [e[0] for r in doc["runs"] for stop in r["stop_errors"] for e in stop["errors"].values()]
    bytes_on_disk = [f"{r['bytes_on_disk']:,}" for r in doc["runs"]]
    front_ends = sorted({r["front_end"] for r in doc["runs"]})
    assert front_ends == ["fully_shard", "wrapper"], front_ends  # the soak runs both front ends
    in_a_save = [  # "a stop in a fully_shard save included": every other rank named the save it waited in
        stop
        for r in doc["runs"]
        if r["front_end"] == "fully_shard"
        for stop in r["stop_errors"]
        if all("the save to" in e[1] for e in stop["errors"].values())
    ]
    assert in_a_save, "no SIGSTOP landed in a fully_shard save"
    for phrase in (
        f"{settings['steps']} steps, a checkpoint every {settings['save_every']}, keep_last {settings['keep_last']}",
        f"W = {settings['world']}",
        f"collective timeout {settings['collective_timeout']:g} s, seed {settings['seed']}",
        f"{t['faults']} faults at seeded random points",
        f"({t['kills']} SIGKILL, {t['stops']} SIGSTOP), {t['restarts']} restarts",
        f"{t['steps_recomputed']} steps recomputed, {t['checkpoints_committed']} checkpoints committed",
        f"{t['checkpoints_interrupted']} saves interrupted, {t['checkpoints_removed']} checkpoints removed",
        f"{', '.join(bytes_on_disk[:-1])} and {bytes_on_disk[-1]} bytes on disk",
        f"All {t['losses_compared']} losses",
        f"every other rank failed within {max(delays):.1f} s of the stop",
        f"{doc['wall_s'] / 60:.0f} minutes",
        " ".join(measured_at(doc).split()),
    ):
        assert phrase in section, phrase
