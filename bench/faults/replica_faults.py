"""Replica groups that drop out and rejoin, measured: G replica groups of P ranks (flatshard FULL_SHARD
inside each, the replica dimension on torchft through ``flatshard.ft``), one rank of a group killed
every ``--kill-every`` steps, the killed group restarted by its torchrun and healed from a live peer.

    python -m bench.faults.replica_faults          # as root: the emulated cluster (one namespace per group)
    python -m bench.faults.replica_faults --local  # the same on this machine's loopback, no root
    python -m bench.faults.replica_faults --local --seeds 0 --steps 40 --kill-every 15   # a quick look
    python -m bench.faults.replica_faults --from-logs DIR --out OUT  # summarize a --log-dir DIR again

Prints, and writes to ``--out`` (default bench/results/replica_faults.json):
* every kill: the step and group, how many steps later and how many seconds later the group was back
  (its first committed step in the quorum), and the steps per minute of the groups that stayed up
  over the whole window, from their last commit before the kill to their commit of the step it rejoined
  at ([Note: the survivors' rate over the whole window]), against their steady rate (the median rate over
  windows of 10 steps with every group in the quorum, 5 steps clear of any failure);
* the loss curve (each step's loss averaged over the ranks that committed it, smoothed over 10 steps)
  against the band the no-failure runs of ``--seeds`` draw (their smoothed minimum and maximum);
* after the last rejoin, whether rank k of every group holds bitwise the same parameters and optimizer
  state (SHA-256 of each, written by every rank when it finishes).

Runs are bounded (``--timeout`` each) and tear themselves down (every process by id; the namespaces by
bench/cluster/net.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from bench import provenance
from bench.cluster.net import Cluster, Topology, free_ports, parse_rate, unavailable

ROOT = Path(__file__).resolve().parents[2]
WORKER = "bench.faults.replica_faults_worker"  # run by torchrun as a module (-m), from ROOT
SMOOTH = 10


@dataclass
class Node:
    """Where one replica group runs: this machine (``prefix`` empty) or a namespace of the cluster."""

    address: str
    prefix: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Job:
    nodes: list[Node]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def start(self, node: Node, argv: list[str], log: Path) -> subprocess.Popen:
        # a fresh store for each restart of a group (flatshard.ft.Manager explains why it insists)
        env = dict(os.environ, OMP_NUM_THREADS="1", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", **node.env)
        with open(log, "w") as out:  # a session of its own: torchrun and its ranks are one process group
            proc = subprocess.Popen(
                [*node.prefix, *argv], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.procs:
            for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
                if proc.poll() is not None:
                    break
                try:
                    os.killpg(proc.pid, sig)
                    proc.wait(timeout=wait)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    continue


def read_log(path: Path) -> list[dict]:
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return out


def run_once(nodes: list[Node], args, seed: int, kills: int, log_dir: Path) -> dict:
    """One job: a Lighthouse on node 0, one torchrun per group, and at most ``kills`` kills; returns the
    ranks' logs and the kills."""
    groups, nproc = len(nodes), args.nproc
    log_dir.mkdir(parents=True, exist_ok=True)
    job = Job(nodes)
    lh_port = args.port
    lighthouse = (
        "import time; from flatshard import ft\n"
        f"lh = ft.Lighthouse(bind='[::]:{lh_port}', min_replicas=1)\n"
        "print(lh.address(), flush=True)\n"
        "time.sleep(1e6)\n"
    )
    events: list[dict] = []
    try:
        job.start(nodes[0], [sys.executable, "-c", lighthouse], log_dir / "lighthouse.log")
        for g, node in enumerate(nodes):
            rdzv = f"{node.address}:{args.port + 1 + g}"
            argv = [
                sys.executable, "-m", "torch.distributed.run", "--nnodes=1", f"--nproc-per-node={nproc}",
                f"--max-restarts={args.max_restarts}", "--monitor-interval=0.1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={rdzv}", "--rdzv-conf=is_host=1", f"--local-addr={node.address}",
                "-m", WORKER, "--steps", str(args.steps), "--seed", str(seed), "--preset", args.preset,
                "--batch", str(args.batch), "--lr", str(args.lr), "--lighthouse", f"http://{nodes[0].address}:{lh_port}",
                "--replica-id", f"g{g}", "--hostname", node.address, "--log-dir", str(log_dir),
                "--step-sleep", str(args.step_sleep), "--timeout", str(args.collective_timeout),
                "--groups", str(groups), "--start-file", str(log_dir / "start"),
                "--front", getattr(args, "front", "fsdp"),
            ]  # fmt: skip
            job.start(node, argv, log_dir / f"torchrun-g{g}.log")
        started, next_kill, victim, was_everyone = time.monotonic(), args.kill_every, 0, False
        # [Note: where a kill lands]
        # The loop sees a commit within 50 ms, so a kill made at once lands in the idle time after a
        # commit (--step-sleep), before the next step's quorum: the step in flight is never one whose
        # cross-replica all-reduce fails and is run again. A delay drawn up to --kill-jitter (seeded)
        # puts kills in every part of a step.
        jitter = random.Random(seed)
        log_files = [log_dir / f"g{g}-r{r}.jsonl" for g in range(groups) for r in range(nproc)]
        logs = {}
        while time.monotonic() - started < args.timeout:
            logs = {(g, r): read_log(log_dir / f"g{g}-r{r}.jsonl") for g in range(groups) for r in range(nproc)}
            if all(any(rec["kind"] == "final" for rec in recs) for recs in logs.values()):
                break
            if all(any(rec["kind"] == "ready" for rec in recs) for recs in logs.values()):
                (log_dir / "start").touch()  # every rank built its model and manager: go
            if any(p.poll() is not None for p in job.procs[1:]):  # a torchrun gave up (out of restarts)
                break
            steps = [rec for recs in logs.values() for rec in recs if rec["kind"] == "step"]
            top = max((rec["step"] for rec in steps), default=-1)
            everyone = all(recs and recs[-1].get("participants") == groups for recs in logs.values())
            if everyone and not was_everyone and events:  # the last one killed is back: let it settle
                next_kill = max(next_kill, top + args.settle)
            was_everyone = everyone
            if len(events) < kills and top >= next_kill and top <= args.steps - args.last_kill_margin:
                if everyone:  # kill only when every group is back in the quorum
                    g, r = victim % groups, (victim // groups) % nproc
                    pid = [rec["pid"] for rec in logs[(g, r)] if rec["kind"] == "start"][-1]
                    time.sleep(jitter.uniform(0.0, getattr(args, "kill_jitter", 0.0)))  # [Note: where a kill lands]
                    top = max(
                        [top]
                        + [rec["step"] for recs in map(read_log, log_files) for rec in recs if rec["kind"] == "step"]
                    )
                    os.kill(pid, signal.SIGKILL)
                    events.append({"group": g, "rank": r, "pid": pid, "step": top, "t": time.time()})
                    print(f"  killed group {g} rank {r} (pid {pid}) at step {top}", flush=True)
                    victim += 1
                    next_kill, was_everyone = top + args.kill_every, False
            time.sleep(0.05)
    finally:
        job.stop()
        (log_dir / "kills.json").write_text(json.dumps(events) + "\n")  # --from-logs summarizes the run again
    return load_run(log_dir, groups, nproc)


def load_run(log_dir: Path, groups: int, nproc: int) -> dict:
    """A run as ``run_once`` returns it, from the logs it left in ``log_dir``."""
    logs = {f"g{g}-r{r}": read_log(log_dir / f"g{g}-r{r}.jsonl") for g in range(groups) for r in range(nproc)}
    finished = all(any(rec["kind"] == "final" for rec in recs) for recs in logs.values())
    return {"logs": logs, "kills": json.loads((log_dir / "kills.json").read_text()), "finished": finished}


# ---- figures ---------------------------------------------------------------------------------------------
def loss_curve(run: dict, steps: int) -> list[float | None]:
    """Each step's loss averaged over the ranks that committed it while participating."""
    per_step: dict[int, list[float]] = {}
    for recs in run["logs"].values():
        for rec in recs:
            if rec["kind"] == "step" and rec["committed"] and rec["participating"]:
                per_step.setdefault(rec["step"], []).append(rec["loss"])
    return [statistics.fmean(per_step[s]) if s in per_step else None for s in range(steps)]


def smooth(curve: list[float | None]) -> list[float | None]:
    out = []
    for i in range(len(curve)):
        window = [v for v in curve[max(0, i - SMOOTH + 1) : i + 1] if v is not None]
        out.append(statistics.fmean(window) if window else None)
    return out


def commits(run: dict, group: int) -> list[tuple[int, float, int]]:
    """(step, time, participants) of group ``group``'s rank 0's committed steps while participating."""
    return [
        (rec["step"], rec["t"], rec["participants"])
        for rec in run["logs"][f"g{group}-r0"]
        if rec["kind"] == "step" and rec["committed"] and rec["participating"]
    ]


def rate(points: list[tuple[int, float, int]]) -> float | None:
    if len(points) < 2 or points[-1][1] <= points[0][1]:
        return None
    return 60.0 * (points[-1][0] - points[0][0]) / (points[-1][1] - points[0][1])


# [Note: the survivors' rate over the whole window]
# A kill costs the groups that stay up in three places: the step in flight when the rank dies (its
# cross-replica all-reduce fails, or the quorum waits out the dead group's heartbeat), the steps alone,
# and the rejoin (the quorum that lets the restarted group in, the state sent to it over HTTP before the
# step it joins). So a survivor's rate is measured over a window that holds all three: from its commit
# of the last step the killed group committed (its last commit before the kill, or just after it when the
# kill landed after that step's all-reduce: [Note: back is a commit of the restarted processes]) to its
# commit of the step the restarted group first commits (the two groups
# commit that step in the same all-reduce, within milliseconds). Both ends are commits, so the window
# holds a whole number of steps and its rate is the steady rate exactly when nothing was lost; a window
# cut at the kill and the rejoin instead counts a step more or less by where the kill fell (with five
# steps away, a fifth of the ratio). No window is left out: a group that never came back, or a survivor
# with no commit at either end, is an error, and a survivor that committed nothing is a rate of 0.
def window(run: dict, group: int, kill_t: float, from_step: int, back_step: int) -> dict:
    """``group``'s steps and seconds from its commit of ``from_step`` (the last step the killed group
    committed) to its commit of ``back_step`` ([Note: the survivors' rate over the whole window])."""
    mine = commits(run, group)
    before = [c for c in mine if c[0] <= from_step]
    after = [c for c in mine if c[0] >= back_step and c[1] > kill_t]
    if not before or not after:
        raise RuntimeError(
            f"group {group} has no commit before the kill (t={kill_t:.2f}) or none of step {back_step}, the "
            "rejoin's: it did not stay up through the kill, so no rate of it is measured"
        )
    (s0, t0, _), (s1, t1, _) = before[-1], after[0]
    inside = [c for c in mine if t0 <= c[1] <= t1]
    return {
        "from_step": s0,
        "to_step": s1,
        "steps": s1 - s0,
        "seconds": round(t1 - t0, 3),
        "before_kill_s": round(kill_t - t0, 3),
        # where the time goes: the step the kill broke (commit to commit), and the step the group rejoined at
        "kill_step_s": round(inside[1][1] - t0, 3),
        "rejoin_step_s": round(t1 - inside[-2][1], 3),
    }


def failures(run: dict, groups: int) -> list[dict]:
    out = []
    for kill in run["kills"]:
        # [Note: back is a commit of the restarted processes]
        # The killer reads the step and kills, and the kill can land after that step's all-reduce, a few
        # milliseconds before the killed group's rank 0 logs its commit: a commit logged after the kill's
        # time is then the old processes'. The group is back at the first commit of the processes
        # torchrun started after the kill, and the survivor's window starts at its commit of the last step
        # the killed group committed before (so the step the kill broke is the one after it).
        starts = [r["t"] for r in run["logs"][f"g{kill['group']}-r0"] if r["kind"] == "start" and r["t"] > kill["t"]]
        mine = commits(run, kill["group"])
        back = [c for c in mine if starts and c[1] > starts[0]]
        if not back:
            raise RuntimeError(f"group {kill['group']}, killed at step {kill['step']}, never committed a step again")
        before = [c for c in mine if c[1] < starts[0]]
        last = before[-1][0] if before else -1
        others = [g for g in range(groups) if g != kill["group"]]
        windows = {f"g{g}": window(run, g, kill["t"], last, back[0][0]) for g in others}
        out.append(
            {
                **{k: kill[k] for k in ("group", "rank", "step")},
                "last_step_before": last,
                "back_at_step": back[0][0],
                "steps_away": back[0][0] - kill["step"],
                "seconds_away": round(back[0][1] - kill["t"], 2),
                # [Note: the survivors' rate over the whole window]
                "others_window": windows,
                "others_steps_per_min_during": {g: 60.0 * w["steps"] / w["seconds"] for g, w in windows.items()},
            }
        )
    return out


def steady_rate(run: dict, group: int, groups: int, fails: list[dict]) -> float | None:
    """Median steps per minute of ``group`` over windows of 10 committed steps with every group in the
    quorum and no failure within 5 steps."""
    away = [(f["step"] - 5, f["back_at_step"] + 5) for f in fails]
    points = [c for c in commits(run, group) if c[2] == groups and not any(a <= c[0] <= b for a, b in away)]
    rates = []
    for i in range(0, len(points) - 10, 10):
        span = points[i : i + 11]
        if span[-1][0] - span[0][0] == 10:
            rates.append(rate(span))
    return statistics.median(rates) if rates else None


def final_equal(run: dict, groups: int, nproc: int) -> dict:
    out = {}
    for r in range(nproc):
        finals = [
            next((rec for rec in run["logs"][f"g{g}-r{r}"] if rec["kind"] == "final"), None) for g in range(groups)
        ]
        if any(f is None for f in finals):
            out[f"rank{r}"] = "missing"
            continue
        out[f"rank{r}"] = {
            "steps": [f["step"] for f in finals],
            "parameters_equal": len({f["parameters"] for f in finals}) == 1,
            "optimizer_equal": len({f["optimizer"] for f in finals}) == 1,
        }
    return out


def against_band(curve: list[float | None], lo: list[float | None], hi: list[float | None]) -> dict:
    """How much of a smoothed loss curve lies inside the band [lo, hi], step by step."""
    checked = [s for s in range(SMOOTH, len(curve)) if None not in (curve[s], lo[s], hi[s])]
    inside = [s for s in checked if lo[s] <= curve[s] <= hi[s]]
    excess = max((max(lo[s] - curve[s], curve[s] - hi[s], 0.0) for s in checked), default=0.0)
    return {"steps_checked": len(checked), "steps_inside": len(inside), "largest_excursion": round(excess, 4)}


# [Note: the band's control]
# The band is the smoothed minimum and maximum of the no-failure runs of --seeds (3 of them by default).
# A run that differs from those only by its seed is itself outside such a band at many steps: of k
# runs alike, a (k+1)-th lies inside their range at a given step with probability (k-1)/(k+1), a half
# for k = 3. So "the loss curve stays within the band" is judged against runs that had no failure:
# the no-failure runs of --control-seeds, checked against the same band as the faulty run.
def summarize(faulty: dict, clean: dict[int, dict], args, controls: dict[int, dict] | None = None) -> dict:
    controls = controls or {}
    groups = args.groups
    fails = failures(faulty, groups)
    steady = {f"g{g}": steady_rate(faulty, g, groups, fails) for g in range(groups)}
    missing = [g for g, r in steady.items() if r is None]
    if missing:
        raise RuntimeError(f"no steady rate for {missing}: no 10 steps in a row with every group up, clear of kills")
    for f in fails:
        f["others_rate_ratio"] = {
            g: round(during / steady[g], 3) for g, during in f["others_steps_per_min_during"].items()
        }
    curve = smooth(loss_curve(faulty, args.steps))
    band = None
    if clean:
        curves = [smooth(loss_curve(run, args.steps)) for run in clean.values()]
        lo = [min((c[s] for c in curves if c[s] is not None), default=None) for s in range(args.steps)]
        hi = [max((c[s] for c in curves if c[s] is not None), default=None) for s in range(args.steps)]
        checked = [s for s in range(SMOOTH, args.steps) if None not in (curve[s], lo[s], hi[s])]
        band = {
            "seeds": sorted(clean),
            **against_band(curve, lo, hi),
            "band_width_median": round(statistics.median(hi[s] - lo[s] for s in checked), 4) if checked else None,
            "final_loss_faulty": round(curve[-1], 4) if curve[-1] is not None else None,
            "final_loss_band": [round(lo[-1], 4), round(hi[-1], 4)] if lo[-1] is not None else None,
            # [Note: the band's control]
            "controls": {
                f"seed{seed}": against_band(smooth(loss_curve(run, args.steps)), lo, hi)
                for seed, run in sorted(controls.items())
            },
        }
    clean_rate = {f"seed{seed}": rate(commits(run, 0)) for seed, run in clean.items()}
    ratios = [v for f in fails for v in f["others_rate_ratio"].values()]
    away = [f["steps_away"] for f in fails]
    return {
        "finished": faulty["finished"],
        "kills": len(fails),
        "failures": fails,
        "steady_steps_per_min": steady,
        "no_failure_runs_steps_per_min": clean_rate,
        "worst_rate_ratio_during_failure": min(ratios) if ratios else None,
        "most_steps_away": max(away) if away else None,
        "rejoined": len(fails),  # failures() raises on a group that never came back
        "loss_band": band,
        "final_state": final_equal(faulty, groups, args.nproc),
    }


def table(result: dict) -> list[str]:
    """docs/multi_node.md's table of the kills, from a result file."""
    lines = [
        "| kill | group, rank | at step | back at step | steps away | seconds away "
        "| survivor's steps/min while away | / its steady rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, f in enumerate(result["failures"], 1):
        ((during, ratio),) = zip(f["others_steps_per_min_during"].values(), f["others_rate_ratio"].values())
        lines.append(
            f"| {i} | {f['group']}, {f['rank']} | {f['step']} | {f['back_at_step']} | {f['steps_away']} "
            f"| {f['seconds_away']:.1f} | {during:.1f} | {ratio:.2f} |"
        )
    return lines


def figures(result: dict) -> list[str]:
    """docs/multi_node.md's bullets under a run's table: every figure in them comes from the result file,
    and so does each comparison they state (which way it goes is read from the file, not written)."""
    fails, band = result["failures"], result["loss_band"]
    windows = [w for f in fails for w in f["others_window"].values()]
    ratios = [r for f in fails for r in f["others_rate_ratio"].values()]
    steady = statistics.mean(result["steady_steps_per_min"].values())
    away, secs = [f["steps_away"] for f in fails], [f["seconds_away"] for f in fails]
    broke, rejoin = [w["kill_step_s"] for w in windows], [w["rejoin_step_s"] for w in windows]
    (c3, c4), (lo, hi) = band["controls"].values(), band["final_loss_band"]
    seeds = ", ".join(map(str, band["seeds"][:-1])) + f" and {band['seeds'][-1]}"
    final = band["final_loss_faulty"]
    where = "above" if final > hi else "below" if final < lo else "inside"
    below = sum(band["largest_excursion"] < c["largest_excursion"] for c in (c3, c4))
    closer = {
        2: "stayed closer to the band than either run without failures",
        1: "left the band by more than one run without failures and by less than the other",
        0: "left the band by more than either run without failures",
    }[below]
    equal = all(
        r != "missing" and r["parameters_equal"] and r["optimizer_equal"] for r in result["final_state"].values()
    )
    return [
        f"* **The other group never stopped**: {result['kills']} kills in {result['config']['steps']} steps, and over "
        f"each kill's whole window the other group committed {min(ratios):.2f}–{max(ratios):.2f} of its steady rate "
        f"(about {steady:.0f} steps per minute). The step a kill broke took {min(broke):.2f}–{max(broke):.2f} s and "
        f"the rejoin's step {min(rejoin):.2f}–{max(rejoin):.2f} s, against a steady {60 / steady:.2f} s.",
        f"* **The killed group was back within {min(away)}–{max(away)} steps** ({min(secs):.1f}–{max(secs):.1f} s).",
        f"* **The loss curve** (seed {band['seeds'][0]}, with the {result['kills']} failures) is inside the band of "
        f"the no-failure runs of seeds {seeds} at {band['steps_inside']} of {band['steps_checked']} steps and at most "
        f"{band['largest_excursion']:.3f} outside it; the controls, without a failure, were inside at "
        f"{c3['steps_inside']} and {c4['steps_inside']} of {c4['steps_checked']} steps and up to "
        f"{c3['largest_excursion']:.3f} and {c4['largest_excursion']:.3f} outside, so the faulty curve {closer}. Its "
        f"last smoothed loss is {final:.4f}, {where} the band's [{lo:.4f}, {hi:.4f}].",
        f"* **After the last rejoin every replica {'holds' if equal else 'does NOT hold'} bitwise the same state** "
        f"(rank 0's and rank 1's parameter shards and AdamW state, by SHA-256, between the two groups at step "
        f"{result['config']['steps']}).",
    ]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", action="store_true", help="run on this machine's loopback (no namespaces, no root)")
    p.add_argument("--rate", default="1gbit", help="the link between the groups (cluster only)")
    p.add_argument("--groups", type=int, default=2)
    p.add_argument("--nproc", type=int, default=2, help="ranks per group")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--kill-every", type=int, default=20)
    p.add_argument(
        "--kill-jitter", type=float, default=0.8,
        help="seconds: each kill waits a delay drawn up to this ([Note: where a kill lands])",
    )  # fmt: skip
    p.add_argument("--settle", type=int, default=5, help="no kill sooner than N steps after every group is back")
    p.add_argument("--last-kill-margin", type=int, default=40, help="no kill in the last N steps (time to rejoin)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2], help="no-failure runs for the loss band")
    p.add_argument(
        "--control-seeds", type=int, nargs="*", default=[3, 4],
        help="no-failure runs checked against the band as the faulty run is ([Note: the band's control])",
    )  # fmt: skip
    p.add_argument("--preset", default="small")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument(
        "--lr",
        type=float,
        default=1e-2,
        help="AdamW's (at 3e-3 the loss sits on a plateau for a number "
        "of steps that varies from seed to seed, which the band would measure instead of training)",
    )
    p.add_argument("--front", default="fsdp", choices=["fsdp", "fully_shard"], help="flatshard's front end in a group")
    p.add_argument(
        "--step-sleep", type=float, default=0.5,
        help="idle seconds per step: stands in for compute, without the groups competing for this machine's cores",
    )  # fmt: skip
    p.add_argument("--max-restarts", type=int, default=30)
    p.add_argument("--collective-timeout", type=float, default=20.0)
    p.add_argument("--timeout", type=float, default=900.0, help="seconds per run")
    p.add_argument("--port", type=int, default=0, help="first of G + 1 ports (0: free ones)")
    p.add_argument("--log-dir", type=Path, default=None)
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "replica_faults.json")
    p.add_argument(
        "--table", action="store_true", help="print the table of --out's kills and the figures under it, run nothing"
    )
    p.add_argument(
        "--from-logs", type=Path, default=None,
        help="summarize the runs whose logs are in this directory (a --log-dir of an earlier run) again, run nothing",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.table:
        result = json.loads(args.out.read_text())
        print("\n".join(table(result)) + "\n\n" + "\n".join(figures(result)))
        return 0
    log_root = args.from_logs or args.log_dir or Path(tempfile.mkdtemp(prefix="replica_faults_"))
    print(f"logs under {log_root}", flush=True)

    def runs(nodes: list[Node]) -> tuple[dict, dict[int, dict], dict[int, dict]]:
        clean, controls = {}, {}
        for seed in args.seeds:
            print(f"no-failure run, seed {seed}", flush=True)
            clean[seed] = run_once(nodes, args, seed, kills=0, log_dir=log_root / f"clean{seed}")
        for seed in args.control_seeds:
            print(f"no-failure run, seed {seed} (a control: checked against the band)", flush=True)
            controls[seed] = run_once(nodes, args, seed, kills=0, log_dir=log_root / f"control{seed}")
        print(f"faulty run, seed {args.seeds[0]}: a rank killed every {args.kill_every} steps", flush=True)
        faulty = run_once(nodes, args, args.seeds[0], kills=args.steps, log_dir=log_root / "faulty")
        return faulty, clean, controls

    if args.from_logs is not None:
        faulty = load_run(args.from_logs / "faulty", args.groups, args.nproc)
        clean = {seed: load_run(args.from_logs / f"clean{seed}", args.groups, args.nproc) for seed in args.seeds}
        controls = {s: load_run(args.from_logs / f"control{s}", args.groups, args.nproc) for s in args.control_seeds}
        where = json.loads((args.from_logs / "where.json").read_text())
    elif args.local:
        if args.port == 0:
            args.port = free_ports(args.groups + 1)
        faulty, clean, controls = runs([Node("127.0.0.1") for _ in range(args.groups)])
        where = "localhost"
    else:
        why = unavailable()
        if why:
            print(f"the emulated cluster cannot run here: {why} (use --local)", file=sys.stderr)
            return 2
        args.port = args.port or 29510
        with Cluster(Topology(nodes=args.groups, nproc=args.nproc, rate_bits=parse_rate(args.rate))) as cluster:
            nodes = [
                Node(cluster.address(i), ["ip", "netns", "exec", ns], {"GLOO_SOCKET_IFNAME": "fs0"})
                for i, ns in enumerate(cluster.nodes)
            ]
            faulty, clean, controls = runs(nodes)
        where = f"emulated cluster, {args.rate} between groups"
    load = log_root / "load_average.json"  # the machine's load when the runs ended, kept for --from-logs
    if args.from_logs is None:
        load.write_text(json.dumps(os.getloadavg()) + "\n")
        (log_root / "where.json").write_text(json.dumps(where) + "\n")
    result = {
        "where": where,
        "config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "load_average": json.loads(load.read_text()) if load.exists() else None,
        **summarize(faulty, clean, args, controls),
    }
    print(json.dumps({k: v for k, v in result.items() if k != "config"}, indent=1))
    write_result(args.out, result)
    print("the survivors' rate over each kill's whole window, / the steady rate:")
    for i, f in enumerate(result["failures"], 1):
        print(f"  kill {i}: " + ", ".join(f"{g} {r:.2f}" for g, r in f["others_rate_ratio"].items()))
    print(f"wrote {args.out}")
    return 0


def write_result(path: Path, result: dict) -> None:
    """The result file: every write of bench/results/replica_faults.json goes through here."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(provenance.stamp(result), indent=1) + "\n")


if __name__ == "__main__":
    sys.exit(main())
