"""A small byte-level GPT for examples/train_gpt.py: plain PyTorch, nothing flatshard-specific.

Pre-norm transformer blocks (causal self-attention, then a 4x MLP), learned positions, and the token
embedding tied to the output head. ``Block`` is the class the training script wraps as one flatshard
unit each; the embeddings, the final norm and the (tied) head stay in the root unit.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    layers: int
    dim: int
    heads: int
    block_size: int  # longest context the model sees (learned positions)
    vocab: int = 256  # bytes


# Sizes, smallest first. "small" is the default: about a minute of training on two CPU cores.
PRESETS = {
    "tiny": GPTConfig(layers=2, dim=32, heads=2, block_size=32),
    "small": GPTConfig(layers=4, dim=96, heads=4, block_size=64),
    "medium": GPTConfig(layers=6, dim=192, heads=6, block_size=128),
    "large": GPTConfig(layers=8, dim=384, heads=8, block_size=256),
}


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.heads = cfg.heads
        self.ln1 = nn.LayerNorm(cfg.dim)
        self.qkv = nn.Linear(cfg.dim, 3 * cfg.dim)
        self.proj = nn.Linear(cfg.dim, cfg.dim)
        self.ln2 = nn.LayerNorm(cfg.dim)
        self.fc = nn.Linear(cfg.dim, 4 * cfg.dim)
        self.out = nn.Linear(4 * cfg.dim, cfg.dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.dim % cfg.heads:
            raise ValueError(f"dim ({cfg.dim}) must be a multiple of heads ({cfg.heads})")
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab, cfg.dim)
        self.wpe = nn.Embedding(cfg.block_size, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, cfg.vocab, bias=False)
        self.head.weight = self.wte.weight  # tied: one parameter, used twice
        self.apply(self._init)
        for block in self.blocks:  # residual projections scaled down with depth, as in GPT-2
            for layer in (block.proj, block.out):
                nn.init.normal_(layer.weight, std=0.02 / (2 * cfg.layers) ** 0.5)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Logits (B, T, vocab) for token ids ``idx`` (B, T), T <= block_size."""
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def flops_per_token(cfg: GPTConfig, seq_len: int) -> int:
    """Training FLOPs per token (forward and backward) of ``GPT(cfg)`` on sequences of ``seq_len``.

    Every matrix multiply costs 2 FLOPs per weight per token forward and 4 backward, 6 in all: per
    block the qkv (3·d²), output (d²) and MLP (8·d²) weights, and the (tied) head's d·V; embedding
    lookups, norms and biases are left out, as is usual. Attention adds its two products per layer,
    QKᵀ and AV, 2·2·T·d FLOPs per token forward, counted over the full T×T matrix as PaLM's appendix
    counts them (causal masking skips half: the figure is the one MFU is quoted with)."""
    d, layers = cfg.dim, cfg.layers
    matmul_weights = layers * 12 * d * d + d * cfg.vocab
    return 6 * matmul_weights + 3 * layers * 4 * seq_len * d


@torch.no_grad()
def generate(
    model: nn.Module,
    idx: torch.Tensor,
    new_tokens: int,
    block_size: int,
    temperature: float = 0.8,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Sample ``new_tokens`` more tokens after ``idx`` (B, T), one forward per token.

    Under flatshard every rank must call this the same number of times with the same shapes: each
    forward all-gathers every unit. With the same ``generator`` seed on every rank they also agree
    on the text."""
    for _ in range(new_tokens):
        logits = model(idx[:, -block_size:])[:, -1, :] / temperature
        nxt = torch.multinomial(F.softmax(logits, dim=-1), 1, generator=generator)
        idx = torch.cat([idx, nxt], dim=1)
    return idx
