"""Checkpoint directories, in one spawn at W = 2: step directories, the ``latest`` pointer and
``checkpoint.latest`` (also when the pointer is stale, missing or names a removed checkpoint),
``keep_last`` rotation that never removes the checkpoint just written, another-named checkpoint or
anything that is not a complete flatshard checkpoint; then a save that fails on one rank (the error
names that rank, on every rank) and an asynchronous save that fails (the next save works)."""

from __future__ import annotations

import json
import os
import shutil
import time
from unittest import mock

import torch.distributed as dist

from tests.helpers.cases import (
    CHECKPOINT_KIND,
    assert_state_equal,
    build,
    checkpoint_error,
    fresh,
    full_sd,
    make_optimizer,
    train_global_batch,
)
from tests.helpers.dist import run_distributed

# planted beside the step directories; rotation must leave every one of them
PLANTED = ["notes.txt", "other", "step-00000009.partial", "step-00000000"]


def _plant(d: str) -> None:
    os.makedirs(f"{d}/other")
    with open(f"{d}/other/manifest.json", "w") as f:  # a manifest, but not flatshard's
        json.dump({"hello": 1}, f)
    os.makedirs(f"{d}/step-00000009.partial")
    os.makedirs(f"{d}/step-00000000")  # named like a step, but incomplete: a rank file and no manifest
    with open(f"{d}/step-00000000/rank-00000-of-00002.safetensors", "wb") as f:
        f.write(b"\0" * 16)
    with open(f"{d}/notes.txt", "w") as f:
        f.write("not a checkpoint\n")


def directories_worker(rank: int, world: int, tmp: str) -> dict:
    from flatshard import checkpoint

    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    d = f"{tmp}/run"
    assert checkpoint.step_path(d, 100) == os.path.join(d, "step-00000100")
    assert checkpoint.step_path(d, 123456789) == os.path.join(d, "step-123456789")
    assert checkpoint.latest(d) is None, "no directory: no checkpoint"
    if rank == 0:
        _plant(d)
    dist.barrier()
    assert checkpoint.latest(d) is None, "nothing planted is a complete checkpoint"
    messages = [checkpoint_error(lambda: checkpoint.save(checkpoint.step_path(d, 1), model, opt, keep_last=0))]
    assert "keep_last must be a positive integer" in messages[-1], messages[-1]
    messages.append(checkpoint_error(lambda: checkpoint.save(f"{d}/other", model, opt)))
    assert "is not a flatshard checkpoint" in messages[-1], messages[-1]
    assert os.path.exists(f"{d}/other/manifest.json"), "a failed save removed a directory it does not own"

    checkpoint.save(f"{d}/run2-step-00000001", model, opt, step=1)  # another run's: never counted by keep_last
    checkpoint.save(f"{d}/best", model, opt, step=0)  # another name: never counted either
    assert checkpoint.latest(d) == f"{d}/best"
    for step in range(1, 5):
        train_global_batch(model, opt, batch, loss_fn, step, 1)
        checkpoint.save(checkpoint.step_path(d, step), model, opt, step=step, keep_last=2)
        assert checkpoint.latest(d) == checkpoint.step_path(d, step), step
    want = full_sd(model)
    names = sorted(os.listdir(d))
    assert names == sorted(PLANTED + ["best", "latest", "run2-step-00000001", "step-00000003", "step-00000004"]), names
    relative = os.path.relpath(d)
    assert checkpoint.latest(relative) == os.path.join(relative, "step-00000004"), "the caller's form of the path"
    with open(f"{d}/latest") as f:
        pointer = json.load(f)
    assert pointer["checkpoint"] == "step-00000004" and pointer["step"] == 4, pointer

    train_global_batch(model, opt, batch, loss_fn, 5, 1)
    handle = checkpoint.save(checkpoint.step_path(d, 5), model, opt, step=5, async_save=True, keep_last=3)
    assert handle.wait() == checkpoint.step_path(d, 5)
    assert checkpoint.latest(d) == checkpoint.step_path(d, 5)
    assert sorted(n for n in os.listdir(d) if n.startswith("step-") and n not in PLANTED) == [
        "step-00000003",
        "step-00000004",
        "step-00000005",
    ]

    m2, o2 = fresh()
    assert checkpoint.load(checkpoint.latest(d), m2, o2).step == 5
    stale = stale_pointer(rank, d)
    dist.barrier()
    return {"messages": messages, "stale": stale, "want": want if rank == 0 else None}


def stale_pointer(rank: int, d: str) -> list:
    """``latest`` when its pointer is behind (killed between commit and pointer), names a removed
    checkpoint, is missing or is garbage: always the newest complete checkpoint."""
    from flatshard import checkpoint

    seen = []
    if rank == 0:
        shutil.copy2(f"{d}/latest", f"{d}/latest.old")  # names step 5, with its old time
        time.sleep(0.05)
    dist.barrier()
    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    checkpoint.save(checkpoint.step_path(d, 6), model, opt, step=6)
    dist.barrier()
    if rank == 0:
        os.replace(f"{d}/latest.old", f"{d}/latest")  # as if killed between the commit and the pointer
        seen.append(os.path.basename(checkpoint.latest(d)))
        shutil.rmtree(checkpoint.step_path(d, 6))  # the user removes the newest: the pointer's is next
        seen.append(os.path.basename(checkpoint.latest(d)))
        shutil.rmtree(checkpoint.step_path(d, 5))  # the pointer names a removed checkpoint
        seen.append(os.path.basename(checkpoint.latest(d)))
        os.remove(f"{d}/latest")
        seen.append(os.path.basename(checkpoint.latest(d)))
        with open(f"{d}/latest", "w") as f:
            f.write("garbage")
        seen.append(os.path.basename(checkpoint.latest(d)))
        os.truncate(f"{d}/step-00000004/rank-00001-of-00002.safetensors", 100)  # incomplete: skipped
        seen.append(os.path.basename(checkpoint.latest(d)))
    dist.barrier()
    return seen


def failing_rank_worker(rank: int, world: int, tmp: str) -> dict:
    """Rank 1's file cannot be written: every rank raises naming rank 1; the next save works, after
    a failed synchronous save, after an asynchronous one whose ``wait()`` raised, and after one that
    was never waited on (the next save reports that failure once)."""
    from flatshard import checkpoint

    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    train_global_batch(model, opt, batch, loss_fn, 0, 1)

    def disk_full_on_rank_1(stage: str) -> None:
        if stage == "writing" and rank == 1:
            raise OSError(28, "No space left on device (injected)")

    messages = []
    with mock.patch("flatshard.checkpoint.save._reached", disk_full_on_rank_1):
        messages.append(checkpoint_error(lambda: checkpoint.save(f"{tmp}/x", model, opt, step=1)))
        handle = checkpoint.save(f"{tmp}/x", model, opt, step=2, async_save=True)
        messages.append(checkpoint_error(handle.wait))
    for m in messages:
        assert "rank-00001-of-00002.safetensors failed: [Errno 28] No space left on device" in m, m
        assert m.endswith("[rank 1 of 2]"), f"the error must name rank 1 alone: {m}"
    checkpoint.save(f"{tmp}/x", model, opt, step=4)  # after a failed async save whose wait() raised
    with mock.patch("flatshard.checkpoint.save._reached", disk_full_on_rank_1):
        unwaited = checkpoint.save(f"{tmp}/y", model, opt, step=5, async_save=True)
        while not unwaited.done():
            time.sleep(0.01)
    messages.append(checkpoint_error(lambda: checkpoint.save(f"{tmp}/y", model, opt, step=6)))
    assert messages[-1].startswith(f"the asynchronous save to {tmp}/y failed: writing"), messages[-1]
    assert messages[-1].count("[rank 1 of 2]") == 1 and "more rank" not in messages[-1], messages[-1]
    checkpoint.save(f"{tmp}/y", model, opt, step=6)  # reported once: this one saves
    want = full_sd(model)
    m2, o2 = fresh()
    assert checkpoint.load(f"{tmp}/x", m2, o2).step == 4
    assert checkpoint.load(f"{tmp}/y", m2, o2).step == 6
    assert_state_equal(full_sd(m2), want, "after the failed saves")
    assert sorted(os.listdir(tmp)) == ["latest", "x", "y"], sorted(os.listdir(tmp))
    dist.barrier()
    return {"messages": messages}


def test_checkpoint_directories(tmp_path):
    results = run_distributed(directories_worker, 2, str(tmp_path), timeout=240)
    assert results[0]["messages"] == results[1]["messages"], "every rank raises the same error"
    assert results[0]["stale"] == [
        "step-00000006",  # the pointer is behind: the newer commit wins
        "step-00000005",  # the newest is removed: the pointer's
        "step-00000004",  # the pointer's is removed
        "step-00000004",  # no pointer
        "step-00000004",  # a pointer that is not one
        "step-00000003",  # step 4 lost a file: not complete
    ], results[0]["stale"]


def test_failed_saves_name_the_rank_and_leave_the_next_save_working(tmp_path):
    results = run_distributed(failing_rank_worker, 2, str(tmp_path), timeout=240)
    assert results[0]["messages"] == results[1]["messages"], "every rank raises the same error"


def async_group_worker(rank: int, world: int, tmp: str) -> float:
    from datetime import timedelta

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import checkpoint
    from flatshard.runtime.comm.mesh import group_timeout
    from tests.helpers.models import TinyGPT

    group = dist.new_group([0, 1], timeout=timedelta(seconds=77))
    model = FSDP(TinyGPT(), process_group=group)
    checkpoint.save(f"{tmp}/ckpt", model, async_save=True).wait()
    return group_timeout(model.checkpoint_group).total_seconds()


def test_the_async_save_group_keeps_the_models_timeout(tmp_path):
    """The gloo group an asynchronous save commits on times out as the model's group does, not after
    torch's default 30 minutes."""
    assert run_distributed(async_group_worker, 2, str(tmp_path), timeout=120) == [77.0, 77.0]


def test_rotation_counts_only_names_like_the_new_one(tmp_path):
    """In one process, on manifests alone: keep_last's rotation varies only the last number of the new
    checkpoint's name (another run's step directories beside it stay), orders by commit time, not by
    name, and never removes the checkpoint just written."""
    from flatshard.checkpoint.directory import rotate
    from flatshard.checkpoint.format import FORMAT, FORMAT_VERSION

    def fake(name: str, at: float) -> str:
        os.makedirs(tmp_path / name)
        with open(tmp_path / name / "manifest.json", "w") as f:
            json.dump({"format": FORMAT, "format_version": FORMAT_VERSION, "files": {}, "committed_at": at}, f)
        return str(tmp_path / name)

    for i, name in enumerate(["run1-step-00000001", "run1-step-00000002", "run1-step-00000003"]):
        fake(name, 1000.0 + i)
    fake("run2-step-00000001", 500.0)  # the oldest of all: the first to go, were it counted
    newest = fake("run1-step-00000009", 900.0)  # resumed from an earlier step, with a clock behind: still kept
    removed = rotate(newest, 2)
    assert sorted(os.path.basename(p) for p in removed) == ["run1-step-00000001", "run1-step-00000002"], removed
    assert sorted(os.listdir(tmp_path)) == ["run1-step-00000003", "run1-step-00000009", "run2-step-00000001"]
