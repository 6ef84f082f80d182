"""Frameworks driving flatshard's ``fully_shard`` (examples/frameworks/), each through its own API at W = 2
on CPU, every rank's losses equal to the same framework's run on PyTorch's FSDP2, and a run saved half
way with the framework's checkpointing, loaded and resumed equal to the uninterrupted one: Lightning
(ModelParallelStrategy, its distributed checkpoint), Lightning training ``torch.optim.Muon`` on whole matrices
(``shard_boundaries="params"``) equal to one process over the global batch bitwise, saved and resumed with
``flatshard.checkpoint`` through the strategy, torchtitan's debug model (its FSDP function, chunked
loss, optimizer, schedule, data loader and CheckpointManager; its Trainer needs CUDA), its deepseek_v3 MoE
debug model through its own parallelize_fn (EP = 1, and EP = 2: experts as DTensors on the ep mesh), and Accelerate
(which drops its FSDP plugin on CPU: the recipe shows that, then prepares the optimizer and data only).

Lightning and Accelerate are in the ``test`` extra; torchtitan (and triton, which it imports) in
``frameworks`` only: a framework not installed skips its test and says so. Also: flatshard's modules are
``torch.distributed.fsdp.FSDPModule`` instances that run none of PyTorch's FSDP code (interop.py)."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest
import torch.distributed.fsdp as torch_fsdp
from torch import nn

from flatshard.fsdp2 import FSDPModule
from tests.helpers.dist import run_launcher

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "frameworks"
TIMEOUT_S = 240  # each takes 10-40 s on two loaded cores; a hang must fail, not wait


def needs(module: str, install: str):
    """Skip, saying why, when ``module`` cannot be imported (the framework is not installed)."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return pytest.mark.skip(reason=f"{exc}: pip install -c constraints/cpu.txt {install}")
    return lambda f: f


def run_recipe(name: str, tmp_path: Path, *args: str) -> dict:
    out = tmp_path / "out.json"
    cmd = [sys.executable, str(RECIPES / name), "--compare", "--json", str(out), *args]
    log = run_launcher(cmd, ROOT, TIMEOUT_S, name)
    assert out.exists(), f"{name} wrote no JSON:\n{log[-4000:]}"
    return json.loads(out.read_text())


def assert_equal_runs(fig: dict, steps: int) -> None:
    runs = fig["runs"]
    assert fig["world"] == 2 and fig["equal"] is True
    assert runs["flatshard"] == runs["FSDP2"], "flatshard's losses differ from PyTorch's FSDP2"
    assert runs["flatshard saved+resumed"] == runs["flatshard"], "the resumed run differs from the uninterrupted one"
    assert all(len(rank) == steps for rank in runs["flatshard"]), runs["flatshard"]


def test_fully_shard_modules_are_pytorch_fsdp_modules_that_run_none_of_its_code():
    assert issubclass(FSDPModule, torch_fsdp.FSDPModule)
    for name, value in vars(torch_fsdp.FSDPModule).items():
        if callable(value) or isinstance(value, (staticmethod, classmethod)):
            owner = next(k for k in FSDPModule.__mro__ if name in vars(k))
            assert owner is not torch_fsdp.FSDPModule, f"{name} would run PyTorch's FSDPModule code"
    # what torch's register_fsdp_forward_method, share_comm_ctx and pipelining read: refused, not faked
    with pytest.raises(RuntimeError, match="flatshard.register_fsdp_forward_method"):
        FSDPModule._get_fsdp_state(nn.Linear(1, 1))


@pytest.mark.slow
@needs("lightning", "lightning")
def test_lightning_model_parallel_strategy(tmp_path):
    fig = run_recipe("lightning_fully_shard.py", tmp_path, "--ckpt", str(tmp_path / "ckpt"))
    per_rank_batches = fig["epochs"] * 48 // (4 * 2)
    assert_equal_runs(fig, per_rank_batches)
    saved = tmp_path / "ckpt" / "half.ckpt"  # the strategy's checkpoint: DCP shards and Lightning's meta.pt
    assert sorted(p.name for p in saved.iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"]


@pytest.mark.slow
@needs("lightning", "lightning")
def test_lightning_muon_on_whole_matrices_equals_one_process(tmp_path):
    fig = run_recipe("lightning_muon.py", tmp_path, "--ckpt", str(tmp_path / "ckpt"))
    runs = fig["runs"]  # [rank][batch]: that rank's loss; the single process's for the same rank's batch
    assert fig["world"] == 2 and fig["checkpoint"] == "flatshard"
    assert runs["flatshard"] == runs["single process"], "the losses differ from one process's"
    assert fig["params_equal"], "the final parameters differ from one process's"
    assert runs["flatshard saved+resumed"] == runs["flatshard"] and fig["resumed_equal"], "the resume differs"
    assert fig["equal"] is True and all(len(rank) == fig["optimizer_steps"] == 12 for rank in runs["flatshard"])
    owned = fig["owned"]  # every parameter whole on exactly one rank, Muon's matrices on both
    assert not set(owned[0]) & set(owned[1]) and len(owned[0]) + len(owned[1]) == 3 * 6 + 2, owned
    assert all(any(n.endswith(("up.weight", "down.weight")) for n in names) for names in owned), owned
    assert fig["refusal"].startswith("RuntimeError: the optimizers of ranks [1] hold other parameters"), fig
    saved = tmp_path / "ckpt" / "half"  # flatshard's checkpoint: safetensors shards and the manifest, no pickle
    shards = [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)]
    assert sorted(p.name for p in saved.iterdir()) == ["manifest.json", *shards]
    extra = json.loads((saved / "manifest.json").read_text())["extra"]
    assert extra["epoch"] == 0 and "fit_loop" in extra["loops"], extra  # Lightning's loop state


@pytest.mark.slow
@needs("torchtitan.trainer", "torchtitan triton")
def test_torchtitan_debug_model(tmp_path):
    fig = run_recipe("torchtitan_fully_shard.py", tmp_path, "--steps", "6", "--dir", str(tmp_path))
    runs = fig["runs"]  # [(loss, grad norm)] per step, as torchtitan logs them (already summed over ranks)
    assert fig["world"] == 2 and fig["equal"] is True and len(runs["flatshard"]) == 6
    assert runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    steps = tmp_path / "resumed" / "checkpoint"  # CheckpointManager's step folders, every 3 steps
    assert sorted(p.name for p in steps.iterdir()) == ["step-3", "step-6"]


@pytest.mark.slow
@needs("torchtitan.trainer", "torchtitan triton")
def test_torchtitan_moe_debug_model(tmp_path):
    """torchtitan's smallest MoE debug model (deepseek_v3: 5 MoE blocks of 8 experts) through its own
    parallelize_fn at EP = 1: each MoE block one fully_shard, the experts along dim 0 (they outnumber the 2
    FSDP ranks, so torchtitan passes no shard_placement_fn), and its load-balancing hook; 4 steps."""
    args = ("--model", "deepseek_v3", "--steps", "4", "--dir", str(tmp_path))
    fig = run_recipe("torchtitan_fully_shard.py", tmp_path, *args)
    runs = fig["runs"]
    assert fig["world"] == 2 and fig["model"] == "deepseek_v3" and fig["ep"] == 1
    assert fig["equal"] is True and len(runs["flatshard"]) == 4
    assert runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    placed = fig["placements"]  # both sharded the experts and the dense weights alike, over the fsdp mesh
    assert placed["flatshard"] == placed["FSDP2"], placed
    assert placed["flatshard"]["routed expert w1"] == "(Shard(dim=0),) on ('fsdp',) (2,), local (4, 256, 256)"
    steps = tmp_path / "resumed" / "checkpoint"
    assert sorted(p.name for p in steps.iterdir()) == ["step-2", "step-4"]


@pytest.mark.slow
@needs("torchtitan.trainer", "torchtitan triton")
def test_torchtitan_moe_debug_model_with_expert_parallelism(tmp_path):
    """The same model at EP = 2 over the 2 ranks: torchtitan's parallelize_fn makes the routed experts
    DTensors on the ep mesh (its all-to-all over gloo) and places them on the efsdp mesh (one rank here)
    with a ShardPlacementResult per parameter: flatshard equals FSDP2 every step to the bit, holds the
    experts on FSDP2's mesh and placement, and the resumed run equals the uninterrupted one."""
    args = ("--model", "deepseek_v3", "--ep", "2", "--steps", "4", "--dir", str(tmp_path))
    fig = run_recipe("torchtitan_fully_shard.py", tmp_path, *args)
    runs = fig["runs"]
    assert fig["world"] == 2 and fig["ep"] == 2 and fig["equal"] is True and len(runs["flatshard"]) == 4
    assert runs["flatshard"] == runs["FSDP2"] and runs["flatshard saved+resumed"] == runs["flatshard"]
    placed = fig["placements"]
    assert placed["flatshard"] == placed["FSDP2"], placed
    want = "(_StridedShard(dim=0, sf=2), Shard(dim=0)) on ('efsdp', 'ep') (1, 2), local (4, 256, 256)"
    assert placed["flatshard"]["routed expert w1"] == want, placed


@pytest.mark.slow
@needs("accelerate", "accelerate")
def test_accelerate_refuses_fsdp_on_cpu_and_trains_what_it_prepares(tmp_path):
    fig = run_recipe("accelerate_fully_shard.py", tmp_path)
    refusal = fig["refusal"]  # the FSDP2 plugin dropped on CPU, the model wrapped in DDP, a sharded one refused
    assert refusal[:3] == [
        "distributed type: DistributedType.MULTI_CPU",
        "FSDP plugin kept: False",
        "a plain model after prepare: DistributedDataParallel",
    ]
    assert refusal[3].startswith("a flatshard-sharded model after prepare: RuntimeError"), refusal
    assert_equal_runs(fig, 12)
