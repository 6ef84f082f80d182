"""A small Mixture-of-Experts transformer built as torchtitan builds its MoE models (our own code): each
block is attention then an MoE feed-forward with a top-k token-choice router, a shared expert, and grouped
expert weights (one 3-D parameter per projection, experts on dim 0). Expert parallelism is the model's
own: a rank holds ``num_experts / ep`` local experts and sends each token to the rank of its expert with an
all-to-all over the ``ep`` process group, then back (``all_to_all_single_autograd``, so backward sends the
gradients the other way).

``shard`` applies ``fully_shard`` (flatshard's or PyTorch's FSDP2, the same script) as torchtitan 0.3.0 does
(its distributed/fsdp.py, with EP): each block's call places the experts' parameters on the expert-FSDP mesh
(``shard_placement_fn`` returning ``ShardPlacementResult``; along dim 1 where that mesh's size times ``ep``
exceeds the experts, else dim 0) and every other parameter on the data-parallel mesh of every rank, so one
call holds two meshes; each block's and the root's gradients divided by the data-parallel size. (Older
torchtitan gave the experts a ``fully_shard`` call of their own on the expert-FSDP mesh, under the block's
call on another mesh: flatshard refuses units of different process groups under one root, NotBuiltError.)

Test knobs on each MoE layer: ``forced`` (a function of the tokens giving the expert indices instead of
the router's top-k, the router's scores still gathered at them) and ``skip_idle`` (the experts' forward
returns at once when this rank received no token, so their parameters get no gradient on that rank).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.out = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.out(F.scaled_dot_product_attention(q, k, v, is_causal=True))


class FeedForward(nn.Module):
    """SwiGLU, the shared expert."""

    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=False)
        self.w2 = nn.Linear(hidden, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class GroupedExperts(nn.Module):
    """This rank's experts: ``w1``/``w3`` of shape (local, hidden, dim), ``w2`` (local, dim, hidden)."""

    def __init__(self, full: dict[str, torch.Tensor], first: int, local: int) -> None:
        super().__init__()
        for name, t in full.items():
            setattr(self, name, nn.Parameter(t[first : first + local].clone()))
        self.skip_idle = False
        self.tokens = -1  # how many tokens the last forward received

    def forward(self, x, counts: list[int]):
        from torch.distributed.tensor import DTensor

        self.tokens = x.shape[0]
        if self.skip_idle and x.shape[0] == 0:
            return x  # no token reached this rank's experts: their parameters take no part
        # DTensor experts (``as_dtensors``): this rank's own, as torchtitan's GroupedExperts reads them
        w1, w2, w3 = (w.to_local() if isinstance(w, DTensor) else w for w in (self.w1, self.w2, self.w3))
        outs = []
        for i, xe in enumerate(torch.split(x, counts)):  # torchtitan's for-loop path (no grouped_mm on CPU)
            h = F.silu(xe @ w1[i].t()) * (xe @ w3[i].t())
            outs.append(h @ w2[i].t())
        return torch.cat(outs)

    def as_dtensors(self, ep_mesh) -> None:
        """Each weight a DTensor on the ``ep`` mesh, ``Shard(0)``: the local experts are this rank's piece of
        the whole (num_experts, ...) weight, as torchtitan's expert parallelism places them."""
        from torch.distributed.tensor import DTensor, Shard

        for name in ("w1", "w2", "w3"):
            local = getattr(self, name).detach()
            setattr(self, name, nn.Parameter(DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False)))


class MoE(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, ep_group, seed: int) -> None:
        super().__init__()
        self.num_experts, self.top_k, self.ep_group = num_experts, top_k, ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.local = num_experts // self.ep
        ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        g = torch.Generator().manual_seed(seed)  # every expert drawn alike on every rank, this rank's kept

        def draw(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g) / shape[-1] ** 0.5

        full = {
            "w1": draw(num_experts, hidden, dim),
            "w2": draw(num_experts, dim, hidden),
            "w3": draw(num_experts, hidden, dim),
        }
        self.gate = nn.Linear(dim, num_experts, bias=False)  # the router
        self.experts = GroupedExperts(full, ep_rank * self.local, self.local)
        self.shared_expert = FeedForward(dim, hidden)
        self.forced: Optional[Callable[[torch.Tensor], torch.Tensor]] = None

    def forward(self, x):
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        scores = torch.sigmoid(self.gate(x))
        if self.forced is None:
            top, idx = torch.topk(scores, self.top_k, dim=1)
        else:
            idx = self.forced(x)
            top = scores.gather(1, idx)
        top = top / top.sum(dim=1, keepdim=True)
        flat = idx.reshape(-1)
        order = torch.argsort(flat, stable=True)  # tokens grouped by expert
        token = order // self.top_k
        counts = torch.bincount(flat, minlength=self.num_experts)
        routed, back = self._dispatch(x[token], counts)
        out = back(self.experts(*routed)) * top.reshape(-1)[order].unsqueeze(1)
        combined = torch.zeros_like(x).index_add(0, token, out)
        return (combined + self.shared_expert(x)).reshape(shape)

    def _dispatch(self, sorted_x, counts) -> tuple[tuple[torch.Tensor, list[int]], Callable[[torch.Tensor], Any]]:
        """Send each token to its expert's rank; returns (tokens by local expert, their counts) and the
        function that brings the experts' outputs back in ``sorted_x``'s order."""
        if self.ep == 1:
            return (sorted_x, counts.tolist()), lambda out: out
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        got = torch.empty_like(counts)
        dist.all_to_all_single(got, counts, group=self.ep_group)  # per source rank, per local expert
        by_src = got.view(self.ep, self.local).tolist()
        send = counts.view(self.ep, self.local).sum(1).tolist()
        recv = [sum(row) for row in by_src]
        arrived = all_to_all_single_autograd(sorted_x, recv, send, self.ep_group)
        starts, at = [], 0
        for row in by_src:
            starts.append([])
            for c in row:
                starts[-1].append(at)
                at += c
        perm = [
            i
            for e in range(self.local)
            for s in range(self.ep)
            for i in range(starts[s][e], starts[s][e] + by_src[s][e])
        ]
        perm_t = torch.tensor(perm, dtype=torch.long)
        inverse = torch.argsort(perm_t)
        local_counts = [sum(by_src[s][e] for s in range(self.ep)) for e in range(self.local)]

        def back(out: torch.Tensor) -> torch.Tensor:
            return all_to_all_single_autograd(out[inverse], send, recv, self.ep_group)

        return (arrived[perm_t], local_counts), back


class Block(nn.Module):
    def __init__(self, dim: int, hidden: int, num_experts: int, top_k: int, ep_group, seed: int) -> None:
        super().__init__()
        self.attention_norm = nn.RMSNorm(dim)
        self.attention = Attention(dim)
        self.ffn_norm = nn.RMSNorm(dim)
        self.moe = MoE(dim, hidden, num_experts, top_k, ep_group, seed)

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.moe(self.ffn_norm(x))


class MoETransformer(nn.Module):
    def __init__(
        self, vocab: int, dim: int, hidden: int, num_experts: int, top_k: int, layers: int, ep_group=None
    ) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(Block(dim, hidden, num_experts, top_k, ep_group, 1000 + i) for i in range(layers))
        self.norm = nn.RMSNorm(dim)
        self.output = nn.Linear(dim, vocab, bias=False)

    def forward(self, idx):
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))

    def moes(self) -> list[MoE]:
        return [layer.moe for layer in self.layers]


def build(*args, seed: int = 0, **kw) -> MoETransformer:
    """A model drawn from ``seed`` (the same on every call: a process group does not deepcopy)."""
    torch.manual_seed(seed)
    return MoETransformer(*args, **kw)


def _divide(module, factor: int) -> None:
    """Gradients divided by ``factor`` (the data-parallel size), by a sum then a division: FSDP2 would
    otherwise ask gloo for a PREMUL_SUM, which it does not have (torchtitan's setting too)."""
    module.set_gradient_divide_factor(float(factor))
    module.set_force_sum_reduction_for_comms(True)


def meshes(world: int, ep: int):
    """(the data-parallel mesh of every rank, the expert-FSDP mesh, the ``ep`` process group) on a
    (efsdp, ep) layout: ep groups of consecutive ranks, each expert-FSDP group the ranks holding the same
    experts."""
    from torch.distributed.device_mesh import init_device_mesh

    dp = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    two = init_device_mesh("cpu", (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
    return dp, two["efsdp"], two["ep"].get_group()


def ep_mesh(efsdp):
    """The ``ep`` dim of the (efsdp, ep) mesh ``meshes`` sliced ``efsdp`` from."""
    root = efsdp._get_root_mesh()
    return root["ep"]


def expert_dim(efsdp_size: int, ep: int, num_experts: int) -> int:
    """torchtitan's choice: shard the experts along dim 1 where the expert-FSDP degree times EP exceeds
    the experts (fewer local experts than expert-FSDP ranks), else along dim 0."""
    return 1 if efsdp_size * ep > num_experts else 0


def shard(model: MoETransformer, fully_shard, dp, efsdp, num_experts: int, ep: int, **kw) -> None:
    """Shard ``model`` as torchtitan does (module docstring)."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import FSDPMeshInfo, ShardPlacementResult
    from torch.distributed.tensor import Shard

    dim = expert_dim(efsdp.size(), ep, num_experts)
    info, dense = FSDPMeshInfo(mesh=efsdp, shard_mesh_dim=0), FSDPMeshInfo(mesh=dp, shard_mesh_dim=0)
    for layer in model.layers:
        ids = {id(p) for p in layer.moe.experts.parameters()}

        def place(p, ids=ids):
            if id(p) in ids:
                return ShardPlacementResult(placement=Shard(dim), mesh_info=info)
            return ShardPlacementResult(placement=Shard(0), mesh_info=dense)

        fully_shard(layer, mesh=dp, shard_placement_fn=place, **kw)
        _divide(layer, dp.size())
    fully_shard(model, mesh=dp, **kw)
