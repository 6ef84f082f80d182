"""``torch.compile`` (inductor, on this CPU) under both front ends, as torchtitan, Lightning and Accelerate
use it: each transformer block compiled, before or after it is sharded, or the whole wrapped model; with
activation checkpointing inside every block.

Each case trains the compiled model beside the same model sharded the same way and run eagerly, and
compares losses and every local shard after every step (PyTorch's default fp32 tolerances: inductor's
kernels round differently from eager's). Compilation is counted with a backend that counts the graphs
dynamo hands it, and dynamo's own count of unique graphs: neither may grow after the first step (a
recompilation per step would be a bug). flatshard's forward hooks are not traced ([Note: hooks under
torch.compile], runtime/hooks.py): one graph serves every block."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tests.helpers.dist import run_distributed
from tests.helpers.models import Block, TinyGPT

STEPS = 3
PER_RANK = 2


class CheckpointedBlock(Block):
    """A block whose forward recomputes its activations in backward (torch.utils.checkpoint, non-reentrant)."""

    def forward(self, x):
        return checkpoint(Block.forward, self, x, use_reentrant=False)


class CountingInductor:
    """A torch.compile backend: inductor, counting the graphs it compiles."""

    def __init__(self):
        self.graphs = 0

    def __call__(self, gm, example_inputs):
        from torch._inductor.compile_fx import compile_fx

        self.graphs += 1
        return compile_fx(gm, example_inputs)


def _model() -> TinyGPT:
    torch.manual_seed(0)
    model = TinyGPT(layers=2)
    for block in model.blocks:
        block.__class__ = CheckpointedBlock
    return model


def _shard(model, front: str, mesh, compile_how: str, backend):
    """Shard ``model`` with one unit per block and the root, compiling as ``compile_how`` says (None: eager).
    Returns the model to call (a whole-model compile returns the compiled wrapper)."""
    from flatshard import FullyShardedDataParallel as FSDP
    from flatshard import ShardingStrategy, fully_shard
    from flatshard.wrap import ModuleWrapPolicy

    if compile_how == "blocks before":
        for block in model.blocks:
            block.compile(backend=backend)
    if front == "fully_shard":
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
        wrapped = model
    else:
        kw = {"sharding_strategy": ShardingStrategy.HYBRID_SHARD, "sharding_factor": 2} if mesh is not None else {}
        wrapped = FSDP(model, auto_wrap_policy=ModuleWrapPolicy({CheckpointedBlock}), **kw)
    if compile_how == "blocks after":  # the blocks as the front end left them: FSDPModules, or wrappers
        for block in wrapped.module.blocks if front == "fsdp1" else model.blocks:
            block.compile(backend=backend)
    if compile_how == "whole model":
        return torch.compile(wrapped, backend=backend)
    return wrapped


def _local(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.to_local() if isinstance(p, DTensor) else p).detach()


def compile_worker(rank: int, world: int, cases: list) -> list:
    from torch._dynamo.utils import counters
    from torch.distributed.device_mesh import init_device_mesh

    torch._dynamo.reset()
    done = []
    for front, compile_how in cases:
        mesh = None
        if world == 4:
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        backend = CountingInductor()
        base = _model()
        eager = _shard(copy.deepcopy(base), front, mesh, None, None)
        compiled = _shard(copy.deepcopy(base), front, mesh, compile_how, backend)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (eager, compiled)]
        graphs_after_first = None
        for step in range(STEPS):
            x = torch.randint(0, 37, (PER_RANK, 8), generator=torch.Generator().manual_seed(100 * step + rank))
            losses = []
            for m, opt in zip((eager, compiled), opts):
                loss = F.cross_entropy(m(x).flatten(0, 1), x.flatten())
                loss.backward()
                opt.step()
                opt.zero_grad()
                losses.append(loss.detach())
            what = f"{front} {compile_how} W={world} step {step}"
            torch.testing.assert_close(losses[1], losses[0], msg=lambda m, w=what: f"{w}: loss {m}")
            for (name, a), b in zip(eager.named_parameters(), compiled.parameters()):
                torch.testing.assert_close(_local(b), _local(a), msg=lambda m, w=what, n=name: f"{w}: {n}: {m}")
            if step == 0:
                graphs_after_first = (backend.graphs, counters["stats"]["unique_graphs"])
                assert backend.graphs >= 1, f"{what}: nothing was compiled"
        now = (backend.graphs, counters["stats"]["unique_graphs"])
        assert now == graphs_after_first, (
            f"{front} {compile_how}: recompiled after the first step: {graphs_after_first} -> {now}"
        )
        done.append((front, compile_how, backend.graphs))
    return done


W2_CASES = [
    ("fully_shard", "blocks after"),
    ("fully_shard", "blocks before"),
    ("fully_shard", "whole model"),
    ("fsdp1", "blocks before"),
    ("fsdp1", "blocks after"),
    ("fsdp1", "whole model"),
]
W4_CASES = [("fully_shard", "blocks after"), ("fsdp1", "blocks before")]


# the 2 x 2 mesh (W = 4) in make test-slow and CI ([Note: two tiers], tests/conftest.py)
@pytest.mark.parametrize(("world", "cases"), [(2, W2_CASES), pytest.param(4, W4_CASES, marks=pytest.mark.slow)])
def test_compiled_blocks_match_eager_without_recompiling(world, cases):
    results = run_distributed(compile_worker, world, cases, timeout=600)
    for done in results:
        assert [(f, c) for f, c, _ in done] == cases
        for front, how, graphs in done:
            if how != "whole model":  # one graph for both blocks: the hooks are not traced, the blocks alike
                assert graphs == 1, (front, how, graphs)
