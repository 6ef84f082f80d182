"""``python -m bench.frameworks``: bench/results/frameworks.json, from every recipe of examples/frameworks/ run
with ``--compare --json`` (as tests/test_frameworks.py's ``run_recipe`` runs them), one key per run, stamped
by bench/provenance.py.

Each recipe starts its own ranks (W = 2 on CPU, gloo) and writes what it compared: lightning and accelerate
each rank's loss per batch on PyTorch's FSDP2, on flatshard's ``fully_shard`` and on flatshard saved half
way and resumed; lightning_muon (and lightning_muon_lightning_checkpoint, the same with Lightning's own
checkpoint) Muon + AdamW on whole matrices against one process; torchtitan (the llama3 debug model) and
torchtitan_moe (the deepseek_v3 MoE debug model, EP = 1) and torchtitan_moe_ep2 (the same, EP = 2) (loss,
gradient norm) per step.
Every recipe imports this checkout's src/ (``PYTHONPATH``), checked before it runs.

A framework the interpreter that would run it cannot import is recorded as not run, with the reason; nothing
of an earlier run is carried forward. torchtitan imports triton, which the project's environment does not
hold: ``--torchtitan-python`` names an interpreter that has both (a throwaway venv over the same torch,
for example); without it, this one is asked. Exit status 1 when a recipe that ran failed or found its runs
unequal (the file is written either way).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench import provenance

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "frameworks"
OUT = ROOT / "bench" / "results" / "frameworks.json"
TIMEOUT_S = 600

# key, recipe, its arguments after --compare --json out.json ("{dir}": a fresh temporary directory),
# the distributions whose versions are recorded (the framework's first), the module that must import
RUNS = (
    ("lightning", "lightning_fully_shard.py", ("--ckpt", "{dir}"), ("lightning",), "lightning"),
    ("lightning_muon", "lightning_muon.py", ("--ckpt", "{dir}"), ("lightning",), "lightning"),
    (
        "lightning_muon_lightning_checkpoint",
        "lightning_muon.py",
        ("--checkpoint", "lightning", "--ckpt", "{dir}"),
        ("lightning",),
        "lightning",
    ),
    ("accelerate", "accelerate_fully_shard.py", (), ("accelerate",), "accelerate"),
    (
        "torchtitan",
        "torchtitan_fully_shard.py",
        ("--steps", "6", "--dir", "{dir}"),
        ("torchtitan", "triton"),
        "torchtitan.trainer",
    ),
    (
        "torchtitan_moe",
        "torchtitan_fully_shard.py",
        ("--model", "deepseek_v3", "--steps", "4", "--dir", "{dir}"),
        ("torchtitan", "triton"),
        "torchtitan.trainer",
    ),
    (
        "torchtitan_moe_ep2",
        "torchtitan_fully_shard.py",
        ("--model", "deepseek_v3", "--ep", "2", "--steps", "4", "--dir", "{dir}"),
        ("torchtitan", "triton"),
        "torchtitan.trainer",
    ),
)
WHAT = (
    "examples/frameworks/*, each run with --compare at W = 2 CPU ranks over gloo, fp32, by python -m bench.frameworks. "
    "lightning, accelerate: runs[name][rank][batch] = that rank's loss on PyTorch's FSDP2 (FSDP2), flatshard's "
    "fully_shard (flatshard), and flatshard saved half way with the framework's checkpointing, loaded into a fresh "
    "run and resumed (flatshard saved+resumed). lightning_muon: Lightning's ModelParallelStrategy with "
    'torch.optim.Muon (the blocks\' matrices) + AdamW on fully_shard(shard_boundaries="params"), saved half way with '
    "flatshard.checkpoint through the strategy (lightning_muon_lightning_checkpoint: Lightning's own checkpoint), "
    "runs[name][rank][batch] against one process replaying every rank's batches (single process), bitwise. "
    "torchtitan (llama3's debug model, 6 steps), torchtitan_moe (deepseek_v3's MoE debug model through torchtitan's "
    "parallelize_fn at EP = 1, 4 steps; torchtitan_moe_ep2 the same at EP = 2: the routed experts DTensors on the "
    "ep mesh, placed on the efsdp mesh; placements: how each run held an expert and an attention weight): "
    "runs[name][step] = [loss summed over ranks as torchtitan logs it, gradient norm]. A run not made on this "
    "machine has run: false and the reason."
)


def _env() -> dict[str, str]:
    """This checkout's src/ first on the recipes' path (an installed flatshard may be another checkout's)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), str(ROOT), *filter(None, [env.get("PYTHONPATH")])])
    return env


def _probe(python: str, module: str, dists: tuple[str, ...]) -> dict:
    """Whether ``python`` imports ``module`` and this checkout's flatshard; the versions of ``dists`` and torch."""
    code = (
        "import importlib, importlib.metadata as m, json, torch, flatshard\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps({{'versions': {{d: m.version(d) for d in {list(dists)!r}}}, 'torch': torch.__version__, "
        "'flatshard': flatshard.__file__}))"
    )
    try:
        out = subprocess.run(
            [python, "-c", code], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return {"error": f"{python}: {exc}"}
    if out.returncode:
        lines = out.stderr.strip().splitlines()
        return {"error": lines[-1] if lines else f"{python} exited {out.returncode}"}
    found = json.loads(out.stdout.strip().splitlines()[-1])
    if not Path(found["flatshard"]).resolve().is_relative_to(ROOT / "src"):
        return {"error": f"{python} imports flatshard from {found['flatshard']}, not this checkout's src/"}
    return found


def _launch(cmd: list[str]) -> tuple[int, str, float]:
    """Run a recipe that starts its own ranks, in a session of its own (a hang is ended with all of them)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        log, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        return -1, log + f"\n(killed after {TIMEOUT_S} s)", time.monotonic() - start
    return proc.returncode, log, time.monotonic() - start


def run_one(key: str, recipe: str, args: tuple[str, ...], dists: tuple[str, ...], module: str, python: str) -> dict:
    shown = ["python", f"examples/frameworks/{recipe}", "--compare", "--json", "out.json"]
    shown += [a.replace("{dir}", "DIR") for a in args]
    entry: dict = {"command": shlex.join(shown)}
    probe = _probe(python, module, dists)
    if "error" in probe:
        print(f"{key}: not run ({probe['error']})", flush=True)
        return entry | {"run": False, "reason": f"{module} does not import here: {probe['error']}"}
    versions = probe["versions"]
    entry |= {"run": True, "version": versions[dists[0]]}
    entry |= {f"{d}_version": v for d, v in versions.items() if d != dists[0]}
    if python != sys.executable:
        entry["interpreter"] = f"another Python ({python}) with torch {probe['torch']}"
    with tempfile.TemporaryDirectory(prefix=f"flatshard-{key}-") as tmp:
        out = Path(tmp) / "out.json"
        work = Path(tmp) / "work"
        cmd = [python, str(RECIPES / recipe), "--compare", "--json", str(out)]
        cmd += [a.replace("{dir}", str(work)) for a in args]
        code, log, seconds = _launch(cmd)
        figures = json.loads(out.read_text()) if out.exists() else None
    print(f"{key}: exit {code} in {seconds:.0f} s; equal: {figures and figures.get('equal')}", flush=True)
    entry |= {"exit_status": code, "wall_s": round(seconds, 1)}
    if figures is None:
        return entry | {"equal": False, "log_tail": log[-3000:]}
    return entry | figures


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--torchtitan-python", default=sys.executable, help="an interpreter with torchtitan and triton")
    p.add_argument("--only", nargs="*", choices=[r[0] for r in RUNS], help="these runs only (a partial file)")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    report: dict = {"what": WHAT, "torch": torch.__version__, "python": platform.python_version()}
    for key, recipe, run_args, dists, module in RUNS:
        if args.only and key not in args.only:
            continue
        python = args.torchtitan_python if key.startswith("torchtitan") else sys.executable
        report[key] = run_one(key, recipe, run_args, dists, module, python)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(provenance.stamp(report), indent=1) + "\n")
    failed = [k for k, v in report.items() if isinstance(v, dict) and v.get("run") and not v.get("equal")]
    print(f"wrote {args.out}; " + (f"FAILED or unequal: {failed}" if failed else "every run that ran is equal"))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
