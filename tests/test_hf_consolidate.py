"""A Hugging Face model trained under flatshard, checkpointed, consolidated into one safetensors file,
and loaded back by ``transformers``' own ``from_pretrained`` (offline, from a local directory)."""

from __future__ import annotations

import os

import torch

from tests.dist import run_distributed


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
