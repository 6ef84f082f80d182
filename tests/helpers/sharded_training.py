"""The few steps of AdamW that tests/test_shard_dims.py and tests/test_tensor_parallel.py train a
``fully_shard`` model for (each data-parallel rank on its own two rows of a seeded batch), and the same
steps on the unsharded model over the whole batch, for comparing every step; and the two-layer MLP that
tests/test_tensor_parallel.py and tests/test_dp_mesh_dims.py shard."""

from __future__ import annotations

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, hidden)
        self.out_proj = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.out_proj(torch.relu(self.in_proj(x)))


def two_mlps(dim: int, hidden: int) -> nn.Sequential:
    """Two MLPs in a row, seeded: the same weights on every rank and in the reference."""
    torch.manual_seed(0)
    return nn.Sequential(MLP(dim, hidden), MLP(dim, hidden))


def train(model: nn.Module, rank: int, world: int, dim: int, steps: int) -> dict:
    """Losses, local gradients and local parameters each step; full parameters at the end. ``rank`` and
    ``world``: the data-parallel rank and size (the rows this rank trains on)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"losses": [], "grads": [], "params": []}
    for _ in range(steps):
        x = torch.randn(2 * world, dim, generator=gen)
        loss = model(x[2 * rank : 2 * rank + 2]).pow(2).mean()
        loss.backward()
        out["grads"].append([p.grad.to_local().clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        out["losses"].append(loss.item())
        out["params"].append([p.to_local().clone() for p in model.parameters()])
    out["full"] = [p.full_tensor() for p in model.parameters()]
    return out


def reference(model: nn.Module, world: int, dim: int, steps: int) -> dict:
    """The same steps unsharded: each step's per-rank losses, and the parameters at the end."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    out: dict = {"losses": []}
    for _ in range(steps):
        x = torch.randn(2 * world, dim, generator=gen)
        per_rank = [model(x[2 * r : 2 * r + 2]).pow(2).mean() for r in range(world)]
        (sum(per_rank) / world).backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append([v.item() for v in per_rank])
    out["full"] = [p.detach().clone() for p in model.parameters()]
    return out
