"""Small models for the tests: odd shapes (padding), tied weights, frozen parts, buffers, reuse."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class OddMLP(nn.Module):
    """7 → 15 → 3 with a (1,) scale: element counts that never divide evenly by 2, 3 or 4."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(7, 15)
        self.fc2 = nn.Linear(15, 3)
        self.scale = nn.Parameter(torch.tensor([0.5]))

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x))) * self.scale


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(dim)
        # no bias: a key bias gets a gradient that is exactly zero in exact arithmetic (softmax is
        # shift-invariant), so Adam would amplify rounding noise into differences of order lr.
        self.attn = nn.Linear(dim, 3 * dim, bias=False)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, 4 * dim - 1)  # odd width
        self.out = nn.Linear(4 * dim - 1, dim)
        self.heads = heads

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.attn(self.ln1(x)).split(C, dim=2)
        q, k, v = (t.view(B, T, self.heads, C // self.heads).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    """Token embedding tied to the output head; learned positions."""

    def __init__(self, vocab: int = 37, dim: int = 12, heads: int = 2, layers: int = 2, block: int = 8):
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(block, dim)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for b in self.blocks:
            x = b(x)
        return self.head(self.ln_f(x))


class FrozenTrunk(nn.Module):
    """A frozen encoder, a trainable head, and a sub-module used twice in one forward."""

    def __init__(self):
        super().__init__()
        self.trunk = nn.Sequential(nn.Linear(5, 9), nn.Tanh(), nn.Linear(9, 9))
        for p in self.trunk.parameters():
            p.requires_grad_(False)
        self.shared = nn.Linear(9, 9)
        self.head = nn.Linear(9, 2)

    def forward(self, x):
        h = self.trunk(x)
        h = torch.tanh(self.shared(h))
        h = torch.tanh(self.shared(h))  # the same module twice
        return self.head(h)


class WithBuffers(nn.Module):
    """A BatchNorm (running stats) and a counter buffer updated in forward."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.out = nn.Linear(10, 1)
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return self.out(torch.relu(self.bn(self.fc(x))))
