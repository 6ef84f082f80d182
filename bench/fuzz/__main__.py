"""A differential fuzzer for flatshard: random small configurations, each trained step by step beside the
unwrapped single-process reference on the global batch (and, for ``fully_shard``, beside PyTorch's own
FSDP2), comparing the loss, every gradient, every parameter after the step and every buffer.

    python -m bench.fuzz -n 200                  # configurations 0..199 of master seed 0 (make fuzz N=200)
    python -m bench.fuzz --seed 3 --index 17 42  # only those, e.g. to rerun a failure
    python -m bench.fuzz --config '{"W": 3, "front": "fsdp1", ...}'   # one configuration as printed by --show

What a configuration draws (config.py): the model (models.py: odd sizes, ties, frozen
parameters, 1-element and 1-D parameters, empty units, buffers, a module run twice), the front end and
its wrapping, the strategy, W and F, shard_optimizer_across_replicas (both front ends), whole parameters
(``shard_boundaries="params"`` on fully_shard), a frozen float64 block, mixed precision, prefetching,
gradient accumulation, activation checkpointing, the optimizer, clipping, and events: an exception
injected in forward or backward and skipped by the loop, a parameter's requires_grad flipped, a
parameter edited in place, a checkpoint loaded at another W. Ranks are real processes (pool.py:
spawned, gloo, a file store, a timeout per configuration after which the pool is killed). A failure
prints one line that reruns it and the first mismatch; the end prints a table; the exit status is 1
when any configuration failed. A benchmark, not a test: tests/test_fuzz.py runs a few fixed ones.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench import provenance
from bench.cluster.jobs import source_commit
from bench.fuzz import config, pool, worker

# words a refusal must name: what the configuration asked for that flatshard does not build
REFUSAL_WORDS = (
    "shard_optimizer_across_replicas",
    "sharding_factor",
    "device_mesh",
    "mesh",
    "reshard_after_forward",
    "LOCAL_WORLD_SIZE",
    "process group",
    "MixedPrecision",
    "mp_policy",
    "fused",
    "foreach",
    "requires_grad",
)


def _verdict(outcomes: dict, world: int, timeout: float) -> dict:
    """One phase's result from every rank's outcome: status pass / refused / fail, and what failed."""
    missing = sorted(set(range(world)) - set(outcomes))
    errors = {r: p for r, (s, p) in outcomes.items() if s == "error"}
    if errors:
        rank = min(errors)
        lines = [ln for ln in errors[rank].strip().splitlines() if ln.strip()]
        kind = "error: " + lines[-1].split(": ", 1)[-1][:70]
        return {"status": "fail", "kind": kind, "detail": f"rank {rank}: {lines[-1]}", "trace": errors[rank]}
    if missing:
        return {"status": "fail", "kind": "hang", "detail": f"ranks {missing} gave nothing within {timeout:.0f} s"}
    results = [outcomes[r][1] for r in range(world)]
    refusals = {r.get("refused") for r in results}
    if refusals != {None}:
        if len(refusals) != 1:
            return {"status": "fail", "kind": "refusal differs by rank", "detail": str(sorted(map(str, refusals)))}
        message = refusals.pop()
        named = any(word in message for word in REFUSAL_WORDS)
        if not named:
            return {"status": "fail", "kind": "refusal names nothing drawn", "detail": message}
        return {"status": "refused", "kind": message.split(":")[0], "detail": message}
    notes = []
    witnesses = [r["fsdp2_vs_reference"] for r in results if r.get("fsdp2_vs_reference")]
    witness = min(witnesses, key=lambda m: m["step"], default=None)
    if witness:
        notes.append(f"PyTorch FSDP2 itself differs from the reference: {_mismatch(0, witness)}")
    if results[0].get("fsdp2_error"):
        notes.append(f"compared with PyTorch FSDP2 up to step {results[0]['fsdp2_until']}: {results[0]['fsdp2_error']}")
    firsts = [(r, res["mismatch"]) for r, res in enumerate(results) if res["mismatch"]]
    bitwise = _bitwise(results)
    fsdp2_wrong = witness is not None and all(
        o["against"] == "fsdp2" and o["step"] >= witness["step"] for r in results for o in r["mismatches"].values()
    )
    if firsts and fsdp2_wrong:  # flatshard equals the reference; PyTorch's FSDP2 is the one that differs
        notes.append("flatshard differs only from PyTorch FSDP2, which differs from the reference: not counted")
        margins = {k: v for k, v in _margins(results).items() if not k.startswith("tight")}
        return {"status": "pass", "bitwise": bitwise, "notes": notes, "margins": margins, "fsdp2_wrong": True}
    if firsts:
        rank, m = min(firsts, key=lambda rm: (rm[1]["step"], rm[1]["order"], rm[0]))
        others = [(r, o) for r, res in enumerate(results) for o in res["mismatches"].values()]
        for against in sorted({o["against"] for _, o in others} - {m["against"]}):
            r, o = min(((r, o) for r, o in others if o["against"] == against), key=lambda ro: (ro[1]["step"], ro[0]))
            notes.append(f"first against {against}: {_mismatch(r, o)}")
        kind = f"{m['what'].split(' ')[0]} vs {m['against']}"
        verdict = {"status": "fail", "kind": kind, "detail": _mismatch(rank, m), "bitwise": bitwise, "notes": notes}
        return {**verdict, "margins": _margins(results)}
    return {"status": "pass", "bitwise": bitwise, "notes": notes, "margins": _margins(results)}


def _bitwise(results: list) -> dict:
    """Steps compared with PyTorch's FSDP2; those where every rank's losses, gradients and parameters were
    bitwise equal to it; and how many of them were held to that ([Note: fuzz tolerances])."""
    per_rank = [r.get("bitwise_steps", []) for r in results]
    steps = min(len(s) for s in per_rank)
    equal = sum(all(s[i] for s in per_rank) for i in range(steps))
    return {"steps": steps, "equal": equal, "held": steps if results[0].get("bitwise_held") else 0}


def _margins(results: list) -> dict:
    out: dict = {}
    for res in results:
        for key, value in res.get("margins", {}).items():
            out[key] = max(out.get(key, 0.0), value)
    return out


def _mismatch(rank: int, m: dict) -> str:
    return (
        f"rank {rank} step {m['step']} {m['what']} {m['name']} vs {m['against']}: "
        f"max abs diff {m['max_abs_diff']:.3g} ({m['detail']})"
    )


def run_config(pools: pool.Pools, cfg: dict, timeout: float) -> dict:
    ckpt = cfg.get("ckpt")
    if not ckpt:
        outcomes = pools.get(cfg["W"]).run(worker.run, (cfg, "whole", None), timeout)
        return _verdict(outcomes, cfg["W"], timeout)
    tmp = tempfile.mkdtemp(prefix="fuzz-ckpt-")
    try:
        path = os.path.join(tmp, "ckpt")
        first = _verdict(pools.get(cfg["W"]).run(worker.run, (cfg, "A", path), timeout), cfg["W"], timeout)
        if first["status"] != "pass":
            return first
        second = pools.get(ckpt["W"]).run(worker.run, (cfg, "B", path), timeout)
        return _verdict(second, ckpt["W"], timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def repro(cfg: dict) -> str:
    if "index" in cfg and cfg == config.draw(cfg["seed"], cfg["index"]):
        return f"python -m bench.fuzz --seed {cfg['seed']} --index {cfg['index']}"
    return f"python -m bench.fuzz --config '{json.dumps(cfg, separators=(',', ':'))}'"


def write_json(path: Path, summary: dict) -> None:
    """The run's record, the one place the fuzzer writes a result file."""
    path.write_text(json.dumps(provenance.stamp(summary), indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.fuzz", description=__doc__.split("\n\n")[0])
    parser.add_argument("-n", "--count", type=int, default=20, help="configurations 0..N-1 of the master seed")
    parser.add_argument("--seed", type=int, default=0, help="the master seed")
    parser.add_argument("--index", type=int, nargs="+", help="run only these configurations of the master seed")
    parser.add_argument("--config", action="append", help="a configuration as JSON (repeatable)")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per configuration (per phase)")
    parser.add_argument("--show", action="store_true", help="print each configuration's JSON before running it")
    parser.add_argument("--trace", action="store_true", help="print a failing rank's whole traceback")
    parser.add_argument(
        "--margins", action="store_true", help="print each configuration's closest approach to its tolerances"
    )
    parser.add_argument("--json", type=Path, help="also write the end's table to this file (bench/results/fuzz.json)")
    args = parser.parse_args(argv)
    if args.config:
        configs = [json.loads(c) for c in args.config]
    else:
        indices = args.index if args.index is not None else range(args.count)
        configs = [config.draw(args.seed, i) for i in indices]
    pools = pool.Pools()
    tally, kinds, bitwise = collections.Counter(), collections.Counter(), collections.Counter()
    failures: list[str] = []
    failing_indices: list[int] = []
    fsdp2_off: list[int] = []  # indices of configurations where PyTorch FSDP2 itself is off the reference
    margins: dict = collections.defaultdict(lambda: (0.0, -1))  # tolerance -> (largest diff / bound, index)
    start = time.perf_counter()
    try:
        for k, cfg in enumerate(configs):
            if args.show:
                print(json.dumps(cfg, separators=(",", ":")), flush=True)
            t0 = time.perf_counter()
            verdict = run_config(pools, cfg, args.timeout)
            tally[verdict["status"]] += 1
            bw = verdict.get("bitwise") or {}
            bitwise["steps"] += bw.get("steps", 0)
            bitwise["equal"] += bw.get("equal", 0)
            bitwise["held"] += bw.get("held", 0)
            bitwise["fsdp2 wrong"] += bool(verdict.get("fsdp2_wrong"))
            if verdict.get("fsdp2_wrong"):
                fsdp2_off.append(cfg.get("index", -1))
            for key, value in verdict.get("margins", {}).items():
                margins[key] = max(margins[key], (value, cfg.get("index", -1)))
            status = verdict["status"].upper()
            print(f"[{k + 1}/{len(configs)}] {status:7s} {time.perf_counter() - t0:5.1f}s  {config.summary(cfg)}")
            if args.margins and verdict.get("margins"):
                print("    margins: " + ", ".join(f"{k} {v:.2f}" for k, v in sorted(verdict["margins"].items())))
            if verdict["status"] == "refused":
                kinds[f"refused: {verdict['kind']}"] += 1
                print(f"    refused: {verdict['detail']}")
            elif verdict["status"] == "fail":
                kinds[verdict["kind"]] += 1
                failures.append(f"{repro(cfg)}   # {verdict['kind']}")
                failing_indices.append(cfg.get("index", -1))
                print(f"    FAIL {repro(cfg)}")
                print(f"    first mismatch: {verdict['detail']}", flush=True)
                if args.trace and "trace" in verdict:
                    print(verdict["trace"])
            for note in verdict.get("notes", ()):
                print(f"    note: {note}", flush=True)
    finally:
        pools.close()
    wall = time.perf_counter() - start
    print(f"\n{'configurations':34s} {len(configs):6d}")
    for status in ("pass", "refused", "fail"):
        print(f"{status if status != 'fail' else 'failed':34s} {tally[status]:6d}")
    for kind, n in sorted(kinds.items(), key=lambda kv: -kv[1]):
        print(f"  {kind[:60]:60s} {n:4d}")
    if bitwise["steps"]:
        print(f"{'steps bitwise equal to FSDP2':34s} {bitwise['equal']:6d} of {bitwise['steps']} compared", end="")
        print(
            f" on every rank: losses, gradients, parameters ({bitwise['held']} held to it: fp32, at most two addends)"
        )
    if bitwise["fsdp2 wrong"]:
        print(f"{'PyTorch FSDP2 off the reference':34s} {bitwise['fsdp2 wrong']:6d} (flatshard on it; not counted)")
    for key, (value, index) in sorted(margins.items()):
        print(f"  closest to the {key} tolerance: {value:.2f} of it (index {index})")
    print(f"{'wall time':34s} {wall:6.0f} s")
    if args.json:
        summary = {
            "command": "python -m bench.fuzz " + " ".join(sys.argv[1:] if argv is None else argv),
            "commit": source_commit(),
            "configurations": len(configs),
            "pass": tally["pass"],
            "refused": tally["refused"],
            "failed": tally["fail"],
            "kinds": dict(kinds),
            "steps_compared_to_fsdp2": bitwise["steps"],
            "steps_bitwise_equal_to_fsdp2": bitwise["equal"],
            "steps_held_bitwise": bitwise["held"],
            "fsdp2_off_the_reference": bitwise["fsdp2 wrong"],
            "fsdp2_off_the_reference_indices": fsdp2_off,
            "mixed_precision": sum(bool(c.get("mp")) for c in configs),
            "mixed_precision_fsdp1": sum(bool(c.get("mp")) and c["front"] == "fsdp1" for c in configs),
            "wall_s": round(wall, 1),
            "failing": failures,
            "failing_indices": failing_indices,
        }
        write_json(args.json, summary)
    if failures:
        print("\nfailing configurations, one line each to rerun:")
        print("\n".join(failures))
    return 1 if tally["fail"] else 0


if __name__ == "__main__":
    sys.exit(main())
