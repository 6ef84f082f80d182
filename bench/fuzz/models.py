"""The fuzzer's models (bench/fuzz/): a root and a list of blocks drawn from small kinds, each kind
bringing one thing an FSDP engine must get right.

    mlp        Linear(d, h) -> tanh -> Linear(h, d), residual; h odd (padding at every world size)
    scale      a 1-element gain and a 1-D bias: parameters smaller than the number of ranks
    empty      no parameters at all (a unit of its own makes an empty unit)
    container  no parameters of its own, an mlp inside (two nested units, the outer one empty)
    buffer     a Linear, a constant buffer used in forward and a call counter buffer
    twice      one Linear run twice in the same forward
    shared     a Linear whose weight is the root's ``proj`` weight (a tie across units)
    frozen     an mlp whose parameters do not require gradients; with ``"dtype": "fp64"`` (``fully_shard``
               only) its parameters are float64 beside fp32 ones (a flat group of their own), its input
               cast to them and its output back

The root is either tokens (an embedding, optionally tied to the output head, cross-entropy) or dense
(an input Linear, mean squared error). The root's input layer is never frozen, so every block's output
requires grad (a backward hook can always be placed on it). ``spec`` is the JSON ``model`` entry of a
configuration; ``make_model(spec, seed)`` builds the same weights in every process.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


class MLPBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.fc1 = nn.Linear(d, h)
        self.fc2 = nn.Linear(h, d)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class FrozenBlock(MLPBlock):
    def __init__(self, d: int, h: int, dtype: torch.dtype = torch.float32):
        super().__init__(d, h)
        self.requires_grad_(False)
        self.to(dtype)

    def forward(self, x):
        inner = x.to(self.fc1.weight.dtype)  # the same tensor where the dtypes agree
        return x + self.fc2(torch.tanh(self.fc1(inner))).to(x.dtype)


class ScaleBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.gain = nn.Parameter(1.0 + 0.1 * torch.randn(1))
        self.bias = nn.Parameter(0.1 * torch.randn(d))

    def forward(self, x):
        return x + torch.tanh(x * self.gain + self.bias)


class EmptyBlock(nn.Module):
    def forward(self, x):
        return x + 0.5 * torch.tanh(x)


class ContainerBlock(nn.Module):
    def __init__(self, d: int, h: int):
        super().__init__()
        self.inner = MLPBlock(d, h)

    def forward(self, x):
        return torch.tanh(self.inner(x))


class BufferBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)
        self.register_buffer("mask", 0.5 + torch.rand(d))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        self.calls += 1
        return x + torch.tanh(self.lin(x)) * self.mask.to(x.dtype)


class TwiceBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d)

    def forward(self, x):
        return x + torch.tanh(self.lin(torch.tanh(self.lin(x))))


class SharedBlock(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


BLOCKS = {
    "mlp": MLPBlock,
    "frozen": FrozenBlock,
    "scale": ScaleBlock,
    "empty": EmptyBlock,
    "container": ContainerBlock,
    "buffer": BufferBlock,
    "twice": TwiceBlock,
    "shared": SharedBlock,
}
BLOCK_TYPES = tuple(set(BLOCKS.values()))


class Root(nn.Module):
    """``blocks`` between an input layer and a head; ``checkpointed`` runs each block under
    torch.utils.checkpoint (activation checkpointing written in the model's forward)."""

    def __init__(self, spec: dict):
        super().__init__()
        d = spec["d"]
        self.tokens = spec["input"] == "tokens"
        if self.tokens:
            self.wte = nn.Embedding(spec["vocab"], d)
        else:
            self.inp = nn.Linear(spec["d_in"], d)
        self.blocks = nn.ModuleList(_block(b, d) for b in spec["blocks"])
        self.proj = nn.Linear(d, d, bias=False) if any(b["kind"] == "shared" for b in spec["blocks"]) else None
        self.head = nn.Linear(d, spec["vocab"] if self.tokens else spec["d_out"], bias=not self.tokens)
        if self.tokens and spec.get("tie"):
            self.head.weight = self.wte.weight
        for block in self.blocks:
            if isinstance(block, SharedBlock):
                block.lin.weight = self.proj.weight
        for name, p in self.named_parameters():
            if name in spec.get("frozen", ()):
                p.requires_grad_(False)
        self.checkpointed = False

    def forward(self, x):
        x = self.wte(x) if self.tokens else self.inp(x)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.checkpointed else block(x)
        if self.proj is not None:
            x = x + self.proj(x)
        return self.head(x)


def _block(b: dict, d: int) -> nn.Module:
    cls = BLOCKS[b["kind"]]
    if cls is FrozenBlock:
        return cls(d, b["h"], torch.float64 if b.get("dtype") == "fp64" else torch.float32)
    if cls in (MLPBlock, ContainerBlock):
        return cls(d, b["h"])
    return EmptyBlock() if cls is EmptyBlock else cls(d)


def make_model(spec: dict, seed: int) -> Root:
    torch.manual_seed(seed)
    return Root(spec)


def loss_fn(spec: dict, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    out = out.float()  # bf16 outputs under mixed precision: the loss in fp32, as the reference's
    if spec["input"] == "tokens":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.mse_loss(out, target)


def batch(spec: dict, seed: int, step: int, micro: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of ``n`` samples for (step, micro-batch); rank r takes rows [r*m, (r+1)*m)."""
    g = torch.Generator().manual_seed(seed * 7919 + step * 101 + micro)
    if spec["input"] == "tokens":
        shape = (n, spec["seq"])
        return torch.randint(0, spec["vocab"], shape, generator=g), torch.randint(0, spec["vocab"], shape, generator=g)
    return torch.randn(n, spec["d_in"], generator=g), torch.randn(n, spec["d_out"], generator=g)


def trainable_names(spec: dict) -> list[str]:
    """Parameter names the generator may freeze or flip: every one but the input layer's."""
    model = Root(spec)
    return [n for n, _ in model.named_parameters() if not n.startswith(("wte.", "inp."))]


def module_names(spec: dict) -> list[str]:
    """Where an exception may be injected: each block and the head."""
    return [f"blocks.{i}" for i in range(len(spec["blocks"]))] + ["head"]


def unit_modules(model: Root, spec: dict, chosen: list[int]) -> list[nn.Module]:
    """The modules that become units besides the root, innermost first (a container's mlp before it)."""
    out = []
    for i in chosen:
        block = model.blocks[i]
        if spec["blocks"][i]["kind"] == "container":
            out.append(block.inner)
        out.append(block)
    return out
