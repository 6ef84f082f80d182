"""Every NotBuiltError flatshard can raise is in docs/reference/status.md's table, in its not-built column,
and the ones that table once left out raise it.

Each place in src/flatshard that builds a NotBuiltError is found from the source (ast: the function
around the call), and NOT_BUILT names, per function and in source order, the words of the page's
not-built column that cover each one. A new place, one removed or one moved to another function fails
here until this map, and with it the page, says so."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import torch
from torch import nn

from tests.helpers.dist import run_distributed

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "flatshard"

# (file under src/flatshard, function) -> what the status page's not-built column says of each NotBuiltError
# built there, in source order
NOT_BUILT = {
    ("fsdp.py", "FullyShardedDataParallel._fqn_modifiers"): [
        "`torch.distributed.checkpoint.state_dict`'s functions on `FullyShardedDataParallel`"
    ],
    ("fsdp.py", "FullyShardedDataParallel.optim_state_dict_to_load"): [
        "`optim_state_dict_to_load(is_named_optimizer=True)`"
    ],
    ("fsdp.py", "FullyShardedDataParallel._deprecated_optim.method"): ["the deprecated `full_optim_state_dict`"],
    ("fsdp.py", "FullyShardedDataParallel.register_comm_hook"): ["`register_comm_hook`"],
    ("fsdp2/module.py", "_not_built.method"): ["FSDP2's `set_symm_mem_for_comm` and kin"],
    ("fsdp2/module.py", "FSDPModule.set_requires_all_reduce"): [
        "`set_requires_all_reduce(False)` (under HSDP)",
        "and `set_requires_all_reduce(False)` on such a module",
    ],
    ("fsdp2/module.py", "FSDPModule.set_all_reduce_hook"): [
        "`set_all_reduce_hook(stream=...)`",
        "`set_all_reduce_hook` on a module whose parameters gather themselves",
    ],
    ("fsdp2/module.py", "FSDPModule.set_allocate_memory_from_process_group_for_comm"): [
        "`set_allocate_memory_from_process_group_for_comm(True)` on a backend with its own allocator"
    ],
    ("fsdp2/module.py", "_set_custom"): [
        "`set_custom_all_gather` / `set_custom_reduce_scatter` on a module whose parameters gather themselves"
    ],
    ("fsdp2/checks.py", "check_no_all_gather_extension"): [
        "an all-gather extension set on the local tensor of a plain parameter after `fully_shard`"
    ],
    ("fsdp2/extensions.py", "SelfGathered._pre_all_gather"): [
        "a tensor subclass parameter without `fsdp_pre_all_gather`"
    ],
    ("fsdp2/extensions.py", "attach"): [
        "`shard_placement_fn` returning other than `Shard(0)` for them",
        "on a 2-D mesh without dim names",
        "such parameters under `CPUOffloadPolicy`",
    ],
    ("fsdp2/tensor_parallel.py", "tensor_parallel_params"): [
        "DTensor parameters of a tensor-parallel mesh of more than one dim"
    ],
    ("fsdp2/checks.py", "mesh_of"): [
        "`ShardPlacementResult` with an `HSDPMeshInfo` that shards its dim 0",
        "with an `FSDPMeshInfo` over a mesh of more than one dim",
    ],
    ("fsdp2/frontend.py", "_check_other_meshes"): [
        "parameters on a mesh of their own beside parameters that gather themselves or an int `reshard_after_forward`"
    ],
    ("fsdp2/spmd.py", "check_params"): ["`Partial` parameters under `dp_mesh_dims`"],
    ("fsdp2/whole.py", "wanted"): ['`shard_boundaries="flat"` / `"rows"` on `fully_shard`'],
    ("fsdp2/whole.py", "check"): [
        '`"params"` on `fully_shard` with a 2-D (HSDP) mesh',
        "meta parameters, `shard_placement_fn`, an int `reshard_after_forward`, tensor-parallel or self-gathering",
        "`CPUOffloadPolicy` on an accelerator",
    ],
    ("fsdp2/frontend.py", "_check_across_replicas"): [
        "on `fully_shard` with `compress_inter_node`, parameters on a mesh of their own, tensor-parallel parameters"
    ],
    ("interop.py", "_mixed_precision"): ["`MixedPrecision(_module_classes_to_ignore=...)`"],
    ("runtime/build/units.py", "become_root"): ["units under one root with different process groups"],
    ("runtime/build/units.py", "owner_ranks"): [
        'with `shard_boundaries` other than `"flat"`, `cpu_offload`, `compress_inter_node`'
    ],
    ("runtime/comm/int8.py", "check"): ['`compress_inter_node="int8"` off gloo\'s CPU exchanges', "8 or more replicas"],
    ("runtime/build/optim_check.py", "_before_step"): ["optimizers that read whole tensors"],
    ("state/model_view.py", "model_view"): [
        "flatshard's state dicts and `flatshard.checkpoint` on `fully_shard` through the wrapper's state-dict views"
    ],
    ("wrap.py", "CustomPolicy.__call__"): ["`CustomPolicy` returning per-module keyword overrides"],
}


def _not_built_sites() -> dict[tuple[str, str], int]:
    """(file, function) -> how many calls build a NotBuiltError there."""
    sites: dict[tuple[str, str], int] = {}

    def visit(node: ast.AST, path: str, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, path, [*scope, child.name])
                continue
            if isinstance(child, ast.Call):
                f = child.func
                if (f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)) == "NotBuiltError":
                    key = (path, ".".join(scope))
                    sites[key] = sites.get(key, 0) + 1
            visit(child, path, scope)

    for file in sorted(SRC.rglob("*.py")):
        visit(ast.parse(file.read_text()), file.relative_to(SRC).as_posix(), [])
    return sites


STATUS = ROOT / "docs" / "reference" / "status.md"


def _status_not_built_column() -> str:
    text = STATUS.read_text()
    table = text[text.index("## The table") :]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| built |")]
    return "\n".join(row.strip().strip("|").split(" | ")[-1] for row in rows)


def test_every_not_built_error_is_in_the_status_table():
    sites = _not_built_sites()
    assert sites, "no NotBuiltError found in src/flatshard: the search is broken"
    assert set(sites) == set(NOT_BUILT), (
        f"NotBuiltError sites not in NOT_BUILT: {sorted(set(sites) - set(NOT_BUILT))}; "
        f"in NOT_BUILT but gone: {sorted(set(NOT_BUILT) - set(sites))}"
    )
    column = _status_not_built_column()
    for key, count in sites.items():
        assert len(NOT_BUILT[key]) == count, f"{key} builds {count} NotBuiltError(s), NOT_BUILT names {NOT_BUILT[key]}"
        for words in NOT_BUILT[key]:
            assert words in column, f"docs/reference/status.md's not-built column does not say {words!r} ({key})"


def _raises(fn) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the class is the answer
        return f"{type(e).__name__}: {e}"
    return "no error"


class _Scalar(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.tensor(2.0))  # 0-D
        self.lin = nn.Linear(3, 3)


def unlisted_worker(rank: int, world: int) -> dict:  # noqa: ARG001 - the harness's signature
    import flatshard
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard.wrap import CustomPolicy

    model = nn.Sequential(nn.Linear(3, 3), nn.Linear(3, 3))
    overrides = CustomPolicy(
        lambda m: {"sharding_strategy": flatshard.ShardingStrategy.NO_SHARD} if m is model[0] else False
    )
    wrapped = FSDP(nn.Sequential(nn.Linear(3, 3)))
    opt = torch.optim.SGD(wrapped.parameters(), lr=0.1)
    return {
        "custom policy": _raises(lambda: FSDP(model, auto_wrap_policy=overrides)),
        "named optimizer": _raises(lambda: FSDP.optim_state_dict_to_load(wrapped, opt, {}, is_named_optimizer=True)),
        "0-D": _raises(lambda: flatshard.fully_shard(_Scalar())),
    }


def test_the_not_built_features_the_table_left_out_raise_not_built_error():
    for out in run_distributed(unlisted_worker, 2):
        assert out["custom policy"].startswith("NotBuiltError: CustomPolicy returning per-module keyword"), out
        assert out["named optimizer"].startswith("NotBuiltError: optim_state_dict_to_load(is_named_optimizer"), out
        assert out["0-D"].startswith("ValueError: fully_shard shards parameters along dim 0, and ['scale']"), out


# ---------------------------------------------------------------- figures in the pages, from the result files
RESULTS = ROOT / "bench" / "results"
SYSTEMS = ("flatshard", "flatshard fully_shard", "FSDP2", "DDP")


def _bench_rows(report: dict) -> list[str]:
    """docs/bench.md's table of the figures, one row per comparison of bench/results/bench.json."""
    rows = []
    for r in (r for r in report["results"] if r["kind"] == "comparison"):
        sy = r["systems"]
        ms = " | ".join(f"{sy[n]['step_s_median'] * 1e3:,.0f}" for n in SYSTEMS)
        mib = " / ".join(f"{max(sy[n]['peak_bytes_per_rank']) / 2**20:.1f}" for n in SYSTEMS)
        rows.append(
            f"| {r['size']} | {r['world']} | {r['dtype']} | {ms} | {r['flatshard/FSDP2']:.2f} | "
            f"{r['fully_shard/FSDP2']:.2f} | {mib} |"
        )
    return rows


def _span(values: list[float]) -> str:
    return f"{min(values):.2f}–{max(values):.2f}"


def test_the_bench_page_is_the_committed_run():
    """The table, the ranges its prose gives and the ablation of docs/bench.md are bench/results/bench.json."""
    report = json.loads((RESULTS / "bench.json").read_text())
    text = (ROOT / "docs" / "bench.md").read_text()
    prose = " ".join(text.split())
    rows = _bench_rows(report)
    assert len(rows) == 8 and all(row in text for row in rows), [row for row in rows if row not in text]
    comparisons = [r for r in report["results"] if r["kind"] == "comparison"]
    for key, words in (
        ("flatshard/FSDP2", "**flatshard FULL_SHARD**"),
        ("fully_shard/FSDP2", "**flatshard `fully_shard`**"),
    ):
        fp32 = _span([r[key] for r in comparisons if r["dtype"] == "fp32"])
        bf16 = _span([r[key] for r in comparisons if r["dtype"] == "bf16"])
        sentence = prose[prose.index(words) :][:200]
        assert f"{fp32} of its step in fp32, {bf16} in bf16" in sentence, (sentence, fp32, bf16)
    (ablation,) = [r for r in report["results"] if r["kind"] == "ablation"]
    default = ablation["systems"]["BACKWARD_PRE (default)"]["step_s_median"]
    for name, s in ablation["systems"].items():
        row = (
            f"| {name} | {s['step_s_median'] * 1e3:,.0f} | {s['step_s_median'] / default:.2f} | "
            f"{max(s['peak_bytes_per_rank']) / 2**20:.1f} |"
        )
        assert row in text, row
    prefetch = {n: s["step_s_median"] / default for n, s in ablation["systems"].items() if n != "NO_SHARD"}
    prefetch = {n: r for n, r in prefetch.items() if "shard_boundaries" not in n}
    moved = round(100 * max(abs(r - 1) for r in prefetch.values()))
    assert f"move the step by at most {moved}% of the default's" in prose, moved
    if "every other setting shorter than BACKWARD_PRE" in prose:
        assert all(r < 1 for n, r in prefetch.items() if n != "BACKWARD_PRE (default)"), prefetch
    p = report["provenance"]
    from bench.provenance import run_minutes

    minutes = round(run_minutes(p))
    assert f"The run took {minutes} minutes" in prose and f"({minutes} minutes on 2 cores without AVX-512)" in text
    assert not p["machine"]["avx512"] and p["machine"]["cores"] == 2, p["machine"]
    assert f"FULL_SHARD / NO_SHARD = {ablation['FULL_SHARD/NO_SHARD']:.2f}" in prose
    assert f'`shard_boundaries="rows"` is {ablation["rows/flat"]:.2f} of the flat step' in prose
    assert f'`"params"` {ablation["params/flat"]:.2f}' in prose


def test_the_frameworks_table_is_the_committed_runs():
    """docs/how-to/migrate.md's losses are bench/results/frameworks.json's (``python -m bench.frameworks``), FSDP2
    and flatshard equal to the bit, Lightning's Muon run and one process equal to the bit, with the commit,
    machine and load it was measured at."""
    from bench.tables import measured_at

    report = json.loads((RESULTS / "frameworks.json").read_text())
    text = (ROOT / "docs" / "how-to" / "migrate.md").read_text()
    for name, label in (("lightning", "Lightning"), ("accelerate", "Accelerate")):
        runs = report[name]["runs"]
        assert report[name]["equal"] and runs["FSDP2"] == runs["flatshard"], name
        means = [sum(rank[i] for rank in runs["FSDP2"]) / len(runs["FSDP2"]) for i in range(len(runs["FSDP2"][0]))]
        first, last = f"{means[0]:.6f}", f"{means[-1]:.6f}"
        row = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
        assert row and f"{first} / {first}" in row[0] and f"{last} / {last}" in row[0], (row, first, last)
    row = [line for line in text.splitlines() if line.startswith("| torchtitan |")]
    if not report["torchtitan"]["run"]:  # python -m bench.frameworks without an interpreter that has torchtitan
        assert row and "not run" in row[0], row
    else:
        tt = report["torchtitan"]["runs"]
        assert report["torchtitan"]["equal"] and tt["FSDP2"] == tt["flatshard"]
        first, last, norm = f"{tt['FSDP2'][0][0]:.6f}", f"{tt['FSDP2'][-1][0]:.6f}", f"{tt['FSDP2'][-1][1]:.6f}"
        assert row and f"{first} / {first}" in row[0] and f"{last} / {last}" in row[0] and norm in row[0], row
    row = [line for line in text.splitlines() if line.startswith("| torchtitan, deepseek_v3 MoE")]
    if report.get("torchtitan_moe", {}).get("run"):
        moe = report["torchtitan_moe"]
        tt = moe["runs"]
        assert moe["equal"] and tt["FSDP2"] == tt["flatshard"] and moe["ep"] == 1
        assert moe["placements"]["FSDP2"] == moe["placements"]["flatshard"]  # "placed alike"
        first, last, norm = f"{tt['FSDP2'][0][0]:.6f}", f"{tt['FSDP2'][-1][0]:.6f}", f"{tt['FSDP2'][-1][1]:.6f}"
        assert row and f"{first} / {first}" in row[0] and f"{last} / {last}" in row[0] and norm in row[0], row
    else:
        assert not row or "not run" in row[0], row
    row = [line for line in text.splitlines() if line.startswith("| torchtitan, deepseek_v3 MoE (EP = 2)")]
    if report.get("torchtitan_moe_ep2", {}).get("run"):
        ep2 = report["torchtitan_moe_ep2"]
        tt = ep2["runs"]
        assert ep2["equal"] and tt["FSDP2"] == tt["flatshard"] == tt["flatshard saved+resumed"] and ep2["ep"] == 2
        assert ep2["placements"]["FSDP2"] == ep2["placements"]["flatshard"]  # "placed alike"
        assert "('efsdp', 'ep')" in ep2["placements"]["flatshard"]["routed expert w1"]  # on the experts' 2-D mesh
        first, last, norm = f"{tt['FSDP2'][0][0]:.6f}", f"{tt['FSDP2'][-1][0]:.6f}", f"{tt['FSDP2'][-1][1]:.6f}"
        assert row and f"{first} / {first}" in row[0] and f"{last} / {last}" in row[0] and norm in row[0], row
    else:
        assert not row or "not run" in row[0], row
    prose = " ".join(text.split())
    for key in ("lightning_muon", "lightning_muon_lightning_checkpoint"):  # Muon: against one process, bitwise
        muon = report[key]
        runs = muon["runs"]
        assert muon["equal"] and muon["params_equal"] and muon["resumed_equal"], key
        assert runs["flatshard"] == runs["single process"] == runs["flatshard saved+resumed"], key
    muon = report["lightning_muon"]
    means = [sum(rank[i] for rank in muon["runs"]["flatshard"]) / 2 for i in range(muon["optimizer_steps"])]
    assert f"every one of the {muon['optimizer_steps']} steps (first {means[0]:.6f}, last {means[-1]:.6f}," in prose
    assert " ".join(measured_at(report).split()) in prose


# ---------------------------------------------------------------- the reference names everything public
def test_the_reference_documents_every_public_name_and_keyword():
    """docs/reference/api.md has a ``:::`` entry for every name ``flatshard`` exports (the docstrings make
    the page), and docs/reference/keywords.md a row for every keyword of both front ends."""
    import inspect

    import flatshard

    api = (ROOT / "docs" / "reference" / "api.md").read_text()
    documented = {line.split()[-1].rsplit(".", 1)[-1] for line in api.splitlines() if line.startswith("::: ")}
    missing = sorted(set(flatshard.__all__) - documented - {"FSDP"})  # FSDP: the wrapper's short name
    assert not missing, f"docs/reference/api.md has no ::: entry for {missing}"
    assert "`flatshard.FSDP` is `FullyShardedDataParallel`" in api
    keywords = (ROOT / "docs" / "reference" / "keywords.md").read_text()
    for fn in (flatshard.FullyShardedDataParallel.__init__, flatshard.fully_shard):
        names = [n for n in inspect.signature(fn).parameters if n not in ("self", "module")]
        absent = [n for n in names if f"| `{n}`" not in keywords and f", `{n}` |" not in keywords]
        assert not absent, f"docs/reference/keywords.md has no row for {fn.__qualname__}'s {absent}"
