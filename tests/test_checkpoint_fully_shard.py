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
- a wrapper (FullyShardedDataParallel) checkpoint given to a fully_shard model, and ``async_save``,
  raise the errors that name what to do, on every rank;
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


def errors_worker(rank: int, world: int, wrapper_ckpt: str, directory: str) -> dict:
    from flatshard import CheckpointError, NotBuiltError, checkpoint

    _, model = fsdp2_pair()
    out = {}
    try:
        checkpoint.save(os.path.join(directory, "a"), model, async_save=True)
    except NotBuiltError as e:
        out["async"] = str(e)
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
    for out in run_distributed(errors_worker, 2, wrapper_ckpt, str(tmp_path), timeout=200):
        assert "async_save=False" in out.get("async", ""), out
        assert "saved from a FullyShardedDataParallel model" in out.get("wrapper", ""), out


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
