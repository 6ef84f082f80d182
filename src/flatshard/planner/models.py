"""Where unit sizes come from: a model's shape (presets, Hugging Face-style config numbers or a Hugging
Face ``config.json``) or a module.

A transformer wrapped one unit per layer (``transformer_auto_wrap_policy``, the documents'
recommendation) has L equal layer units and a root unit holding what is in no layer: the token
embedding, the output head, the final norm (and, for GPT, the position embedding). ``ModelShape``
computes those sizes exactly, so ``ModelShape.params()`` is the model's real parameter count
(Llama-2-7B: 6,738,415,616, not 7e9).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flatshard.planner.errors import PlanError


@dataclass(frozen=True)
class ModelShape:
    """The config numbers of a decoder-only transformer.

    arch: ``"llama"`` (RMSNorm, no biases, SwiGLU MLP of three matrices, untied head unless
        ``tied_embeddings``) or ``"gpt"`` (LayerNorm with bias, biased linears, GELU MLP of two
        matrices, learned positions, head tied to the token embedding).
    layers, hidden, vocab, heads: as in a Hugging Face config (num_hidden_layers, hidden_size,
        vocab_size, num_attention_heads).
    kv_heads: key/value heads (grouped-query attention); None means ``heads``.
    intermediate: MLP width; None means 4 * hidden.
    max_positions: learned position table length (gpt only).
    """

    arch: str
    layers: int
    hidden: int
    vocab: int
    heads: int
    kv_heads: int | None = None
    intermediate: int | None = None
    max_positions: int = 0
    tied_embeddings: bool | None = None

    def __post_init__(self) -> None:
        if self.arch not in ("llama", "gpt"):
            raise PlanError(f"unknown architecture {self.arch!r}", "use 'llama' or 'gpt'")
        for name in ("layers", "hidden", "vocab", "heads"):
            if getattr(self, name) < 1:
                raise PlanError(f"model {name} must be >= 1, got {getattr(self, name)}", f"pass a positive --{name}")
        if self.hidden % self.heads:
            raise PlanError(
                f"hidden size {self.hidden} is not divisible by {self.heads} heads", "fix --hidden or --heads"
            )
        if self.heads % self.kv_count:
            raise PlanError(f"{self.heads} heads are not divisible by {self.kv_count} kv heads", "fix --kv-heads")

    @property
    def kv_count(self) -> int:
        return self.kv_heads or self.heads

    @property
    def mlp_width(self) -> int:
        return self.intermediate or 4 * self.hidden

    @property
    def tied(self) -> bool:
        return self.arch == "gpt" if self.tied_embeddings is None else self.tied_embeddings

    def layer_params(self) -> int:
        """Parameter elements in one transformer layer (one unit under per-layer wrapping)."""
        d, i = self.hidden, self.mlp_width
        kv = self.kv_count * (d // self.heads)
        if self.arch == "llama":
            return 2 * d * d + 2 * d * kv + 3 * d * i + 2 * d
        return (d * (d + 2 * kv) + d + 2 * kv) + (d * d + d) + (d * i + i) + (i * d + d) + 4 * d

    def root_params(self) -> int:
        """Parameter elements outside the layers: embeddings, head, final norm (the root unit)."""
        d = self.hidden
        heads = 1 if self.tied else 2
        if self.arch == "llama":
            return heads * self.vocab * d + d
        return heads * self.vocab * d + self.max_positions * d + 2 * d

    def params(self) -> int:
        return self.layers * self.layer_params() + self.root_params()

    def layer_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The parameters of one layer, in module order, as (out, in) matrices and vectors: llama's q, k,
        v, o, gate, up, down and its two norms; gpt's norm, fused qkv, proj, norm, fc, out, with biases.
        Their elements sum to ``layer_params()``; ``shard_boundaries`` "rows" and "params" cut by them."""
        d, i = self.hidden, self.mlp_width
        kv = self.kv_count * (d // self.heads)
        if self.arch == "llama":
            return ((d, d), (kv, d), (kv, d), (d, d), (i, d), (i, d), (d, i), (d,), (d,))
        qkv = d + 2 * kv
        return ((d,), (d,), (qkv, d), (qkv,), (d, d), (d,), (d,), (d,), (i, d), (i,), (d, i), (d,))

    def root_shapes(self) -> tuple[tuple[int, ...], ...]:
        """The root unit's parameters: the token embedding, (gpt) the position table, the final norm and
        an untied head. Their elements sum to ``root_params()``."""
        d = self.hidden
        head = () if self.tied else ((self.vocab, d),)
        if self.arch == "llama":
            return ((self.vocab, d), (d,), *head)
        positions = ((self.max_positions, d),) if self.max_positions else ()
        return ((self.vocab, d), *positions, (d,), (d,), *head)

    def param_tensors(self) -> int:
        """Number of original parameters (tensors): what AdamW keeps one ``step`` tensor for."""
        if self.arch == "llama":
            return 9 * self.layers + (2 if self.tied else 3)
        return 12 * self.layers + (3 if self.tied else 4) + (1 if self.max_positions else 0)


def _llama(layers: int, hidden: int, inter: int, heads: int, kv: int | None = None, vocab: int = 32000) -> ModelShape:
    return ModelShape("llama", layers, hidden, vocab, heads, kv, inter)


def _gpt(layers: int, hidden: int, heads: int, positions: int, vocab: int = 50257) -> ModelShape:
    return ModelShape("gpt", layers, hidden, vocab, heads, None, 4 * hidden, positions)


# The published configs. Llama 1 and Llama 2 share the 7B and 13B shapes (only the context differs).
PRESETS: dict[str, ModelShape] = {
    "gpt2": _gpt(12, 768, 12, 1024),
    "gpt2-xl": _gpt(48, 1600, 25, 1024),
    "gpt3-175b": _gpt(96, 12288, 96, 2048),
    "llama-7b": _llama(32, 4096, 11008, 32),
    "llama-13b": _llama(40, 5120, 13824, 40),
    "llama-33b": _llama(60, 6656, 17920, 52),
    "llama-65b": _llama(80, 8192, 22016, 64),
    "llama2-7b": _llama(32, 4096, 11008, 32),
    "llama2-13b": _llama(40, 5120, 13824, 40),
    "llama2-70b": _llama(80, 8192, 28672, 64, 8),
    "llama3-8b": _llama(32, 4096, 14336, 32, 8, 128256),
    "llama3-70b": _llama(80, 8192, 28672, 64, 8, 128256),
}
_ALIASES = {"gpt3": "gpt3-175b", "gpt-3": "gpt3-175b", "llama-70b": "llama2-70b"}


def _key(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def preset(name: str) -> ModelShape:
    """The shape of a named model; an unknown name is a PlanError listing the known ones."""
    name = _ALIASES.get(name.lower(), name)
    table = {_key(k): v for k, v in PRESETS.items()}
    found = table.get(_key(name))
    if found is None:
        raise PlanError(
            f"unknown model preset {name!r}",
            f"use one of {', '.join(sorted(PRESETS))}, or pass --params N instead of --model",
        )
    return found


# Hugging Face config.json: the model types whose parameters ModelShape counts exactly, and the keys
# each field is read from (Llama-style names first, GPT-2's second).
HF_ARCH = {"llama": "llama", "mistral": "llama", "gpt2": "gpt"}
_HF_KEYS = {
    "layers": ("num_hidden_layers", "n_layer"),
    "hidden": ("hidden_size", "n_embd"),
    "vocab": ("vocab_size",),
    "heads": ("num_attention_heads", "n_head"),
    "kv_heads": ("num_key_value_heads",),
    "intermediate": ("intermediate_size", "n_inner"),
    "max_positions": ("n_positions", "max_position_embeddings"),
}


def shape_from_hf_config(config: dict[str, Any], source: str = "config.json") -> ModelShape:
    """The shape a Hugging Face ``config.json`` describes (Llama, Mistral or GPT-2 models).

    Reads the fields a Llama or GPT-2 config has (``num_hidden_layers``/``n_layer``, ``hidden_size``/
    ``n_embd``, ``vocab_size``, ``num_attention_heads``/``n_head``, ``num_key_value_heads``,
    ``intermediate_size``/``n_inner``, ``n_positions``, ``tie_word_embeddings``). A model type whose
    layers differ from these two (biases in attention, a different MLP) is an error, not a guess."""
    model_type = config.get("model_type")
    arch = HF_ARCH.get(str(model_type))
    if arch is None:
        raise PlanError(
            f"{source}: model_type {model_type!r} is not one the planner counts exactly",
            f"use a config of model_type {', '.join(HF_ARCH)}, or pass --params N with --layers/--hidden/--vocab/"
            "--heads for the activation estimate",
        )
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise PlanError(f"{source}: {flag} is true; the planner's llama layer has no biases", "pass --params N")
    fields: dict[str, Any] = {}
    for name, keys in _HF_KEYS.items():
        value = next((config[k] for k in keys if config.get(k) is not None), None)
        if name in ("layers", "hidden", "vocab", "heads") and value is None:
            raise PlanError(f"{source} has no {' or '.join(keys)}", "pass a complete Hugging Face config.json")
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise PlanError(f"{source}: {keys[0]} must be a whole number >= 1, got {value!r}", "fix the config")
        fields[name] = value
    if arch == "llama" or fields["max_positions"] is None:
        fields["max_positions"] = 0  # llama: rotary positions, no table of parameters
        if fields["intermediate"] is None:
            raise PlanError(f"{source} has no intermediate_size", "pass a complete Hugging Face config.json")
    head_dim = config.get("head_dim")
    if head_dim is not None and head_dim * fields["heads"] != fields["hidden"]:
        raise PlanError(
            f"{source}: head_dim {head_dim} x {fields['heads']} heads is not hidden_size {fields['hidden']}",
            "the planner counts head_dim = hidden_size / heads; pass --params N instead",
        )
    tied = config.get("tie_word_embeddings")
    return ModelShape(arch, tied_embeddings=(arch == "gpt") if tied is None else bool(tied), **fields)


def read_hf_config(path: str) -> ModelShape:
    """``shape_from_hf_config`` of the JSON file at ``path`` (a model directory is read as its config.json)."""
    file = Path(path)
    if file.is_dir():
        file = file / "config.json"
    try:
        config = json.loads(file.read_text())
    except FileNotFoundError:
        raise PlanError(f"no such file: {file}", "pass the path of a Hugging Face config.json") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise PlanError(f"cannot read {file} as JSON: {exc}", "pass a Hugging Face config.json") from exc
    if not isinstance(config, dict):
        raise PlanError(f"{file} holds a JSON {type(config).__name__}, not an object", "pass a config.json")
    return shape_from_hf_config(config, str(file))


def with_overrides(shape: ModelShape, **fields: Any) -> ModelShape:
    """``shape`` with the non-None ``fields`` replaced (config numbers given next to a preset)."""
    changes = {k: v for k, v in fields.items() if v is not None}
    return dataclasses.replace(shape, **changes) if changes else shape


@dataclass(frozen=True)
class ModuleLayout:
    """How a module's parameters fall into units: the root's own elements, each unit's elements
    (in registration order), the number of distinct parameter tensors, and the shapes of each unit's
    parameters and the root's (in module order: the order the engine lays them out in)."""

    root_elements: int
    unit_elements: tuple[int, ...]
    param_tensors: int
    unit_shapes: tuple[tuple[tuple[int, ...], ...], ...] = ()
    root_shapes: tuple[tuple[int, ...], ...] = ()


def layout_from_module(module: Any, units: Iterable[Any] = ()) -> ModuleLayout:
    """Count the parameter elements of ``module`` per unit, the way the engine's units own them.

    ``units`` are the submodules that become units, or module classes (every instance is a unit,
    as ``transformer_auto_wrap_policy`` does). A unit owns its parameters not inside a nested unit;
    the root owns the rest. Shared (tied) parameters count once, for the first owner reached.
    Only the public ``nn.Module`` methods are called, so torch is not imported here.
    """
    picks = list(units)
    classes = tuple(u for u in picks if isinstance(u, type))
    chosen = {id(u) for u in picks if not isinstance(u, type)}

    def is_unit(m: Any) -> bool:
        return m is not module and (id(m) in chosen or (bool(classes) and isinstance(m, classes)))

    counts: dict[int, int] = {id(module): 0}
    shapes: dict[int, list[tuple[int, ...]]] = {id(module): []}
    order: list[int] = []
    seen: set[int] = set()

    def walk(mod: Any, owner: int) -> None:
        for _, p in mod.named_parameters(recurse=False):
            if p is not None and id(p) not in seen:
                seen.add(id(p))
                counts[owner] += p.numel()
                shapes[owner].append(tuple(int(n) for n in p.shape))
        for child in mod.children():
            child_owner = owner
            if is_unit(child):
                child_owner = id(child)
                if child_owner not in counts:
                    counts[child_owner] = 0
                    shapes[child_owner] = []
                    order.append(child_owner)
            walk(child, child_owner)

    walk(module, id(module))
    return ModuleLayout(
        counts[id(module)],
        tuple(counts[u] for u in order),
        len(seen),
        tuple(tuple(shapes[u]) for u in order),
        tuple(shapes[id(module)]),
    )
