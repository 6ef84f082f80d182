"""``flatshard.checkpoint`` on ``fully_shard`` models: DCP's safetensors format, flatshard's commit.

A ``Checkpointer`` on a fully_shard TinyGPT with AdamW saves at W = 2 after steps 1, 2 and 3 with
``keep_last=2`` (two step directories stay, ``latest`` names step 3), each rank's loader position and
RNG in the checkpoint; the directory holds safetensors files and ``manifest.json`` only (no pickled
``.metadata``). Then:
- resumed at W = 2 from other weights, the model's and the optimizer's full state equal the saved ones
  bitwise, every rank's loader position comes back, and the next two steps' losses (on batches drawn
  from the restored RNG) equal the uninterrupted run's bitwise;
- loaded at W = 1 and W = 3, the full state equals the saved one bitwise;
- ``torch.distributed.checkpoint`` alone (``HuggingFaceStorageReader``, no process group) reads the
  model's tensors into a plain TinyGPT, equal to the saved ones;
- a wrapper (FullyShardedDataParallel) checkpoint given to a fully_shard model raises the error that
  names what to do, on every rank;
- ``async_save=True`` at W = 2: a step runs while the save writes, and the checkpoint holds the state
  (model, AdamW, RNG, loader) as it was at the call, bitwise; a ``Checkpointer(async_save=True)`` keeps
  ``latest`` and ``keep_last`` as the synchronous one; a write that fails on rank 1 is raised by
  ``wait()`` on both ranks and nothing is committed; one that nobody waited for is raised, once, by the
  next save on both ranks, and the save after that commits;
- ``flatshard inspect`` summarises one and reads every file whole; a file overwritten or cut short is
  named;
- a rank that does not come to a save (as one stopped while it writes) makes every other rank raise a
  CheckpointError naming the save within the timeout of the groups the model trains over (a 1-D mesh
  and a 2-D (replicate, shard) mesh, each built from groups with a 3 s timeout), not the default group's
  30 minutes, and nothing is committed.
"""

from __future__ import annotations

import os
import pathlib
import sys
import time

import torch

from tests.helpers.cases import fsdp2_pair, token_loss
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyGPT

SAVED_AT = 3
MORE = 2


class Loader:
    """A loader with a position of its own (per rank)."""

    def __init__(self, pos: int = 0):
        self.pos = pos

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, d: dict) -> None:
        self.pos = d["pos"]


def full_state(model, opt) -> dict:
    from torch.distributed.tensor import DTensor

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()

    out = {"model/" + n: full(t) for n, t in model.state_dict().items()}
    names = {id(p): n for n, p in model.named_parameters()}
    for p, s in opt.state.items():
        out.update({f"optim/{names[id(p)]}/{k}": full(v) for k, v in s.items()})
    return out


def step(model, opt, loader) -> float:
    x = torch.randint(0, 37, (3, 8))  # from the global RNG: a resume must restore it
    loss = token_loss(model, x)
    loss.backward()
    opt.step()
    opt.zero_grad()
    loader.pos += 3
    return loss.item()


def save_worker(rank: int, world: int, directory: str) -> dict:
    from flatshard import checkpoint

    _, model = fsdp2_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader(1000 * rank)
    ckpt = checkpoint.Checkpointer(directory, model, opt, every=1, keep_last=2, state={"loader": loader})
    torch.manual_seed(100 + rank)
    assert ckpt.resume() == 0
    for s in range(SAVED_AT):
        step(model, opt, loader)
        ckpt.step_done(s + 1)
    saved = full_state(model, opt)
    losses = [step(model, opt, loader) for _ in range(MORE)]
    return {"saved": saved, "losses": losses, "pos": 1000 * rank + 3 * SAVED_AT}


def resume_worker(rank: int, world: int, directory: str) -> dict:
    from flatshard import checkpoint

    _, model = fsdp2_pair(seed=2)  # other weights: the load must overwrite them
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader()
    torch.manual_seed(7)  # another RNG state: the load must restore the saved one (at the same W)
    ckpt = checkpoint.Checkpointer(
        directory, model, opt, every=1, keep_last=2, state={"loader": loader} if world == 2 else None
    )
    start = ckpt.resume()
    out = {"start": start, "state": full_state(model, opt), "pos": loader.pos}
    if world == 2:
        out["losses"] = [step(model, opt, loader) for _ in range(MORE)]
    return out


def test_fully_shard_checkpointer_saves_resumes_and_reshards(tmp_path: pathlib.Path):
    from flatshard import checkpoint

    directory = str(tmp_path / "ckpt")
    ran = run_distributed(save_worker, 2, directory, timeout=200)
    names = sorted(n for n in os.listdir(directory) if n != "latest")
    assert names == ["step-00000002", "step-00000003"], names  # keep_last=2
    assert checkpoint.latest(directory) == os.path.join(directory, "step-00000003")
    files = sorted(os.listdir(os.path.join(directory, "step-00000003")))
    assert files == ["manifest.json"] + [f"shard-0000{r}-model-00001-of-00001.safetensors" for r in (1, 2)], files
    _inspect_reports_a_damaged_file(os.path.join(directory, "step-00000002"), str(tmp_path / "copy"))

    saved = ran[0]["saved"]
    for world in (2, 1, 3):
        for rank, got in enumerate(run_distributed(resume_worker, world, directory, timeout=200)):
            assert got["start"] == SAVED_AT, got["start"]
            assert sorted(got["state"]) == sorted(saved), world
            for k, v in saved.items():
                assert torch.equal(v, got["state"][k]), (world, k)
            if world == 2:
                assert got["pos"] == ran[rank]["pos"], (rank, got["pos"])
                assert got["losses"] == ran[rank]["losses"], (rank, got["losses"], ran[rank]["losses"])


def _inspect_reports_a_damaged_file(saved: str, ckpt: str) -> None:
    """``flatshard inspect`` on a copy of a fully_shard checkpoint: what it holds, every file read whole;
    a file whose bytes were overwritten (its size kept) is a problem that names it, and one cut short
    is refused as the manifest is read, naming it."""
    import io
    import shutil

    import pytest

    from flatshard.api import CheckpointError
    from flatshard.checkpoint.tools import inspect

    shutil.copytree(saved, ckpt)
    out = io.StringIO()
    assert inspect(ckpt, out=out) == [], out.getvalue()
    assert "saved at W=2 by fully_shard" in out.getvalue() and "all 2 present at their sizes" in out.getvalue()
    name = "shard-00002-model-00001-of-00001.safetensors"
    victim = os.path.join(ckpt, name)
    with open(victim, "r+b") as f:  # the safetensors header's length, overwritten
        f.write(b"\xff" * 8)
    problems = inspect(ckpt, out=io.StringIO())
    assert len(problems) == 1 and problems[0].startswith(f"{name}: not a valid safetensors file"), problems
    with open(victim, "r+b") as f:
        f.truncate(os.path.getsize(victim) - 8)
    with pytest.raises(CheckpointError, match=f"{name} is truncated or altered"):
        inspect(ckpt, out=io.StringIO())


def test_plain_dcp_reads_a_fully_shard_checkpoint(tmp_path: pathlib.Path):
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    directory = str(tmp_path / "ckpt")
    saved = run_distributed(save_worker, 2, directory, timeout=200)[0]["saved"]
    torch.manual_seed(5)
    plain = TinyGPT()
    sd = {"model": plain.state_dict()}
    dcp.load(sd, storage_reader=HuggingFaceStorageReader(os.path.join(directory, "step-00000003")), no_dist=True)
    for n, t in sd["model"].items():
        assert torch.equal(t, saved["model/" + n]), n


def errors_worker(rank: int, world: int, wrapper_ckpt: str) -> dict:
    from flatshard import CheckpointError, checkpoint

    _, model = fsdp2_pair()
    out = {}
    try:
        checkpoint.load(wrapper_ckpt, model)
    except CheckpointError as e:
        out["wrapper"] = str(e)
    return out


def wrapper_save_worker(rank: int, world: int, path: str) -> None:
    from flatshard import checkpoint
    from tests.helpers.cases import build

    checkpoint.save(path, build("gpt_tie_in_root", "FULL_SHARD")[1], step=1)


def test_fully_shard_checkpoint_errors(tmp_path: pathlib.Path):
    wrapper_ckpt = str(tmp_path / "wrapper")
    run_distributed(wrapper_save_worker, 2, wrapper_ckpt, timeout=200)
    for out in run_distributed(errors_worker, 2, wrapper_ckpt, timeout=200):
        assert "saved from a FullyShardedDataParallel model" in out.get("wrapper", ""), out


# ---- asynchronous saves ---------------------------------------------------------------------------------
def async_worker(rank: int, world: int, directory: str) -> dict:
    from unittest import mock

    from flatshard import CheckpointError, checkpoint

    _, model = fsdp2_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loader = Loader(1000 * rank)
    torch.manual_seed(100 + rank)
    for _ in range(2):
        step(model, opt, loader)
    want = full_state(model, opt)
    path = os.path.join(directory, "async")
    handle = checkpoint.save(path, model, opt, step=2, extra={"run": "a"}, async_save=True, state={"loader": loader})
    draws = torch.rand(4)
    step(model, opt, loader)  # changes every parameter and moment in place while the thread writes
    out: dict = {"waited": handle.wait() == path, "done": handle.done()}
    after = full_state(model, opt)
    out["changed"] = all(not torch.equal(after[k], v) for k, v in want.items() if k.startswith("model/"))

    _, fresh = fsdp2_pair(seed=2)
    opt2 = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    loader2 = Loader()
    torch.manual_seed(7)
    out["loaded"] = tuple(checkpoint.load(path, fresh, opt2, state={"loader": loader2})) == (2, {"run": "a"})
    got = full_state(fresh, opt2)
    out["equal"] = sorted(got) == sorted(want) and all(torch.equal(got[k], v) for k, v in want.items())
    out["rng"] = torch.equal(torch.rand(4), draws)
    out["pos"] = loader2.pos == 1000 * rank + 6

    ckpts = os.path.join(directory, "ckpts")
    ckpt = checkpoint.Checkpointer(ckpts, model, opt, every=1, keep_last=2, async_save=True)
    for s in range(3):
        step(model, opt, loader)
        ckpt.step_done(s + 1)
    last = full_state(model, opt)
    ckpt.wait()
    out["kept"] = sorted(n for n in os.listdir(ckpts) if n != "latest")
    out["latest"] = checkpoint.latest(ckpts) == os.path.join(ckpts, "step-00000003")
    checkpoint.load(os.path.join(ckpts, "step-00000003"), fresh, opt2)
    got = full_state(fresh, opt2)
    out["checkpointer_equal"] = all(torch.equal(got[k], v) for k, v in last.items())

    def fail_on_rank_1(stage: str) -> None:
        if stage == "writing" and rank == 1:
            raise OSError("disk full (injected)")

    with mock.patch("flatshard.checkpoint.save._reached", fail_on_rank_1):
        failed = checkpoint.save(os.path.join(directory, "failed"), model, opt, step=9, async_save=True)
        try:
            failed.wait()
        except CheckpointError as e:
            out["wait_error"] = str(e)
        unwaited = checkpoint.save(os.path.join(directory, "unwaited"), model, opt, step=10, async_save=True)
        while not unwaited.done():  # polled, never waited: its failure is left for the next save
            time.sleep(0.01)
    try:
        checkpoint.save(os.path.join(directory, "next"), model, opt, step=11)
    except CheckpointError as e:
        out["next_error"] = str(e)
    checkpoint.save(os.path.join(directory, "next"), model, opt, step=11)
    out["committed"] = sorted(n for n in os.listdir(directory) if n in ("failed", "unwaited", "next"))
    return out


def test_fully_shard_async_save_holds_the_state_at_the_call(tmp_path: pathlib.Path):
    for rank, out in enumerate(run_distributed(async_worker, 2, str(tmp_path), timeout=300)):
        assert out["waited"] and out["done"] and out["changed"], out
        assert out["loaded"] and out["equal"] and out["rng"] and out["pos"], (rank, out)
        assert out["kept"] == ["step-00000002", "step-00000003"] and out["latest"], out
        assert out["checkpointer_equal"], out
        assert "disk full (injected)" in out.get("wait_error", "") and "[rank 1 of 2]" in out["wait_error"], out
        assert "the asynchronous save to" in out.get("next_error", "") and "unwaited" in out["next_error"], out
        assert "did nothing; call it again" in out["next_error"], out
        assert out["committed"] == ["next"], out


# ---- a rank that stops in a save: the others fail within the model's collective timeout ------------
STALL_TIMEOUT_S = 3.0


def stalled_save_worker(rank: int, world: int, directory: str, hybrid: bool) -> dict:
    """The model's collectives wait STALL_TIMEOUT_S (its mesh built from groups given that timeout, by
    examples/train_gpt.py's own function for --collective-timeout); one save completes, then the last rank
    does not come to the second save, as a rank stopped while it writes. The others must raise a
    CheckpointError naming the save within the timeout, not wait out the default group's 30 minutes."""
    import datetime
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    from flatshard import checkpoint

    examples = str(pathlib.Path(__file__).resolve().parents[1] / "examples")
    sys.path.insert(0, examples)  # the example imports its neighbours as a script does
    try:
        from examples.train_gpt import hybrid_mesh_with_timeout
    finally:
        sys.path.remove(examples)

    timeout = datetime.timedelta(seconds=STALL_TIMEOUT_S)
    if hybrid:  # (replicate, shard) = 2 x 2, as the example builds it for --collective-timeout
        mesh = hybrid_mesh_with_timeout(world, world // 2, "cpu", STALL_TIMEOUT_S)
    else:
        mesh = DeviceMesh.from_group(dist.new_group(list(range(world)), timeout=timeout), "cpu")
    _, model = fsdp2_pair(mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    step(model, opt, Loader())
    checkpoint.save(os.path.join(directory, "first"), model, opt, step=1)
    if rank == world - 1:
        return {}
    start = time.monotonic()
    try:
        checkpoint.save(os.path.join(directory, "second"), model, opt, step=2)
    except Exception as exc:  # noqa: BLE001 - what it raised, and when, is what the test reads
        return {"after_s": time.monotonic() - start, "type": type(exc).__name__, "message": str(exc)}
    return {"after_s": time.monotonic() - start, "type": None, "message": "the save completed"}


def test_a_rank_missing_from_a_fully_shard_save_fails_the_others_within_the_collective_timeout(tmp_path):
    for hybrid in (False, True):
        directory = tmp_path / ("hybrid" if hybrid else "one_dim")
        directory.mkdir()
        out = run_distributed(stalled_save_worker, 4, str(directory), hybrid, timeout=120, fresh=True)
        for rank, got in enumerate(out[:-1]):
            assert got["type"] == "CheckpointError", (hybrid, rank, got)
            assert f"the save to {directory / 'second'}" in got["message"], (hybrid, rank, got)
            assert got["after_s"] <= STALL_TIMEOUT_S + 10, (hybrid, rank, got)
        assert not (directory / "second").exists()  # nothing committed


# ---- optimizers whose param_groups differ between ranks ----------------------------------------------
def rank_groups_worker(rank: int, world: int, directory: str) -> dict:
    """Each rank's optimizer has hyperparameters of its own (as each rank's optimizer over the matrices it
    owns under ``shard_boundaries="params"`` has groups of its own). Saved and loaded at the same W into
    optimizers built otherwise, every rank gets its own groups back; loaded at another W, the load is
    refused on every rank (no rank's groups belong to a rank of another job)."""
    from flatshard import checkpoint

    _, model = fsdp2_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01 * (rank + 1), weight_decay=0.1 * rank)
    step(model, opt, Loader())
    path = os.path.join(directory, "ranked")
    checkpoint.save(path, model, opt, step=1)
    _, fresh = fsdp2_pair(seed=1)
    other = torch.optim.AdamW(fresh.parameters(), lr=0.5)
    checkpoint.load(path, fresh, other)
    return {"lr": other.param_groups[0]["lr"], "weight_decay": other.param_groups[0]["weight_decay"]}


def other_world_worker(rank: int, world: int, path: str) -> str:
    from flatshard import checkpoint

    _, model = fsdp2_pair()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    try:
        checkpoint.load(path, model, opt)
    except Exception as exc:  # noqa: BLE001 - the message is what the test reads
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


def test_fully_shard_checkpoint_keeps_each_ranks_optimizer_groups(tmp_path: pathlib.Path):
    out = run_distributed(rank_groups_worker, 2, str(tmp_path), timeout=200)
    assert out == [{"lr": 0.01, "weight_decay": 0.0}, {"lr": 0.02, "weight_decay": 0.1}], out
    for got in run_distributed(other_world_worker, 3, str(tmp_path / "ranked"), timeout=200):
        assert got.startswith("CheckpointError") and "differ between ranks" in got, got
