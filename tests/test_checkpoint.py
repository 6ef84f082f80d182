"""Checkpoints on disk, in one spawn at W = 4 (process start-up dominates these tests).

Two savers are first killed (SIGKILL) while writing and just before commit. Then the spawn saves
(sync and async) and loads back at W = 4 (bitwise resume, RNG included), at W = 4 with F = 2 and
with NO_SHARD, and at W = 1, 2, 3 (subgroups of the same processes), losses following the
uninterrupted run; loads what the killed savers left; and meets every corruption with its named
error on every rank. Last, the command line consolidates and inspects what it saved."""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil

import numpy as np
import torch
import torch.distributed as dist

from tests.helpers import dist_pool
from tests.helpers.cases import (
    CHECKPOINT_KIND,
    assert_state_equal,
    build,
    checkpoint_error,
    fresh,
    full_osd,
    full_sd,
    make_optimizer,
    train_global_batch,
)
from tests.helpers.dist import run_distributed
from tests.helpers.models import TinyGPT

SAVE_AT, MORE = 2, 2


def reshard_worker(rank: int, world: int, tmp: str) -> dict:
    from flatshard import checkpoint

    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    train_global_batch(model, opt, batch, loss_fn, 0, SAVE_AT)
    torch.manual_seed(100 + rank)  # RNG states that nothing below recreates by seeding
    random.seed(200 + rank)
    np.random.seed(300 + rank)
    assert checkpoint.save(f"{tmp}/sync", model, opt, step=SAVE_AT, extra={"run": "a"}) is None
    handle = checkpoint.save(f"{tmp}/async", model, opt, step=SAVE_AT, extra={"run": "b"}, async_save=True)
    want_sd, want_osd = full_sd(model), full_osd(model, opt)  # runs while the save writes
    assert handle.wait() == f"{tmp}/async"
    draws = (torch.rand(4), random.random(), np.random.rand())
    ref_losses = train_global_batch(model, opt, batch, loss_fn, SAVE_AT, MORE)
    ref_final = full_sd(model)

    # the same layout: bitwise, RNG included
    model2, opt2 = fresh()
    assert tuple(checkpoint.load(f"{tmp}/async", model2, opt2)) == (SAVE_AT, {"run": "b"})
    assert torch.equal(torch.rand(4), draws[0]), "torch RNG state not restored"
    assert (random.random(), np.random.rand()) == draws[1:], "random / numpy RNG states not restored"
    assert_state_equal(full_sd(model2), want_sd, "resume: params")
    assert_state_equal(full_osd(model2, opt2), want_osd, "resume: optimizer")
    assert train_global_batch(model2, opt2, batch, loss_fn, SAVE_AT, MORE) == ref_losses, "resume: losses not bitwise"
    assert_state_equal(full_sd(model2), ref_final, "resume: final params")

    losses = {}
    for strategy, kw in (("HYBRID_SHARD", {"sharding_factor": 2}), ("NO_SHARD", {})):
        m, o = fresh(strategy, **kw)
        checkpoint.load(f"{tmp}/sync", m, o)
        assert_state_equal(full_sd(m), want_sd, f"{strategy}: params")
        assert_state_equal(full_osd(m, o), want_osd, f"{strategy}: optimizer")
        losses[strategy] = train_global_batch(m, o, batch, loss_fn, SAVE_AT, MORE)
        if strategy == "HYBRID_SHARD":  # saved by the first replica only, loaded back at F = W
            checkpoint.save(f"{tmp}/hybrid", m, o)
            back, back_o = fresh()
            checkpoint.load(f"{tmp}/hybrid", back, back_o)
            assert_state_equal(full_sd(back), full_sd(m), "HYBRID save -> FULL_SHARD load: params")
            assert_state_equal(full_osd(back, back_o), full_osd(m, o), "HYBRID save -> FULL_SHARD load: optimizer")
    for n in (1, 2, 3):
        group = dist.new_group(list(range(n)))  # every rank creates every group
        if rank < n:
            m, o = fresh(process_group=group)
            assert checkpoint.load(f"{tmp}/sync", m, o).step == SAVE_AT
            assert_state_equal(full_sd(m), want_sd, f"W={n}: params")
            assert_state_equal(full_osd(m, o), want_osd, f"W={n}: optimizer")
            losses[f"W={n}"] = train_global_batch(m, o, batch, loss_fn, SAVE_AT, MORE, group)
    for what, got in losses.items():
        torch.testing.assert_close(torch.tensor(got), torch.tensor(ref_losses), msg=lambda m: f"{what}: losses: {m}")
    dist.barrier()
    return {"sd": want_sd if rank == 0 else None, "resumed_at": sorted(losses)}


def worker(rank: int, world: int, tmp: str) -> dict:
    out = reshard_worker(rank, world, tmp)
    out["messages"] = corrupt_worker(rank, world, tmp)
    return out


def test_checkpoints(tmp_path, capsys):
    """Crash leftovers first (killed savers), then one W = 4 spawn: reshard and resume, then what the
    killed savers left and every corruption; then the command line on what it saved."""
    from safetensors.torch import load_file

    from flatshard.cli import main

    kill_savers(str(tmp_path))
    assert not os.path.exists(tmp_path / "writing-next"), "a killed save left a loadable directory"
    assert not os.path.exists(tmp_path / "writing-next.partial" / "manifest.json")
    with open(tmp_path / "before_commit" / "manifest.json") as f:
        assert json.load(f)["step"] == 1, "a save killed before commit replaced the previous checkpoint"
    assert os.path.exists(tmp_path / "before_commit.partial" / "manifest.json"), "the kill came after the manifest"
    assert os.path.exists(tmp_path / "between_renames.partial" / "manifest.json"), "killed with both complete"
    results = run_distributed(worker, 4, str(tmp_path), timeout=300)
    assert all(r["messages"] == results[0]["messages"] for r in results), "every rank raises the same error"
    assert results[3]["resumed_at"] == ["HYBRID_SHARD", "NO_SHARD"], "rank 3 takes part in W=4 loads only"
    assert results[0]["resumed_at"] == ["HYBRID_SHARD", "NO_SHARD", "W=1", "W=2", "W=3"]
    want = results[0]["sd"]
    files = sorted(os.listdir(tmp_path / "sync"))
    assert files == ["manifest.json"] + [f"rank-{r:05d}-of-00004.safetensors" for r in range(4)], files
    assert not os.path.exists(tmp_path / "sync.partial") and not os.path.exists(tmp_path / "async.partial")
    hybrid = [set(load_file(str(tmp_path / "hybrid" / f"rank-{r:05d}-of-00004.safetensors"))) for r in range(4)]
    assert all(k.startswith("rng/") for k in hybrid[2] | hybrid[3]), "the second replica writes its RNG states only"
    assert "model/blocks.0.fc.weight" in hybrid[1]
    # every rank file is a plain safetensors file
    assert set(load_file(str(tmp_path / "sync" / files[1]))) >= {"rng/torch", "model/wte.weight"}

    assert main(["consolidate", str(tmp_path / "sync"), str(tmp_path / "model.safetensors")]) == 0
    flat = load_file(str(tmp_path / "model.safetensors"))
    assert list(flat) == list(want) or set(flat) == set(want)
    plain = TinyGPT()
    plain.load_state_dict(flat, strict=True)
    assert_state_equal(dict(plain.state_dict()), want, "consolidated")
    capsys.readouterr()
    assert main(["inspect", str(tmp_path / "async")]) == 0
    out = capsys.readouterr().out
    assert "step 2" in out and "checksums: all 4 files verified" in out and "blocks.1.fc.weight" in out, out
    with open(tmp_path / "async" / "rank-00002-of-00004.safetensors", "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    assert main(["inspect", str(tmp_path / "async")]) == 1
    assert "rank-00002-of-00004.safetensors: checksum mismatch" in capsys.readouterr().out


# ---- crashes and corruption -------------------------------------------------------------------
def _saver(tmp: str, stage: str, paused) -> None:
    """Save step 1, then save step 2 (over it, or next to it for "writing") and stop at ``stage`` of that
    save, saying so on the connection ``paused``: the test kills the process there."""
    import time
    from unittest import mock

    from flatshard import checkpoint

    dist.init_process_group("gloo", init_method=f"file://{tmp}/store-{stage}", rank=0, world_size=1)
    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    train_global_batch(model, opt, batch, loss_fn, 0, 1)
    checkpoint.save(f"{tmp}/{stage}", model, opt, step=1)
    train_global_batch(model, opt, batch, loss_fn, 1, 1)

    def hook(reached):
        if reached == stage:
            paused.send("PAUSED")
            time.sleep(600)

    target = f"{tmp}/{stage}" if stage != "writing" else f"{tmp}/{stage}-next"
    with mock.patch("flatshard.checkpoint.save._reached", hook):
        checkpoint.save(target, model, opt, step=2)
    paused.send("NOT KILLED")


OVERWRITE_STAGES = ("before_commit", "between_renames", "after_commit")


def kill_savers(tmp: str) -> None:
    """Savers killed (SIGKILL) at their pause points: one while writing a new checkpoint, three while
    replacing the checkpoint they saved first at the same path (before the commit, between its two
    renames, after it). Each is a process of its own, forked with torch and flatshard already imported
    (the pools' forkserver, tests/helpers/dist_pool.py)."""
    ctx = dist_pool.context()
    procs = {}
    for stage in ("writing",) + OVERWRITE_STAGES:
        paused, child_end = ctx.Pipe(duplex=False)
        procs[stage] = (ctx.Process(target=_saver, args=(tmp, stage, child_end), daemon=True), paused)
        procs[stage][0].start()
        child_end.close()  # the saver holds the only writing end: its death reads as EOF here
    try:
        for stage, (proc, paused) in procs.items():
            said = "(nothing within 120 s)"  # a saver that hangs must fail, not wait
            if paused.poll(120):
                try:
                    said = paused.recv()
                except EOFError:
                    proc.join(5)
                    said = f"(it exited {proc.exitcode})"
            assert said == "PAUSED", f"{stage}: the saver did not reach its pause point: {said!r}"
    finally:
        for proc, _ in procs.values():
            proc.kill()
            proc.join()


class _Payload:
    """Unpickling this would create a file: proof that nothing was unpickled if the file never appears."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def corrupt_worker(rank: int, world: int, tmp: str) -> list[str]:
    from flatshard import checkpoint
    from flatshard.checkpoint.format import ShardReader

    _, model, batch, loss_fn = build(CHECKPOINT_KIND, "FULL_SHARD")
    opt = make_optimizer("adamw", model)
    # what the killed savers left: the previous checkpoint until the new one committed, then the new one
    assert checkpoint.load(f"{tmp}/writing", model, opt).step == 1
    assert checkpoint.load(f"{tmp}/before_commit", model, opt).step == 1
    assert checkpoint.load(f"{tmp}/between_renames", model, opt).step == 1
    assert checkpoint.load(f"{tmp}/after_commit", model, opt).step == 2
    messages = [checkpoint_error(lambda: checkpoint.load(f"{tmp}/writing-next", model, opt))]
    assert "never finished" in messages[-1], messages[-1]
    for stage in OVERWRITE_STAGES:  # saving there again works and leaves nothing else behind
        checkpoint.save(f"{tmp}/{stage}", model, opt, step=3)
        assert checkpoint.load(f"{tmp}/{stage}", model, opt).step == 3
        assert [n for n in os.listdir(tmp) if n.startswith(stage)] == [stage], os.listdir(tmp)
    train_global_batch(model, opt, batch, loss_fn, 0, 2)
    checkpoint.save(f"{tmp}/good", model, opt, step=2)
    before = full_sd(model)
    f1 = f"rank-00001-of-{world:05d}.safetensors"

    def broken(name, damage):
        if rank == 0:
            shutil.copytree(f"{tmp}/good", f"{tmp}/{name}")
            damage(f"{tmp}/{name}")
        dist.barrier()
        return f"{tmp}/{name}"

    def flip(d):
        with ShardReader(f"{d}/{f1}") as r:
            at = r.data_start + r.header["model/blocks.0.fc.weight"]["data_offsets"][0] + 5
        with open(f"{d}/{f1}", "r+b") as f:
            f.seek(at)
            byte = f.read(1)
            f.seek(at)
            f.write(bytes([byte[0] ^ 0x40]))

    def plant_pickle(d):
        size = os.path.getsize(f"{d}/{f1}")
        payload = pickle.dumps(_Payload(f"{tmp}/UNPICKLED"))
        with open(f"{d}/{f1}", "wb") as f:
            f.write(payload + b"\0" * (size - len(payload)))
        with open(f"{d}/manifest.json", "wb") as f:
            f.write(pickle.dumps(_Payload(f"{tmp}/UNPICKLED")))

    cases = {
        "missing": (lambda d: os.remove(f"{d}/{f1}"), f"{f1} is missing"),
        "truncated": (lambda d: os.truncate(f"{d}/{f1}", os.path.getsize(f"{d}/{f1}") - 100), f"{f1} is truncated"),
        "flipped": (flip, f"checksum mismatch in shard file {tmp}/flipped/{f1}, tensor 'model/blocks.0.fc.weight'"),
        "no_manifest": (lambda d: os.remove(f"{d}/manifest.json"), "has no manifest.json"),
        "pickle": (plant_pickle, "manifest.json is not valid JSON"),
    }
    for name, (damage, expected) in cases.items():
        messages.append(checkpoint_error(lambda: checkpoint.load(broken(name, damage), model, opt)))
        assert expected in messages[-1], f"{name}: {messages[-1]}"
    pickled = broken(
        "pickle_shard", lambda d: plant_pickle(d) or shutil.copy(f"{tmp}/good/manifest.json", f"{d}/manifest.json")
    )
    messages.append(checkpoint_error(lambda: checkpoint.load(pickled, model, opt)))
    assert f"{f1} is not a safetensors file" in messages[-1], messages[-1]
    assert not os.path.exists(f"{tmp}/UNPICKLED"), "a pickle payload was executed"
    assert_state_equal(full_sd(model), before, "a failed load changed the model")
    return messages + mismatch_worker(tmp)


def mismatch_worker(tmp: str) -> list[str]:
    """A checkpoint of another model: names, then shapes."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import checkpoint
    from flatshard.wrap import ModuleWrapPolicy
    from tests.helpers.models import Block

    messages = []
    _, other, _, _ = build("odd_mlp", "FULL_SHARD")
    messages.append(checkpoint_error(lambda: checkpoint.load(f"{tmp}/good", other)))
    assert "does not match the model: the model's scale, fc1.weight" in messages[-1], messages[-1]
    wide = FSDP(TinyGPT(vocab=41), auto_wrap_policy=ModuleWrapPolicy({Block}))
    messages.append(checkpoint_error(lambda: checkpoint.load(f"{tmp}/good", wide)))
    assert "holds wte.weight with shape (37, 12), the model has (41, 12)" in messages[-1], messages[-1]
    dist.barrier()
    return messages
