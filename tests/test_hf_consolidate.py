"""A Hugging Face model trained under flatshard, checkpointed, consolidated into one safetensors file
and into Hugging Face's sharded layout (and cast to bf16), each loaded back by ``transformers``' own
``from_pretrained`` (offline, from a local directory); and the command line's errors for outputs it
cannot write."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.dist import run_distributed


def _config():
    from transformers import GPT2Config

    return GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=97, n_positions=16)


def train_and_save(rank: int, world: int, ckpt: str) -> dict:
    from transformers import GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import checkpoint
    from flatshard.wrap import ModuleWrapPolicy

    torch.manual_seed(0)
    model = FSDP(GPT2LMHeadModel(_config()), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 97, (2, 16), generator=torch.Generator().manual_seed(rank))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    checkpoint.save(ckpt, model, opt, step=1)
    with FSDP.summon_full_params(model):
        full = {n: p.detach().clone() for n, p in model.named_parameters()}
    return full


def test_consolidated_checkpoint_loads_with_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import GPT2LMHeadModel

    from flatshard.checkpoint.tools import consolidate

    ckpt = str(tmp_path / "ckpt")
    trained = run_distributed(train_and_save, 2, ckpt, timeout=180)[0]
    out_dir = tmp_path / "hf"
    out_dir.mkdir()
    consolidate(ckpt, str(out_dir / "model.safetensors"))
    _config().save_pretrained(out_dir)
    loaded = GPT2LMHeadModel.from_pretrained(str(out_dir))
    params = dict(loaded.named_parameters())
    assert set(params) == set(trained), (sorted(params), sorted(trained))
    for name, value in trained.items():
        assert torch.equal(params[name].detach(), value), name
    assert loaded.lm_head.weight is loaded.transformer.wte.weight  # the tie survives the round trip
    assert os.path.getsize(out_dir / "model.safetensors") > 0


def test_sharded_export_and_dtype_load_with_from_pretrained(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import GPT2LMHeadModel

    from flatshard.cli import main

    ckpt = str(tmp_path / "ckpt")
    trained = run_distributed(train_and_save, 2, ckpt, timeout=180)[0]

    sharded = tmp_path / "sharded"
    sharded.mkdir()
    (sharded / "model.safetensors").write_bytes(b"stale")  # from_pretrained would prefer it: removed
    assert main(["consolidate", ckpt, str(sharded), "--max-shard-size", "40KB"]) == 0
    with open(sharded / "model.safetensors.index.json") as f:
        index = json.load(f)
    shards = sorted(set(index["weight_map"].values()))
    n = len(shards)
    assert n >= 3 and shards == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)], shards
    assert sorted(os.listdir(sharded)) == sorted(shards + ["model.safetensors.index.json"]), os.listdir(sharded)
    sizes = [os.path.getsize(sharded / s) for s in shards]
    assert index["metadata"]["total_size"] == sum(int(t.numel()) * 4 for t in _exported(trained).values())
    assert all(size < 40_000 + 1024 for size in sizes[:-1]), sizes  # no shard past the limit (its header aside)
    _config().save_pretrained(sharded)
    loaded = GPT2LMHeadModel.from_pretrained(str(sharded))
    params = dict(loaded.named_parameters())
    assert set(params) == set(trained)
    for name, value in trained.items():
        assert torch.equal(params[name].detach(), value), name

    half = tmp_path / "bf16"
    half.mkdir()
    assert main(["consolidate", ckpt, str(half), "--dtype", "bf16"]) == 0
    assert sorted(os.listdir(half)) == ["model.safetensors"], "one shard: Hugging Face's single-file name"
    _config().save_pretrained(half)
    loaded = GPT2LMHeadModel.from_pretrained(str(half), dtype=torch.bfloat16)
    params = dict(loaded.named_parameters())
    for name, value in trained.items():
        assert params[name].dtype == torch.bfloat16, name
        assert torch.equal(params[name].detach(), value.to(torch.bfloat16)), name

    capsys.readouterr()
    cases = [
        ([str(tmp_path / "missing")], "output directory"),
        ([str(tmp_path / "nowhere" / "model.safetensors")], "does not exist"),
        ([str(tmp_path / "model.bin")], ".safetensors"),
        ([str(tmp_path / "model.safetensors"), "--max-shard-size", "40KB"], "--max-shard-size"),
        ([str(half), "--max-shard-size", "5 parsecs"], "5 parsecs"),
    ]
    for args, expected in cases:
        assert main(["consolidate", ckpt, *args]) != 0, args
        err = capsys.readouterr().err
        assert err.startswith("flatshard consolidate: ") and expected in err and "Traceback" not in err, err
    with pytest.raises(SystemExit):
        main(["consolidate", ckpt, str(half), "--dtype", "int8"])
    assert "invalid choice" in capsys.readouterr().err


def _exported(trained: dict) -> dict:
    """What the export holds: every state-dict key of the trained model (the tied head under both names)."""
    return dict(trained, **{"lm_head.weight": trained["transformer.wte.weight"]})
