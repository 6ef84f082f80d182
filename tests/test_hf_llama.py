"""``fully_shard`` on a Hugging Face ``LlamaForCausalLM``, and annotations that resolve.

``fully_shard`` gives each module it shards a new class, ``FSDP<Cls>(FSDPModule, Cls)``; transformers'
``PreTrainedModel.__init_subclass__`` calls ``typing.get_type_hints`` on every new subclass, so every
annotation on flatshard's classes (``FSDPModule`` and its base ``UnitHost`` included) must name something
importable at run time. Checked on every public class, and end to end: a tiny Llama (eager attention, fp32)
sharded per decoder layer and at the root trains a few AdamW steps at W = 2 with losses and final
parameters bitwise equal (``torch.equal``) to PyTorch's FSDP2 on the same script, on every rank.
"""

from __future__ import annotations

import copy
import importlib
import inspect
import typing

import torch

from tests.helpers.dist import run_distributed

STEPS, PER_RANK, SEQ, VOCAB = 4, 2, 16, 64


def _tiny_llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        vocab_size=VOCAB,
        max_position_embeddings=SEQ,
        attn_implementation="eager",
    )
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def llama_worker(rank: int, world: int) -> dict:
    import torch.distributed.fsdp as torch_fsdp

    import flatshard

    base = _tiny_llama()
    theirs, ours = copy.deepcopy(base), copy.deepcopy(base)
    for model, shard in ((theirs, torch_fsdp.fully_shard), (ours, flatshard.fully_shard)):
        for layer in model.model.layers:
            shard(layer)
        shard(model)
    hints = {cls.__name__: sorted(typing.get_type_hints(cls)) for cls in (type(ours), type(ours.model.layers[0]))}
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (theirs, ours)]
    losses: dict[str, list[float]] = {"FSDP2": [], "flatshard": []}
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * step + rank)
        ids = torch.randint(0, VOCAB, (PER_RANK, SEQ), generator=g)
        for name, model, opt in zip(losses, (theirs, ours), opts):
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    params = {}
    for (name, a), (name_b, b) in zip(theirs.named_parameters(), ours.named_parameters()):
        assert name == name_b, (name, name_b)
        params[name] = (a.to_local().detach().clone(), b.to_local().detach().clone())
    return {"class": type(ours).__name__, "hints": hints, "losses": losses, "params": params}


def test_fully_shard_on_a_hf_llama_matches_pytorch_fsdp2_bitwise():
    for rank, out in enumerate(run_distributed(llama_worker, 2, timeout=240)):
        assert out["class"] == "FSDPLlamaForCausalLM"
        assert "_unit" in out["hints"]["FSDPLlamaForCausalLM"], out["hints"]
        assert "_unit" in out["hints"]["FSDPLlamaDecoderLayer"], out["hints"]
        assert out["losses"]["flatshard"] == out["losses"]["FSDP2"], (rank, out["losses"])
        assert len(out["params"]) == 2 * 9 + 3  # per layer: q k v o, gate up down, two norms
        for name, (theirs, ours) in out["params"].items():
            assert ours.shape == theirs.shape, (rank, name)
            assert torch.equal(ours, theirs), (rank, name, (ours - theirs).abs().max())


def _public_classes() -> list[type]:
    found = []
    for module in ("flatshard", "flatshard.fsdp2", "flatshard.checkpoint"):
        mod = importlib.import_module(module)
        found += [obj for obj in (getattr(mod, name) for name in mod.__all__) if inspect.isclass(obj)]
    return found


def test_annotations_of_public_classes_resolve():
    from flatshard.runtime.tree import UnitHost

    classes = _public_classes()
    assert len(classes) >= 30 and UnitHost not in classes
    for cls in [*classes, UnitHost]:
        typing.get_type_hints(cls)
    assert "_unit" in typing.get_type_hints(UnitHost)
