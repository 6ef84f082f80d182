"""The single-process reference of a mixed-precision configuration of the fuzzer (bench/fuzz/): the same
casts as the ranks, in one process.

[Note: a reference that rounds as the ranks do]
A configuration with bf16 parameters is not compared with an fp32 run (which rounds differently by design,
so only a loose tolerance growing with the steps could hold them together) but with a reference that
performs the ranks' casts itself, so that it differs from them only by the order of the reduction:
* fp32 masters: the reference model's parameters stay fp32, and its optimizer steps them with fp32
  gradients, as the ranks' optimizers step their fp32 shards;
* for every micro-batch, each rank k of the data-parallel world is run in turn: every floating parameter's
  data is swapped for its cast to the compute dtype (as the all-gather casts the flat shard), the
  floating input cast so too (``cast_root_forward_inputs``), forward and backward on rank k's rows, giving
  rank k's local gradient in the compute dtype; buffers are put back before each rank, so they advance
  once per micro-batch as on a rank;
* accumulation over the micro-batches of a window as the front end does it: the FSDP1 wrapper leaves it
  to autograd on the unsharded flat, in the compute dtype; ``fully_shard`` keeps it in the reduce dtype
  (``FlatGroup.keep_unsynced_gradient``);
* the reduction in the reduce dtype, in flatshard's order for this rank's shard: the shard group's sum as
  the gloo exchange adds it (rank r-1's contribution, + r's own, + r-2's, ... : gloo_exchange.
  reduce_scatter), then the replicas' sums; divided by W in the reduce dtype and cast to fp32.
In fp32 a different order of the additions moves the last bit only, so every comparison is at fp32's
defaults. In bf16 each partial sum rounds to 8 bits, so the order matters from three addends on: the
reference sums in flatshard's order for this rank's shard, but the other ranks' shards are summed in their
own orders (and an all-reduce over replicas in gloo's), so a bf16 reduce dtype is drawn only where every
sum has at most two addends (shard groups and replicas of at most 2: a + b = b + a), fp32 elsewhere
(config.py). Not emulated, so not compared with the reference: tensor parallelism's split matmuls, and
parameters that gather themselves (a swap of a subclass's data is not its cast); those configurations are
compared with PyTorch's FSDP2, which computes them alike, at the tolerances of [Note: fuzz tolerances].
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def groups_of(cfg: dict, world: int) -> tuple[int, int]:
    """(F, R): the shard group's size and the replicas', for ``cfg``'s strategy (one phase's) at ``world``."""
    if cfg["front"] == "fsdp1":
        if cfg["strategy"] == "NO_SHARD":
            return 1, world
        return cfg["F"], world // cfg["F"]
    if cfg.get("mesh") == "2d":
        return cfg["F"], world // cfg["F"]
    return world, 1


def emulated(cfg: dict) -> bool:
    """Whether the reference performs this configuration's casts ([Note: a reference that rounds as the
    ranks do]): bf16 parameters, no tensor parallelism and no parameter that gathers itself."""
    return bool(cfg.get("mp")) and not cfg.get("tp") and not cfg.get("gathers_itself")


def reduce_like_the_ranks(grads: list[torch.Tensor], F: int, R: int, rank: int) -> torch.Tensor:
    """The sum of the ranks' gradients (in the reduce dtype, indexed by rank) as this rank's shard of it is
    summed, divided by the world's size."""
    s, n = rank % F, F

    def shard_group_sum(b: int) -> torch.Tensor:
        members = [b * F + i for i in range(F)]
        if n == 1:
            return grads[members[0]].clone()
        out = grads[members[(s - 1) % n]].clone()
        out.add_(grads[members[s]])
        for k in range(2, n):
            out.add_(grads[members[(s - k) % n]])
        return out

    sums = [shard_group_sum(b) for b in range(R)]
    mine = min(rank // F, R - 1)  # a replay at another world size: any replica's order
    total = sums[mine]
    for b in range(R):  # two replicas: a + b, in either order; more: drawn in fp32 only (config.py)
        if b != mine:
            total = total + sums[b]
    total.div_(float(F * R))
    return total.float()


def _cast(data: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``data`` in ``dtype``; a parameter that gathers itself (gathers.py) keeps its class around it."""
    inner = getattr(data, "_data", None)
    return type(data)(inner.to(dtype)) if inner is not None else data.to(dtype)


class CastReference:
    """Runs the reference model's micro-batches as the ranks do, with their casts."""

    def __init__(self, model: nn.Module, cfg: dict, groups_cfg: dict, world: int, rank: int):
        self.model, self.world, self.rank = model, world, rank
        self.compute, self.reduce = DTYPES[cfg["mp"]["param"]], DTYPES[cfg["mp"]["reduce"]]
        self.acc_dtype = self.compute if cfg["front"] == "fsdp1" else self.reduce
        self.F, self.R = groups_of(groups_cfg, world)
        self.params = [p for p in model.parameters() if p.is_floating_point()]
        self.acc: list[dict[int, torch.Tensor]] = [{} for _ in range(world)]

    def micro(self, spec: dict, x: torch.Tensor, y: torch.Tensor, m: int, accum: int, skip) -> Optional[torch.Tensor]:
        """One micro-batch on every rank in turn; this rank's loss. ``skip()`` raises where the loop finds
        the loss not finite (before any backward)."""
        from bench.fuzz.models import loss_fn

        buffers = [(b, b.detach().clone()) for b in self.model.buffers()]
        mine = None
        for k in range(self.world):
            with torch.no_grad():
                for b, saved in buffers:
                    b.copy_(saved)
            kept = [(p, p.data, p.grad) for p in self.params]
            try:
                for p, data, _ in kept:
                    p.grad = None
                    p.data = _cast(data, self.compute)
                rows = slice(k * m, (k + 1) * m)
                xin = x[rows].to(self.compute) if x.is_floating_point() else x[rows]
                loss = loss_fn(spec, self.model(xin), y[rows]) / accum
                if k == self.rank:
                    mine = loss.detach()
                skip()
                loss.backward()
                for p in self.params:
                    if p.grad is None:
                        continue
                    held = self.acc[k].get(id(p))
                    if held is None:
                        self.acc[k][id(p)] = p.grad.to(self.acc_dtype)
                    else:
                        held.add_(p.grad)
            finally:
                for p, data, grad in kept:
                    p.grad = None
                    p.data = data
                    p.grad = grad
        return mine

    def reduce_into_grads(self) -> None:
        """The window's reduction onto the fp32 masters' ``.grad``."""
        for p in self.params:
            local = [acc.get(id(p)) for acc in self.acc]
            if all(g is None for g in local):
                continue
            grads = [torch.zeros(p.shape, dtype=self.reduce) if g is None else g.to(self.reduce) for g in local]
            total = reduce_like_the_ranks(grads, self.F, self.R, self.rank)
            p.grad = total if p.grad is None else p.grad + total
        self.discard()

    def discard(self, zeros: bool = False) -> None:
        """Drop the window's accumulation; ``zeros``: a loop's zero_grad(set_to_none=False) follows, which
        leaves a zero gradient where an unwrapped model's micro-batches had given one."""
        if zeros:
            held = {i for acc in self.acc for i in acc}
            for p in self.params:
                if id(p) in held and p.grad is None:
                    p.grad = torch.zeros_like(p)
        self.acc = [{} for _ in range(self.world)]
