"""Soak: examples/train_gpt.py restarted by torchrun's machinery through many injected faults, against
the same run with none.

    make soak                                          # .venv/bin/python -m bench.faults.soak
    .venv/bin/python -m bench.faults.soak --steps 500 --faults 12 --stops 2 --seed 0 --out bench/results/soak.json

For each front end (the ``FullyShardedDataParallel`` wrapper, then ``fully_shard`` on each block and the
root: train_gpt.py's --front-end) and each strategy (FULL_SHARD, and HYBRID_SHARD with F = 2; on
``fully_shard`` a 2-D (replicate, shard) mesh), W = 4 local ranks train the tiny GPT for
--steps steps, a checkpoint every --save-every steps, the last --keep-last kept, one report per step
(its loss all-reduced: the per-step losses land in a metrics file). First the uninterrupted run; then
the same command with ``--resume --max-restarts`` and --faults faults (--stops of them SIGSTOP, the
others SIGKILL) at seeded random points: one per restart attempt, at increasing steps, each at one of
fault_injection.py's phases (forward, backward, the optimizer step, between steps, while a rank writes
its checkpoint file, before the commit, after it, during keep_last's removal). The faulted run must:

  * fire every fault, restart once per fault and resume each time from the newest checkpoint that
    was committed before the fault (nothing lost);
  * report, for every step any attempt ran (recomputed ones too), a loss equal to the uninterrupted
    run's, bit for bit, and end with a final checkpoint whose every rank file equals the uninterrupted
    run's (parameters, optimizer state, RNG states): byte for byte for the wrapper's files; for
    fully_shard's DCP files their tensor bytes and their headers with the keys sorted (``file_hashes``);
  * leave exactly keep_last complete checkpoints and the ``latest`` pointer, every file verified
    against its checksums (nothing corrupt), nothing else (no orphan .partial / .removing / .tmp);
  * after each SIGSTOP, print on every other rank an error naming the rank, and the unit and phase
    of the collective it waited in, within --collective-timeout + 30 s of the stop.

It prints the faults, then per strategy and in all: faults injected, restarts, steps recomputed,
checkpoints committed, interrupted and removed, bytes on disk, and the comparisons; --out writes the
same as JSON (bench/results/soak.json is a committed run). tests/test_restart.py runs the same
checks on a short W = 2 run.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import provenance
from examples import fault_injection
from flatshard.checkpoint.tools import inspect

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "train_gpt.py"

STEP_PHASES = ("forward", "backward", "optimizer")  # a fault there leaves its step undone
AGENT_GRACE_S = 30  # torchrun's agent waits this long after SIGTERM before SIGKILL (a stopped rank)


# ---- running a launcher, every line timestamped ----------------------------------------------------
class Job:
    """A command that starts ranks itself, in a session of its own; its output lines with the time each
    arrived (``time.monotonic``), also written to ``workdir/name.log``. ``name`` also names the run's
    checkpoint directory and metrics file in ``workdir`` (``train_command``)."""

    def __init__(self, cmd: list[str], workdir: Path, name: str):
        self.cmd, self.workdir, self.name, self.lines, self.t0 = cmd, workdir, name, [], time.monotonic()
        self._log = open(workdir / f"{name}.log", "w")
        self.proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.returncode: int | None = None
        self.wall_s: float | None = None

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append((time.monotonic(), line.rstrip("\n")))
            self._log.write(line)
            self._log.flush()

    def wait(self, timeout: float) -> int:
        """The exit status; a job still running after ``timeout`` s is killed with all its ranks (-9)."""
        if self.returncode is not None:
            return self.returncode
        try:
            self.returncode = self.proc.wait(timeout=max(0.0, timeout - (time.monotonic() - self.t0)))
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.returncode = -9
            self.proc.wait()
        self._reader.join()
        self.wall_s = time.monotonic() - self.t0
        self._log.close()
        return self.returncode

    def text(self, last: int = 60) -> str:
        return "\n".join(line for _, line in self.lines[-last:])


def train_command(
    workdir: Path,
    name: str,
    *,
    world: int,
    strategy: str,
    steps: int,
    save_every: int,
    keep_last: int,
    timeout_s: float,
    faults: list | None = None,
    extra: tuple = (),
) -> list[str]:
    """train_gpt.py's command for one run (``faults`` given: resumable, restarted once per fault)."""
    cmd = [sys.executable, str(EXAMPLE), "--nproc", str(world), "--strategy", strategy]
    cmd += ["--model", "tiny", "--steps", str(steps), "--batch-size", "4", "--log-interval", "1"]
    cmd += ["--eval-batches", "0", "--sample-tokens", "0", "--collective-timeout", str(timeout_s)]
    cmd += ["--ckpt-dir", str(workdir / name), "--save-every", str(save_every), "--keep-last", str(keep_last)]
    cmd += ["--metrics", str(workdir / f"{name}.jsonl"), "--json", str(workdir / f"{name}.json"), *extra]
    if faults is not None:
        cmd += ["--resume", "--max-restarts", str(len(faults) + 2)]  # 2 spare: a restart no fault caused is seen
        for f in faults:
            cmd += ["--inject-fault", str(f)]
    return cmd


# ---- planning faults ---------------------------------------------------------------------------------
def plan_faults(
    rng: random.Random, steps: int, n: int, stops: int, save_every: int, keep_last: int, world: int
) -> list[fault_injection.Fault]:
    """``n`` faults at increasing steps, one per attempt (0, 1, ...), each in its own slice of the run;
    ``stops`` of them SIGSTOP, half of those (rounded up) in forward, backward or between steps. The
    phases are drawn from shuffled rounds of all of them, so every phase comes once before any comes
    twice (when its slice allows it: a checkpoint phase is at a step a checkpoint follows, ``rotate`` at
    one whose checkpoint removes an older one)."""
    faults, span = [], (steps - 1) / n  # the last step is left alone: its checkpoint ends the run
    rounds: list[str] = []
    while len(rounds) < n:
        rounds += rng.sample(fault_injection.PHASES, len(fault_injection.PHASES))
    for i in range(n):
        lo, hi = int(i * span), max(int(i * span), int((i + 1) * span) - 1)
        saves = [s for s in range(lo, hi + 1) if (s + 1) % save_every == 0]
        phases = list(fault_injection.PHASES)
        if not saves:
            phases = [p for p in phases if p not in fault_injection.CHECKPOINT_STAGES.values()]
        rotating = [s for s in saves if (s + 1) // save_every >= keep_last + 1]
        if not rotating:
            phases = [p for p in phases if p != "rotate"]
        phase = rounds[i] if rounds[i] in phases else rng.choice(phases)
        if phase == "rotate":
            step = rng.choice(rotating)
        elif phase in fault_injection.CHECKPOINT_STAGES.values():
            step = rng.choice(saves)
        else:
            step = rng.randint(lo, hi)
        rank = 0 if phase in fault_injection.RANK0_ONLY else rng.randrange(world)
        faults.append(fault_injection.Fault("kill", phase, step, rank, attempt=i))
    # half the stops (rounded up) where the others then wait in a unit's collective, whose error names it
    in_units = [i for i, f in enumerate(faults) if f.phase in ("forward", "backward", "between")]
    stopped = rng.sample(in_units, min(len(in_units), (stops + 1) // 2))
    stopped += rng.sample([i for i in range(n) if i not in stopped], stops - len(stopped))
    return [dataclasses.replace(f, action="stop") if i in stopped else f for i, f in enumerate(faults)]


# ---- reading a run -----------------------------------------------------------------------------------
FIRED = re.compile(r"inject-fault: (kill|stop) rank (\d+) in (\w+) at step (\d+) \(attempt (\d+)\)")
RESUMED = re.compile(
    r"(?:resuming from (\S+) at step (\d+)|no checkpoint in \S+ yet: starting at step 0)"
    r"(?: \(restart (\d+)\))?$"
)
COMMITTED = re.compile(r"^checkpoint (\S+) committed$")
# every error a collective that a peer never joined ends in: a unit's (runtime/consistency.py), a checkpoint's
# (checkpoint/save.py), the example's report
FAILED = re.compile(r"(flatshard|train_gpt\.py): rank (\d+): (.*?) did not complete")
UNIT_PHASE = re.compile(r"of unit '([^']+)' in (\w+)$|\(phase (\w+), no unit\)$")


@dataclass
class Attempt:
    number: int
    start: int  # the step it resumed at
    t_start: float
    fault: dict | None = None  # the fault that ended it: action, rank, phase, step, t
    errors: dict = field(default_factory=dict)  # rank -> (seconds after the fault, what did not complete)


def attempts(job: Job) -> list[Attempt]:
    """The job's attempts in order, each with its resume step, its fault and the errors printed after it."""
    out: list[Attempt] = []
    for t, line in job.lines:
        if m := RESUMED.search(line):
            out.append(Attempt(int(m.group(3) or 0), int(m.group(2) or 0), t))
        elif (m := FIRED.search(line)) and out:
            out[-1].fault = {
                "action": m.group(1),
                "rank": int(m.group(2)),
                "phase": m.group(3),
                "step": int(m.group(4)),
                "attempt": int(m.group(5)),
                "t": t,
            }
        elif (m := FAILED.search(line)) and out and out[-1].fault is not None:
            rank = int(m.group(2))
            if rank not in out[-1].errors:
                out[-1].errors[rank] = (round(t - out[-1].fault["t"], 2), m.group(3))
    return out


def steps_done(fault: dict) -> int:
    """Steps the attempt had completed when its fault fired."""
    return fault["step"] if fault["phase"] in STEP_PHASES else fault["step"] + 1


def newest_committed(fault: dict, save_every: int) -> int:
    """The step of the newest checkpoint committed when ``fault`` fired (every earlier one was
    committed by this attempt or an earlier one; a fault in a save leaves it uncommitted unless it
    fired after the commit)."""
    done = steps_done(fault)
    if fault["phase"] in ("committed", "rotate"):
        return done
    if fault["phase"] in ("checkpoint", "commit"):
        return done - save_every
    return done // save_every * save_every


def losses(path: Path) -> list[tuple[int, float]]:
    """(steps done, loss) of every report in a metrics file, every attempt's, in order."""
    return [(m["step"], m["loss"]) for m in map(json.loads, path.read_text().splitlines())]


def file_hashes(ckpt: str) -> dict[str, str]:
    """Every data file of a checkpoint and its sha256: the manifest's where it records one (the wrapper's
    rank files); else (fully_shard's DCP safetensors, whose manifest holds sizes) of the file's tensor
    bytes and its header with every key sorted, since DCP writes the header's keys in an order that
    varies from run to run."""
    with open(os.path.join(ckpt, "manifest.json")) as f:
        files = json.load(f)["files"]
    return {
        name: rec["sha256"] if "sha256" in rec else _safetensors_hash(os.path.join(ckpt, name))
        for name, rec in files.items()
    }


def _safetensors_hash(path: str) -> str:
    with open(path, "rb") as f:
        data = f.read()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + n])
    meta = header.get("__metadata__", {})
    for key, value in meta.items():  # DCP's metadata values are JSON texts themselves
        try:
            meta[key] = json.loads(value)
        except (TypeError, ValueError):
            pass
    digest = hashlib.sha256(json.dumps(header, sort_keys=True).encode())
    digest.update(data[8 + n :])
    return digest.hexdigest()


def directory_problems(directory: Path, keep_last: int, world: int, last: int) -> list[str]:
    """What is wrong with a run's checkpoint directory at its end: anything but the ``latest`` pointer
    and keep_last complete checkpoints (the newest ``last``), or a file that fails its checksums."""
    problems = []
    names = sorted(os.listdir(directory))
    steps = [n for n in names if re.fullmatch(r"step-\d{8}", n)]
    orphans = [n for n in names if n not in steps and n != "latest"]
    if orphans:
        problems.append(f"{directory}: orphans {orphans}")
    if len(steps) != keep_last or steps[-1] != f"step-{last:08d}":
        problems.append(f"{directory}: checkpoints {steps}, expected {keep_last} ending with step {last}")
    pointer = json.loads((directory / "latest").read_text())
    if pointer.get("checkpoint") != steps[-1]:
        problems.append(f"{directory}/latest names {pointer.get('checkpoint')}, the newest is {steps[-1]}")
    for s in steps:
        listed = json.loads((directory / s / "manifest.json").read_text())["files"]
        if len(listed) != world:
            problems.append(f"{directory / s}: its manifest lists {len(listed)} data files, not one per rank ({world})")
        want = {"manifest.json", *listed}
        held = set(os.listdir(directory / s))
        if held != want:
            problems.append(f"{directory / s} holds {sorted(held ^ want)} beyond or short of its files")
        problems += [f"{s}: {p}" for p in inspect(str(directory / s), out=io.StringIO())]
    return problems


def disk_bytes(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())


def check_run(
    reference: Job,
    faulted: Job,
    faults: list,
    *,
    steps: int,
    save_every: int,
    keep_last: int,
    world: int,
    timeout_s: float,
) -> dict:
    """The figures of one faulted run against its reference (both finished), and every problem found."""
    problems: list[str] = []
    for job in (reference, faulted):
        if job.returncode != 0:
            problems.append(f"the {job.name} run exited {job.returncode}:\n{job.text()}")
    if problems:
        return {"problems": problems}
    ref_dir, run_dir = reference.workdir / reference.name, faulted.workdir / faulted.name
    runs = attempts(faulted)
    fired = [a.fault for a in runs if a.fault is not None]
    planned = [
        {"action": f.action, "rank": f.rank, "phase": f.phase, "step": f.step, "attempt": f.attempt} for f in faults
    ]
    if [{k: v for k, v in f.items() if k != "t"} for f in fired] != planned:
        problems.append(f"faults fired {fired}, planned {planned}")
    if [a.number for a in runs] != list(range(len(faults) + 1)):
        problems.append(f"attempts {[a.number for a in runs]}: expected one restart per fault, {len(faults)}")
    recomputed, stops = 0, []
    for a, b in zip(runs, runs[1:]):
        if a.fault is None:
            problems.append(f"attempt {a.number} ended without a fault")
            continue
        recomputed += steps_done(a.fault) - b.start
        if b.start != newest_committed(a.fault, save_every):
            problems.append(
                f"attempt {b.number} resumed at step {b.start} after {a.fault}; the newest checkpoint "
                f"committed was step {newest_committed(a.fault, save_every)}"
            )
        if a.fault["action"] == "stop":
            others = sorted(set(range(world)) - {a.fault["rank"]})
            late = {r: e for r, e in a.errors.items() if e[0] > timeout_s + AGENT_GRACE_S}
            named = {r: e for r, e in a.errors.items() if UNIT_PHASE.search(e[1])}
            stops.append({"fault": {k: v for k, v in a.fault.items() if k != "t"}, "errors": a.errors})
            if sorted(a.errors) != others or late or len(named) != len(a.errors):
                problems.append(
                    f"after {a.fault} ranks {others} must each print an error naming the rank, the "
                    f"unit or phase within {timeout_s + AGENT_GRACE_S} s; printed {a.errors}"
                )
    ref, got = dict(losses(ref_dir.with_suffix(".jsonl"))), losses(run_dir.with_suffix(".jsonl"))
    differ = [(s, loss, ref.get(s)) for s, loss in got if ref.get(s) != loss]
    if differ or sorted({s for s, _ in got}) != list(range(1, steps + 1)):
        problems.append(f"losses differ from the uninterrupted run's at {differ[:5]}, or steps are missing")
    final = f"step-{steps:08d}"
    same_files = file_hashes(str(ref_dir / final)) == file_hashes(str(run_dir / final))
    if not same_files:
        problems.append(f"the final checkpoints' files differ: {ref_dir / final}, {run_dir / final}")
    problems += directory_problems(run_dir, keep_last, world, steps)
    committed = sum(1 for _, line in faulted.lines if COMMITTED.search(line))
    committed += sum(1 for f in fired if f["phase"] in ("committed", "rotate"))  # killed before its line
    on_disk = len([n for n in os.listdir(run_dir) if n.startswith("step-")])
    return {
        "faults": len(fired),
        "kills": sum(f["action"] == "kill" for f in fired),
        "stops": sum(f["action"] == "stop" for f in fired),
        "faults_by_phase": {p: sum(f["phase"] == p for f in fired) for p in fault_injection.PHASES},
        "restarts": len(runs) - 1,
        "steps_recomputed": recomputed,
        "checkpoints_committed": committed,
        "checkpoints_interrupted": sum(1 for f in fired if f["phase"] in ("checkpoint", "commit")),
        "checkpoints_removed": committed - on_disk,
        "checkpoints_on_disk": on_disk,
        "bytes_on_disk": disk_bytes(run_dir),
        "losses_compared": len(got),
        "losses_bitwise_equal": not differ,
        "final_checkpoint_files_identical": same_files,
        "stop_errors": stops,
        "wall_s": {"reference": round(reference.wall_s, 1), "faulted": round(faulted.wall_s, 1)},
        "problems": problems,
    }


# ---- the soak ----------------------------------------------------------------------------------------
def soak_one(args, front_end: str, strategy: str, rng: random.Random, workdir: Path) -> dict:
    hybrid = ("--sharding-factor", "2") if strategy == "HYBRID_SHARD" else ()
    extra = (*hybrid, "--front-end", front_end)
    faults = plan_faults(rng, args.steps, args.faults, args.stops, args.save_every, args.keep_last, args.world)
    print(
        f"\n{front_end}, {strategy} (W = {args.world}{', F = 2' if hybrid else ''}): {len(faults)} faults", flush=True
    )
    for f in faults:
        print(f"  --inject-fault {f}", flush=True)
    run = {
        "world": args.world,
        "strategy": strategy,
        "steps": args.steps,
        "save_every": args.save_every,
        "keep_last": args.keep_last,
        "timeout_s": args.collective_timeout,
        "extra": extra,
    }
    reference = Job(train_command(workdir, "reference", **run), workdir, "reference")
    reference.wait(args.job_timeout)
    faulted = Job(train_command(workdir, "faulted", **run, faults=faults), workdir, "faulted")
    faulted.wait(args.job_timeout)
    result = check_run(
        reference,
        faulted,
        faults,
        steps=args.steps,
        save_every=args.save_every,
        keep_last=args.keep_last,
        world=args.world,
        timeout_s=args.collective_timeout,
    )
    result["front_end"], result["strategy"] = front_end, strategy + (" F=2" if hybrid else "")
    result["injected"] = [str(f) for f in faults]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--faults", type=int, default=12, help="faults per strategy (one per restart)")
    p.add_argument("--stops", type=int, default=2, help="of them SIGSTOP (each costs the timeout + 30 s)")
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--keep-last", type=int, default=3)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--collective-timeout", type=float, default=15.0, help="seconds (train_gpt.py's flag)")
    p.add_argument("--strategies", nargs="+", default=["FULL_SHARD", "HYBRID_SHARD"])
    p.add_argument("--front-ends", nargs="+", default=["wrapper", "fully_shard"], choices=["wrapper", "fully_shard"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--job-timeout", type=float, default=1800, help="seconds one run may take before it is killed")
    p.add_argument("--out", type=Path, help="write the figures as JSON")
    p.add_argument("--workdir", type=Path, help="keep the runs' files here (default: a temporary directory)")
    args = p.parse_args(argv)
    if args.stops > args.faults or args.faults < 1 or args.steps < 2 * args.faults:
        p.error("need 1 <= --faults <= --steps / 2 and --stops <= --faults")
    t0 = time.monotonic()
    rng = random.Random(args.seed)
    base = args.workdir or Path(tempfile.mkdtemp(prefix="flatshard-soak-"))
    print(
        f"soak: seed {args.seed}, {args.steps} steps, a checkpoint every {args.save_every} (keep {args.keep_last}), "
        f"W = {args.world}, collective timeout {args.collective_timeout:g} s; runs in {base}",
        flush=True,
    )
    results = []
    for front_end in args.front_ends:  # one draw of faults after another: the wrapper's plan is as before
        for strategy in args.strategies:
            workdir = base / front_end / strategy
            shutil.rmtree(workdir, ignore_errors=True)
            workdir.mkdir(parents=True)
            results.append(soak_one(args, front_end, strategy, rng, workdir))
            print_result(results[-1])
    total = {
        k: sum(r.get(k, 0) for r in results)
        for k in (
            "faults",
            "kills",
            "stops",
            "restarts",
            "steps_recomputed",
            "checkpoints_committed",
            "checkpoints_interrupted",
            "checkpoints_removed",
            "losses_compared",
        )
    }
    ok = not any(r["problems"] for r in results)
    wall = round(time.monotonic() - t0, 1)
    print(
        f"\nin all: {total['faults']} faults ({total['kills']} SIGKILL, {total['stops']} SIGSTOP), "
        f"{total['restarts']} restarts, {total['steps_recomputed']} steps recomputed, "
        f"{total['checkpoints_committed']} checkpoints committed ({total['checkpoints_interrupted']} saves "
        f"interrupted), {total['checkpoints_removed']} removed; {total['losses_compared']} losses compared; "
        f"{'every check passed' if ok else 'PROBLEMS above'}; {wall} s",
        flush=True,
    )
    if args.out:
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "workdir")}
        doc = {
            "command": "python -m bench.faults.soak " + " ".join(argv if argv is not None else sys.argv[1:]),
            "settings": settings,
            "wall_s": wall,
            "total": total,
            "passed": ok,
            "runs": results,
        }
        args.out.write_text(json.dumps(provenance.stamp(doc), indent=1) + "\n")
    if args.workdir is None and ok:
        shutil.rmtree(base, ignore_errors=True)
    return 0 if ok else 1


def print_result(r: dict) -> None:
    if "faults" not in r:  # a run failed: nothing to compare
        for problem in r["problems"]:
            print(f"  PROBLEM: {problem}")
        return
    phases = ", ".join(f"{p} {n}" for p, n in r["faults_by_phase"].items() if n)
    print(f"  faults injected {r['faults']} ({r['kills']} SIGKILL, {r['stops']} SIGSTOP; {phases})")
    print(f"  restarts {r['restarts']}, steps recomputed {r['steps_recomputed']}")
    print(
        f"  checkpoints committed {r['checkpoints_committed']}, saves interrupted {r['checkpoints_interrupted']}, "
        f"removed by keep_last {r['checkpoints_removed']}, on disk {r['checkpoints_on_disk']} "
        f"({r['bytes_on_disk']:,} bytes)"
    )
    print(
        f"  losses: {r['losses_compared']} reports (recomputed steps included), bitwise equal to the "
        f"uninterrupted run's: {r['losses_bitwise_equal']}"
    )
    how = "byte-identical" if r["front_end"] == "wrapper" else "equal (tensor bytes, headers' keys sorted)"
    print(
        f"  final checkpoint: every rank file {how} to the uninterrupted run's: {r['final_checkpoint_files_identical']}"
    )
    for s in r["stop_errors"]:
        f = s["fault"]
        errs = "; ".join(f"rank {k} after {v[0]} s: {v[1]}" for k, v in sorted(s["errors"].items()))
        print(f"  stop rank {f['rank']} in {f['phase']} at step {f['step']}: {errs}")
    print(f"  wall: reference {r['wall_s']['reference']} s, faulted {r['wall_s']['faulted']} s")
    for problem in r["problems"]:
        print(f"  PROBLEM: {problem}")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
