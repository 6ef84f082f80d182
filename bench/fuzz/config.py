"""The fuzzer's configurations (bench/fuzz/): ``draw(seed, index)`` is configuration ``index`` of the
master seed ``seed``, drawn from a generator of its own (so any one can be rerun alone), as a JSON-able
dict; ``--config`` takes the same dict back. Every knob is drawn where flatshard builds it; combinations
it refuses by design (NotBuiltError, ValueError) are not drawn, and one that is refused anyway is counted
apart, its message checked to name what was refused.
"""

from __future__ import annotations

import random

from bench.fuzz.models import module_names, trainable_names
from bench.fuzz.reference import groups_of

KINDS = ["mlp", "scale", "empty", "container", "buffer", "twice", "frozen"]
STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"]
HYBRIDS = ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _model(rng: random.Random, front: str) -> dict:
    kinds = KINDS + (["shared"] if front == "fsdp1" else [])  # a tie across fully_shard units is not FSDP2's
    spec = {"d": rng.choice([3, 5, 7]), "blocks": []}
    for _ in range(rng.randint(1, 3)):
        block = {"kind": rng.choice(kinds)}
        if block["kind"] in ("mlp", "frozen", "container"):
            block["h"] = rng.choice([5, 9, 11])
        spec["blocks"].append(block)
    if rng.random() < 0.5:
        spec.update(input="tokens", vocab=rng.choice([11, 13]), seq=3, tie=rng.random() < 0.5)
    else:
        spec.update(input="dense", d_in=rng.choice([4, 5, 6]), d_out=rng.choice([1, 2, 3]))
    names = trainable_names(spec)
    spec["frozen"] = rng.sample(names, 1) if rng.random() < 0.25 and names else []
    return spec


def _fsdp1_groups(rng: random.Random, world: int) -> dict:
    """strategy, F and how the groups are named, for the FSDP1 wrapper at ``world`` ranks. At W = 4 a third
    of the draws take the one shape shard_optimizer_across_replicas=True serves here (a hybrid, F = 2)."""
    if world == 4 and rng.random() < 0.3:
        strategy = rng.choice(HYBRIDS)
        groups = rng.choice(["sharding_factor", "device_mesh", "local_world_size"])
        return {"strategy": strategy, "F": 2, "groups": groups, "opt_across": True}
    strategy = rng.choice(STRATEGIES)
    if strategy == "NO_SHARD":
        return {"strategy": strategy, "F": 1, "groups": rng.choice(["default", "sharding_factor"]), "opt_across": False}
    F = rng.choice(divisors(world))
    if strategy in HYBRIDS:
        groups = rng.choice(["sharding_factor", "device_mesh", "local_world_size"])
    else:
        groups = "sharding_factor" if F != world or rng.random() < 0.3 else "default"
    across = strategy in HYBRIDS and 1 < F < world and rng.random() < 0.6
    return {"strategy": strategy, "F": F, "groups": groups, "opt_across": across}


def _fully_shard(rng: random.Random, world: int, cfg: dict) -> None:
    cfg["mesh"] = rng.choice(["default", "1d", "2d"])
    cfg["F"] = rng.choice(divisors(world)) if cfg["mesh"] == "2d" else world
    F = cfg["F"]
    choices = [True, False] + [g for g in divisors(F) if 1 < g < F]
    cfg["reshard_after_forward"] = [rng.choice(choices) for _ in cfg["units"]]
    cfg["act_ckpt"] = rng.choice([None, None, "apply_before", "inside"])
    cfg["explicit_prefetch"] = rng.random() < 0.25
    cfg["fsdp2"] = True
    # shard_placement_fn ([Note: sharded along another dim]): drawn from a generator of its own, so the
    # draws above (and every configuration drawn before it was added) stay as they were
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/placement")
    cfg["placement"] = own.choice(["dim0", "dim0", "last", "largest"])
    # tensor parallelism ([Note: FSDP over tensor-parallel parameters]): every MLP block's fc1 column-wise,
    # fc2 row-wise over 2 TP ranks, fully_shard over the data-parallel ranks; its own generator again
    tp = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/tp")
    has_mlp = any(b["kind"] in ("mlp", "frozen", "container") for b in cfg["model"]["blocks"])
    if world in (2, 4) and has_mlp and tp.random() < 0.7 and (cfg["mesh"] != "2d" or world == 4):
        cfg["tp"] = 2
        # the data-parallel ranks: a 1-D mesh, or HSDP's (replicate, shard) of 2 ranks beside TP
        cfg["F"] = world // 2 if cfg["mesh"] != "2d" else tp.choice([1, 2])
        cfg["reshard_after_forward"] = [a if a in (True, False) else True for a in cfg["reshard_after_forward"]]
    # MLP weights that gather themselves ([Note: parameters that gather themselves], bench/fuzz/gathers.py):
    # not beside TP (a DTensor parameter) or shard_placement_fn's other dims (refused by design); its own generator
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/gathers_itself")
    weights = [n for n in trainable_names(cfg["model"]) if n.endswith(("fc1.weight", "fc2.weight"))]
    if own.random() < 0.6 and weights and not cfg.get("tp") and cfg["placement"] == "dim0":
        cfg["gathers_itself"] = sorted(own.sample(weights, own.randint(1, len(weights))))


def _events(rng: random.Random, cfg: dict) -> list[dict]:
    spec, steps, events = cfg["model"], cfg["steps"], []
    if rng.random() < 0.3:
        events.append(
            {
                "kind": "raise",
                "step": rng.randrange(steps),
                "micro": rng.randrange(cfg["accum"]),
                "module": rng.choice(module_names(spec)),
                "phase": rng.choice(["forward", "backward"]),
                # fully_shard: the loop also calls the root's reset_iter_state() (FSDP2's recovery workflow)
                "reset": cfg["front"] == "fully_shard" and rng.random() < 0.5,
            }
        )
    names = trainable_names(spec) or ["wte.weight" if spec["input"] == "tokens" else "inp.weight"]
    if rng.random() < 0.25 and names[0] not in ("wte.weight", "inp.weight"):
        name = rng.choice(names)
        frozen = name in spec["frozen"] or _in_frozen_block(spec, name)
        events.append({"kind": "flip", "step": rng.randrange(1, steps), "param": name, "value": frozen})
    if rng.random() < (0.6 if cfg.get("opt_across") else 0.3):
        event = {"kind": "edit", "step": rng.randrange(1, steps), "param": rng.choice(names)}
        if rng.random() < 0.5:
            event.update(how="mul", factor=rng.choice([0.5, -1.0, 1.25]))
        else:
            event.update(how="copy", seed=rng.randrange(10**6))
        events.append(event)
    # drawn from a generator of its own, so every earlier configuration of a seed is drawn as before
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/skip")
    if own.random() < 0.2:
        # a non-finite loss skipped by the loop: no backward for it; zero_grad; the step is given up
        foreach = cfg["front"] == "fully_shard" and cfg["optim"]["impl"] != "plain"
        events.append(
            {
                "kind": "skip",
                "step": own.randrange(steps),
                "micro": own.randrange(cfg["accum"]),
                # zero_grad(set_to_none=False) of a foreach or fused optimizer leaves no trace on DTensor
                # gradients (README, "The loops people write"): drawn only where flatshard can see it
                "set_to_none": True if foreach else own.random() < 0.5,
            }
        )
    return events


def _in_frozen_block(spec: dict, name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "blocks" and spec["blocks"][int(parts[1])]["kind"] == "frozen"


def draw(seed: int, index: int) -> dict:
    rng = random.Random(f"flatshard-fuzz/{seed}/{index}")
    front = "fsdp1" if rng.random() < 0.55 else "fully_shard"
    world = rng.choice([1, 2, 2, 3, 3, 4, 4])
    cfg = {"seed": seed, "index": index, "W": world, "front": front, "init_seed": rng.randrange(10**6)}
    cfg["model"] = spec = _model(rng, front)
    n_blocks = len(spec["blocks"])
    cfg["units"] = [i for i in range(n_blocks) if rng.random() < 0.7]
    if front == "fsdp1":
        cfg["wrap"] = rng.choice(["classes", "lambda", "manual"])
        if cfg["wrap"] == "manual":  # a weight tied across units wrapped by hand is refused by design (ValueError)
            cfg["units"] = [i for i in cfg["units"] if spec["blocks"][i]["kind"] != "shared"]
        present = sorted({b["kind"] for b in spec["blocks"]})
        cfg["wrap_classes"] = [k for k in present if rng.random() < 0.7]
        cfg.update(_fsdp1_groups(rng, world))
        cfg["backward_prefetch"] = rng.choice(["BACKWARD_PRE", "BACKWARD_POST", None])
        cfg["forward_prefetch"] = rng.random() < 0.5
        cfg["limit_all_gathers"] = rng.random() < 0.5
        cfg["act_ckpt"] = rng.choice([None, None, None, "apply_before", "apply_after", "inside"])
    else:
        _fully_shard(rng, world, cfg)
    cfg["mp"] = {"param": "bf16", "reduce": rng.choice(["fp32", "bf16"])} if rng.random() < 0.3 else None
    cfg["accum"] = rng.choice([1, 1, 2, 3])
    cfg["micro"] = rng.choice([2, 3])
    cfg["steps"] = rng.choice([3, 4])
    cfg["optim"] = {"kind": rng.choice(["sgd", "adamw", "adam"]), "impl": rng.choice(["plain", "foreach", "fused"])}
    if cfg.get("opt_across") and rng.random() < 0.5:  # fused steps bypass what a for-loop step does
        cfg["optim"]["impl"] = "fused"
    if front == "fully_shard" and cfg["optim"] == {"kind": "sgd", "impl": "fused"}:
        cfg["optim"]["impl"] = "foreach"  # DTensor has no sharding rule for aten._fused_sgd_ (torch 2.13)
    cfg["clip"] = 0.5 if rng.random() < 0.2 else None
    cfg["events"] = _events(rng, cfg)
    if cfg["optim"] == {"kind": "sgd", "impl": "fused"} and any(e.get("value") is True for e in cfg["events"]):
        # torch's fused SGD fails on a parameter whose first gradient comes after the first step (a momentum
        # buffer list holding None: "expected Tensor as element 1 in argument 2"), wrapped or not
        cfg["optim"]["impl"] = "foreach"
    cfg["ckpt"] = None
    if front == "fsdp1" and rng.random() < 0.2:
        other = rng.choice([w for w in (1, 2, 3, 4) if w != world])
        cfg["ckpt"] = {"after_step": rng.randrange(cfg["steps"] - 1), "W": other, **_fsdp1_groups(rng, other)}
    if front == "fully_shard":
        _fully_shard_later(cfg)
    if cfg["mp"] and cfg["mp"]["reduce"] == "bf16" and _addends(cfg) >= 3:
        # a bf16 sum of 3 or more addends rounds by its order, which differs by shard (and gloo's for an
        # all-reduce): ([Note: a reference that rounds as the ranks do], reference.py): its reduce dtype is fp32
        cfg["mp"]["reduce"] = "fp32"
    return cfg


def _fully_shard_later(cfg: dict) -> None:
    """What ``fully_shard`` gained after the draws above were fixed, each from a generator of its own (so
    every configuration drawn before keeps its draws where the new knob is not taken):
    * ``shard_optimizer_across_replicas=True`` ([Note: optimizer state across replicas on fully_shard]) on
      HSDP's 2x2 mesh (both dims > 1; the only such mesh at W <= 4); not beside TP, another shard dim or
      parameters that gather themselves, and with bool ``reshard_after_forward`` only (refused by design
      otherwise);
    * ``shard_boundaries="params"`` ([Note: whole parameters on fully_shard]): each parameter whole on one
      rank, on a 1-D mesh, under the same exclusions; the optimizer's for-loop step (each parameter is on a
      mesh of its own, which foreach and fused kernels do not take);
    * a frozen block in float64 beside the fp32 parameters (a flat group per dtype); not beside TP or a
      weight that gathers itself, and not where an event unfreezes it (trainable parameters of two dtypes
      in one call are refused, as FSDP2 refuses them).
    Not drawn: parameters on a mesh of their own (``ShardPlacementResult``). A parameter reduced over fewer
    ranks than the batch is split over trains another model than the single-process reference, unless the
    model is expert-parallel (each rank's experts its own, tokens exchanged by the model): that layout is
    held against PyTorch's FSDP2 by tests/test_moe.py and tests/test_mesh_groups.py instead."""
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/opt_across")
    plain = not cfg.get("tp") and cfg.get("placement", "dim0") == "dim0" and not cfg.get("gathers_itself")
    if cfg["W"] == 4 and plain and own.random() < 0.6:  # both dims of the mesh > 1: (2, 2) at W <= 4
        cfg["mesh"], cfg["F"] = "2d", 2
        cfg["opt_across"] = True
        cfg["reshard_after_forward"] = [a if a in (True, False) else True for a in cfg["reshard_after_forward"]]
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/whole")
    if cfg["W"] > 1 and cfg["mesh"] != "2d" and plain and not cfg.get("opt_across") and own.random() < 0.5:
        cfg["whole"] = True
        cfg["reshard_after_forward"] = [a if a in (True, False) else True for a in cfg["reshard_after_forward"]]
        cfg["optim"]["impl"] = "plain"  # foreach and fused kernels take tensors of one mesh; each is on its own
    own = random.Random(f"flatshard-fuzz/{cfg['seed']}/{cfg['index']}/fp64")
    spec = cfg["model"]
    flipped = {e["param"] for e in cfg["events"] if e["kind"] == "flip"}
    for i, block in enumerate(spec["blocks"]):
        mine = {f"blocks.{i}.fc{k}.{w}" for k in (1, 2) for w in ("weight", "bias")}
        taken = mine & (flipped | set(cfg.get("gathers_itself", [])))
        if block["kind"] == "frozen" and not cfg.get("tp") and not taken and own.random() < 0.6:
            block["dtype"] = "fp64"
            break


def _addends(cfg: dict) -> int:
    """The most addends of any sum of a reduction in any phase of ``cfg`` (reference.groups_of)."""
    phases = [(cfg, cfg["W"])] + ([({**cfg, **cfg["ckpt"]}, cfg["ckpt"]["W"])] if cfg.get("ckpt") else [])
    return max(max(groups_of(c, w)) for c, w in phases)


def summary(cfg: dict) -> str:
    """The knobs of a configuration in one short line."""
    parts = [f"W={cfg['W']}", cfg["front"]]
    if cfg["front"] == "fsdp1":
        parts += [cfg["strategy"], f"F={cfg['F']}({cfg['groups']})", f"wrap={cfg['wrap']}"]
        parts += ["opt_across"] if cfg.get("opt_across") else []
        parts += ["whole"] if cfg.get("whole") else []
    else:
        parts += [f"mesh={cfg['mesh']}", f"F={cfg['F']}", f"raf={cfg['reshard_after_forward']}"]
        if cfg.get("placement", "dim0") != "dim0":
            parts.append(f"shard={cfg['placement']}")
        if cfg.get("tp"):
            parts.append(f"tp={cfg['tp']}")
        if cfg.get("gathers_itself"):
            parts.append(f"gathers_itself={len(cfg['gathers_itself'])}")
        parts += ["opt_across"] if cfg.get("opt_across") else []
        parts += ["whole"] if cfg.get("whole") else []
    units = cfg["wrap_classes"] if cfg.get("wrap") == "classes" else cfg["units"]
    kinds = [b["kind"] + ("/fp64" if b.get("dtype") == "fp64" else "") for b in cfg["model"]["blocks"]]
    parts.append("blocks=" + ",".join(kinds) + f" units={units}")
    if cfg.get("mp"):
        parts.append(f"bf16/reduce {cfg['mp']['reduce']}")
    parts.append(f"{cfg['optim']['kind']}-{cfg['optim']['impl']} accum={cfg['accum']}")
    if cfg.get("act_ckpt"):
        parts.append(f"act={cfg['act_ckpt']}")
    for e in cfg["events"]:
        parts.append(f"{e['kind']}@{e['step']}" + (f":{e['module']}/{e['phase']}" if e["kind"] == "raise" else ""))
        parts[-1] += "" if e["kind"] != "skip" or e["set_to_none"] else "/zeros"
    if cfg.get("ckpt"):
        c = cfg["ckpt"]
        parts.append(f"ckpt@{c['after_step']}->W={c['W']} {c['strategy']} F={c['F']}")
    return " ".join(parts)
