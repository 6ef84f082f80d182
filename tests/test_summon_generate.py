"""Hugging Face ``generate`` inside ``summon_full_params`` ([Note: forward inside summon_full_params]):
the forwards use the summoned parameters and leave them in place, run no collective, and give the
tokens the unwrapped model gives; with bf16 mixed precision too (where it used to fail with a dtype
error)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.dist import run_distributed


def generate_worker(rank: int, world: int, mixed: bool) -> dict:
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block

    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import MixedPrecision
    from flatshard.wrap import ModuleWrapPolicy

    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=61, n_positions=24)
    torch.manual_seed(0)
    ref = GPT2LMHeadModel(config).eval()
    torch.manual_seed(0)
    mp = MixedPrecision(param_dtype=torch.bfloat16) if mixed else None
    model = FSDP(GPT2LMHeadModel(config), auto_wrap_policy=ModuleWrapPolicy({GPT2Block}), mixed_precision=mp).eval()
    prompt = torch.tensor([[3, 14, 15, 9]])
    with torch.no_grad():
        expected = ref.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
    with FSDP.summon_full_params(model, writeback=False), model.record_comms() as rec:
        with torch.no_grad():
            tokens = model.generate(prompt, max_new_tokens=8, do_sample=False, pad_token_id=0)
        shapes_after = {n: tuple(p.shape) for n, p in model.named_parameters()}
    return {
        "tokens": tokens.tolist() == expected.tolist(),
        "full shapes kept": shapes_after == {n: tuple(p.shape) for n, p in ref.named_parameters()},
        "collectives": rec.count(),
        "shard views after": all(p.dim() == 1 for p in model.parameters()),
    }


@pytest.mark.parametrize("mixed", [False, True])
def test_generate_inside_summon_uses_the_summoned_parameters(mixed):
    expected = {"tokens": True, "full shapes kept": True, "collectives": 0, "shard views after": True}
    assert run_distributed(generate_worker, 2, mixed, timeout=200) == [expected] * 2
