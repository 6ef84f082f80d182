"""What the planner is asked: frozen, documented, validated input dataclasses.

Build a ``PlanInputs`` directly from unit sizes, or with ``PlanInputs.from_params`` (P elements in M
equal units, the documents' setting), ``from_shape`` (a transformer's config numbers, one unit per
layer plus the root) or ``from_module`` (an ``nn.Module`` and the submodules that become units).
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterable
from dataclasses import dataclass, field, replace
from typing import Any

from flatshard.planner.boundaries import PLANNED, numel_of
from flatshard.planner.errors import PlanError
from flatshard.planner.models import ModelShape, layout_from_module


class Strategy(str, enum.Enum):
    """The five strategies, named as PyTorch FSDP's ``ShardingStrategy`` names them."""

    FULL_SHARD = "FULL_SHARD"
    SHARD_GRAD_OP = "SHARD_GRAD_OP"
    NO_SHARD = "NO_SHARD"
    HYBRID_SHARD = "HYBRID_SHARD"
    _HYBRID_SHARD_ZERO2 = "_HYBRID_SHARD_ZERO2"

    @property
    def reshard_after_forward(self) -> bool:
        """FULL_SHARD and HYBRID_SHARD free a unit after its forward and gather it again in backward."""
        return self in (Strategy.FULL_SHARD, Strategy.HYBRID_SHARD)


@dataclass(frozen=True)
class PrecisionRecipe:
    """Bytes per element of each tensor of a unit (the names are DESIGN.md's).

    master_bytes: the *flat shard*, persistent; what the optimizer updates.
    grad_shard_bytes: the *grad shard*, persistent; what ``.grad`` of the shard views shows.
    compute_bytes: the *unsharded flat* (filled by all-gather) and activations.
    reduce_bytes: the unsharded gradient and the reduce-scatter / all-reduce payload.

    [Note: bf16-mixed accounting]
    The documents count bf16 mixed precision as 2 (bf16 params) + 2 (bf16 grads) + 4 (fp32 master)
    + 8 (Adam) = 16 bytes per parameter. In flatshard the fp32 master *is* the flat shard and the
    optimizer's ``.grad`` must match its dtype, so the persistent state is 4 (master) + 4 (fp32 grad
    shard) + 8 (Adam) = 16 bytes per element of shard: the same total, split differently. The bf16
    copies exist only while a unit is gathered (compute copy, 2 bytes per element of the unit) and
    until its reduce-scatter (unsharded gradient, 2 bytes per element); they are transient bytes.
    """

    name: str
    master_bytes: int
    grad_shard_bytes: int
    compute_bytes: int
    reduce_bytes: int


FP32 = PrecisionRecipe("fp32", 4, 4, 4, 4)
BF16_MIXED = PrecisionRecipe("bf16-mixed", 4, 4, 2, 2)
PRECISIONS = {r.name: r for r in (FP32, BF16_MIXED)}

# Optimizer state bytes per shard element, and per original parameter tensor (AdamW's ``step``).
OPTIMIZERS: dict[str, tuple[int, int]] = {"adam": (8, 4), "sgd-momentum": (4, 0), "sgd": (0, 0)}
_OPTIMIZER_ALIASES = {"adamw": "adam", "sgd_momentum": "sgd-momentum", "momentum": "sgd-momentum"}


@dataclass(frozen=True)
class Links:
    """Alpha-beta parameters per link class ([Note: planner communication model], comm.py).

    intra_bandwidth: bytes/s per rank per direction between ranks of one node, all ranks at once.
    inter_bandwidth: bytes/s one rank can send to other nodes (per direction).
    inter_node_bandwidth: bytes/s one node's link carries to other nodes, all its ranks together.
        None (the default): ``gpus_per_node`` x ``inter_bandwidth``, a NIC per rank, so that
        ``inter_bandwidth`` is also every rank's share when all send at once (a GPU cluster). Where the
        ranks of a node share one link (many CPU clusters), give the link's rate here and what one rank
        gets by itself as ``inter_bandwidth``.
    intra_latency_s, inter_latency_s: per step of a collective (a peer of an exchange, a hop of a ring).

    Defaults are the documents' hardware: NVLink 3 at 600 GB/s bidirectional (300 GB/s each way)
    inside a node, 200 Gb/s InfiniBand (25 GB/s) between nodes, one per GPU. The latencies are this
    planner's assumption; the documents give none.
    """

    intra_bandwidth: float = 300e9
    inter_bandwidth: float = 25e9
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 10e-6
    inter_node_bandwidth: float | None = None

    def __post_init__(self) -> None:
        for name in ("intra_bandwidth", "inter_bandwidth", "inter_node_bandwidth"):
            value = getattr(self, name)
            if name == "inter_node_bandwidth" and value is None:
                continue
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise PlanError(f"{name} must be positive, got {value}", "pass e.g. 25GB/s")
        for name in ("intra_latency_s", "inter_latency_s"):
            if not getattr(self, name) >= 0:
                raise PlanError(f"{name} must be >= 0, got {getattr(self, name)}", "pass e.g. 5e-6")

    def node_bandwidth(self, ranks_per_node: int) -> float:
        """Bytes/s one node's link carries across: ``inter_node_bandwidth``, or a NIC per rank."""
        if self.inter_node_bandwidth is not None:
            return self.inter_node_bandwidth
        return ranks_per_node * self.inter_bandwidth


EXCHANGES = ("ring", "direct")  # how all-gathers and reduce-scatters move: NCCL's ring, flatshard's gloo exchange


@dataclass(frozen=True)
class PlanInputs:
    """Everything one plan depends on. Sizes are parameter *elements*; memory is bytes.

    unit_elements: elements of each non-root unit, in forward order (T_u).
    root_elements: the root unit's own elements (what no other unit holds). The root stays gathered
        from its forward to the end of its backward. 0 means root-less, the documents' setting.
    world_size: W ranks. gpus_per_node: G ranks per node; shard groups are contiguous ranks.
    device_memory_bytes, headroom: a plan fits when peak <= (1 - headroom) * device memory.
    precision: "fp32", "bf16-mixed" or a PrecisionRecipe. optimizer: "adam", "sgd-momentum", "sgd".
    param_tensors: number of original parameters; with Adam each rank holds a 4-byte ``step``
        tensor per parameter (0 leaves the term out, as the documents do).
    prefetch_depth: units gathered ahead of the one computing (engine default 0).
    micro_batch, seq_len, activation_checkpointing, flash_attention, shape: the activation
        estimate (0 without a shape, micro-batch and sequence length); activation_bytes overrides it.
    compute_time_s, or device_flops (achieved FLOP/s) with micro_batch * seq_len tokens: compute
        per step; neither means the step time is communication only.
    links: the alpha-beta figures of the two link classes (``Links``). exchange: how all-gathers and
        reduce-scatters move, "ring" (NCCL on GPUs, the default) or "direct" (flatshard's point-to-point
        exchange on gloo: of a rank's n - 1 chunks only those to other nodes cross); all-reduces are
        rings either way ([Note: planner communication model]). overlap_all_reduce: whether the
        replicate-group all-reduces overlap backward compute in the ``overlapped`` time (prefetch >= 1);
        False exposes them all.
    optimizer_time_s: the optimizer step of the whole model on one rank, seconds; a rank steps 1/F of
        it. None: not counted.
    inter_node_in_flight: as the engine's keyword (default True): what crosses nodes is left in flight
        while backward goes on ([Note: planner step schedule], steptime.py).
    sharding_factors: restrict the plans to these F (each must divide W); None means every divisor.
    offload: show the CPU offload plans (``CPUOffload(offload_params=True)``) in the JSON and table;
        they are computed for every plan regardless, and the recommendation names them when nothing
        fits without (see offload.py, [Note: planner CPU offload model]).
    host_memory_bytes: host (CPU) memory per node, shared by the node's ranks; an offload plan fits
        when its host bytes per node <= (1 - headroom) * host memory. None (the default): unknown,
        the host need is reported and not judged (an offload plan's ``fits`` is then None).
    pcie_bandwidth: host<->device copy bytes/s per rank per direction (default 25e9: PCIe Gen4 x16,
        32 GB/s raw, about 25 achieved).
    units_defaulted: the unit count was not given and defaulted to 1 (``flatshard plan --params``
        without ``--units``); the advice to use more, smaller units then says so.
    shard_boundaries: "flat" (the default), "rows" or "params", as given to the engine (or "chunks",
        fully_shard's dim-0 chunks of every parameter): where each unit
        is cut between the ranks of a shard group (planner/boundaries.py cuts as the engine does), which
        sets the largest rank's bytes and the largest shard each all-gather and reduce-scatter waits on
        ([Note: planner memory model]). It needs the parameters' shapes: ``unit_param_shapes`` (for
        each unit, its parameters' shapes in module order) and ``root_param_shapes``, which
        ``from_shape`` and ``from_module`` fill in; with unit sizes only the figures are flat's, and
        the report says so (``boundaries_note``).
    optimizer_across_replicas: as the engine's ``shard_optimizer_across_replicas=True``: the hybrid
        strategies at 1 < F < W split gradients and optimizer state over all W ranks (pieces of
        ceil(T_u / W) elements), reduce-scatter across the replicas instead of all-reducing and gather the
        updated pieces in the next forward ([Note: planner memory model], [Note: planner communication
        model], [Note: planner step schedule]). ``plan`` then lists these plans beside the plain ones
        (``StrategyPlan.label`` "HYBRID_SHARD+OptR"); ``plan_strategy`` of a hybrid at 1 < F < W gives
        them; every other strategy and F is planned as without. Needs shard_boundaries "flat".
    host_bandwidth: bytes/s per node at which the CPUs get through the optimizer step's minimal
        traffic (read and write master and state, read the gradient); default 100e9, an assumption
        (about a third of a two-socket DDR4-3200 server's STREAM bandwidth; eager PyTorch CPU Adam
        passes over the state several times).
    """

    world_size: int
    unit_elements: tuple[int, ...]
    root_elements: int = 0
    gpus_per_node: int = 8
    device_memory_bytes: int = 80 * 10**9
    headroom: float = 0.1
    precision: str | PrecisionRecipe = "fp32"
    optimizer: str = "adam"
    param_tensors: int = 0
    prefetch_depth: int = 0
    micro_batch: int = 0
    seq_len: int = 0
    activation_checkpointing: bool = False
    flash_attention: bool = True
    shape: ModelShape | None = None
    activation_bytes: int | None = None
    compute_time_s: float | None = None
    device_flops: float | None = None
    links: Links = field(default_factory=Links)
    exchange: str = "ring"
    overlap_all_reduce: bool = True
    optimizer_time_s: float | None = None
    inter_node_in_flight: bool = True
    sharding_factors: tuple[int, ...] | None = None
    offload: bool = False
    host_memory_bytes: int | None = None
    pcie_bandwidth: float = 25e9
    host_bandwidth: float = 100e9
    units_defaulted: bool = False
    shard_boundaries: str = "flat"
    unit_param_shapes: tuple[tuple[tuple[int, ...], ...], ...] | None = None
    root_param_shapes: tuple[tuple[int, ...], ...] | None = None
    optimizer_across_replicas: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "unit_elements", tuple(int(t) for t in self.unit_elements))
        if self.sharding_factors is not None:
            object.__setattr__(self, "sharding_factors", tuple(sorted({int(f) for f in self.sharding_factors})))
        name = _OPTIMIZER_ALIASES.get(self.optimizer, self.optimizer)
        object.__setattr__(self, "optimizer", name)
        if self.unit_param_shapes is not None:
            shapes = tuple(tuple(tuple(int(n) for n in s) for s in unit) for unit in self.unit_param_shapes)
            object.__setattr__(self, "unit_param_shapes", shapes)
        if self.root_param_shapes is not None:
            object.__setattr__(
                self, "root_param_shapes", tuple(tuple(int(n) for n in s) for s in self.root_param_shapes)
            )
        _validate(self)

    # -- derived ------------------------------------------------------------------------------
    @property
    def recipe(self) -> PrecisionRecipe:
        return self.precision if isinstance(self.precision, PrecisionRecipe) else PRECISIONS[self.precision]

    @property
    def params(self) -> int:
        """P: all parameter elements, root included."""
        return self.root_elements + sum(self.unit_elements)

    @property
    def shapes_known(self) -> bool:
        """Whether every unit's parameter shapes are known (the root's too when it holds parameters)."""
        return self.unit_param_shapes is not None and (self.root_param_shapes is not None or not self.root_elements)

    @property
    def boundaries_modelled(self) -> str:
        """The boundaries the figures follow: ``shard_boundaries``, or "flat" when only unit sizes are known."""
        return self.shard_boundaries if self.shapes_known else "flat"

    @property
    def boundaries_note(self) -> str | None:
        """None when the figures follow ``shard_boundaries``; else a sentence saying they are flat's."""
        if self.boundaries_modelled == self.shard_boundaries:
            return None
        return (
            f'shard_boundaries="{self.shard_boundaries}" needs the parameters\' shapes and only unit sizes are '
            "known, so the figures are flat's (equal shards): pass a model shape (--model, --hf-config, or "
            "--layers/--hidden/--vocab/--heads) instead of --params"
        )

    @property
    def budget_bytes(self) -> float:
        return (1.0 - self.headroom) * self.device_memory_bytes

    @property
    def host_budget_bytes(self) -> float | None:
        """Host bytes per node an offload plan may use, or None when host memory is unknown."""
        return None if self.host_memory_bytes is None else (1.0 - self.headroom) * self.host_memory_bytes

    @property
    def ranks_per_node(self) -> int:
        """Ranks sharing one node's host memory: G, or W when the world is less than a node."""
        return min(self.gpus_per_node, self.world_size)

    def across_replicas(self, strategy: Strategy, f: int) -> bool:
        """Whether ``strategy`` at F is planned with its optimizer state across replicas: the field is on,
        the strategy is a hybrid and 1 < F < W (elsewhere there is nothing to split)."""
        hybrid = strategy in (Strategy.HYBRID_SHARD, Strategy._HYBRID_SHARD_ZERO2)
        return self.optimizer_across_replicas and hybrid and 1 < f < self.world_size

    def factors(self) -> tuple[int, ...]:
        """The sharding factors to plan: every divisor of W, or the ones asked for."""
        divisors = tuple(f for f in range(1, self.world_size + 1) if self.world_size % f == 0)
        return self.sharding_factors or divisors

    # -- constructors ---------------------------------------------------------------------------
    @classmethod
    def from_params(cls, params: int, units: int, world_size: int, *, root_elements: int = 0, **kw: Any) -> PlanInputs:
        """P elements: ``root_elements`` in the root, the rest in ``units`` equal units (the first
        ``rest % units`` units one element larger). The documents' 16P/N + 4P/M setting is
        ``root_elements=0``."""
        if params < 0 or root_elements < 0:
            raise PlanError(f"parameter counts must be >= 0 (params={params}, root={root_elements})", "pass sizes >= 0")
        if units < 1:
            raise PlanError(
                f"--units must be >= 1, got {units}", "pass the number of FSDP units, e.g. 32 for one per layer"
            )
        rest = params - root_elements
        if rest < units:
            raise PlanError(
                f"{rest} elements cannot fill {units} units (params {params}, root {root_elements})",
                "pass fewer --units or a smaller --root-params",
            )
        base, extra = divmod(rest, units)
        sizes = tuple(base + (1 if i < extra else 0) for i in range(units))
        return cls(world_size=world_size, unit_elements=sizes, root_elements=root_elements, **kw)

    @classmethod
    def from_shape(cls, shape: ModelShape, world_size: int, *, units: int | None = None, **kw: Any) -> PlanInputs:
        """A transformer wrapped per layer: L layer units (or ``units`` groups of consecutive
        layers) and a root holding embeddings, head and final norm."""
        groups = shape.layers if units is None else units
        if not 1 <= groups <= shape.layers:
            raise PlanError(
                f"--units {groups} does not group {shape.layers} layers",
                f"pass 1 <= --units <= {shape.layers}, or leave it out for one unit per layer",
            )
        base, extra = divmod(shape.layers, groups)
        layers = [base + (1 if i < extra else 0) for i in range(groups)]
        sizes = tuple(n * shape.layer_params() for n in layers)
        kw.setdefault("shape", shape)
        kw.setdefault("unit_param_shapes", tuple(shape.layer_shapes() * n for n in layers))
        kw.setdefault("root_param_shapes", shape.root_shapes())
        return cls(world_size=world_size, unit_elements=sizes, root_elements=shape.root_params(), **kw)

    @classmethod
    def from_module(cls, module: Any, units: Iterable[Any], world_size: int, **kw: Any) -> PlanInputs:
        """Unit sizes counted from an ``nn.Module``: ``units`` are the submodules (or classes)
        that become units; the rest is the root. ``param_tensors`` is filled in."""
        layout = layout_from_module(module, units)
        kw.setdefault("param_tensors", layout.param_tensors)
        kw.setdefault("unit_param_shapes", layout.unit_shapes)
        kw.setdefault("root_param_shapes", layout.root_shapes)
        return cls(world_size=world_size, unit_elements=layout.unit_elements, root_elements=layout.root_elements, **kw)

    def replace(self, **changes: Any) -> PlanInputs:
        return replace(self, **changes)


def _positive_int(value: Any, flag: str, fix: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise PlanError(f"{flag} must be a whole number >= 1, got {value!r}", fix)


def _validate(p: PlanInputs) -> None:
    _positive_int(p.world_size, "--world", "pass the number of ranks, e.g. --world 8")
    _positive_int(p.gpus_per_node, "--gpus-per-node", "pass the ranks per node, e.g. --gpus-per-node 8")
    w, g = p.world_size, p.gpus_per_node
    if w > g and w % g:
        raise PlanError(
            f"world size {w} is not a whole number of nodes of {g} GPUs",
            "pass a --world that is a multiple of --gpus-per-node",
        )
    if any(t < 0 for t in p.unit_elements) or p.root_elements < 0:
        raise PlanError("unit sizes must be >= 0 elements", "pass non-negative sizes")
    if p.params <= 0:
        raise PlanError("the model has no parameters", "pass --params N (e.g. 7B) or --model PRESET")
    if not isinstance(p.precision, PrecisionRecipe) and p.precision not in PRECISIONS:
        raise PlanError(f"unknown precision {p.precision!r}", f"use one of {', '.join(PRECISIONS)}")
    if p.optimizer not in OPTIMIZERS:
        raise PlanError(f"unknown optimizer {p.optimizer!r}", f"use one of {', '.join(OPTIMIZERS)}")
    if not (0.0 <= p.headroom < 1.0):
        raise PlanError(f"headroom must be a fraction in [0, 1), got {p.headroom}", "pass e.g. --headroom 0.1")
    if p.device_memory_bytes <= 0:
        raise PlanError(f"device memory must be positive, got {p.device_memory_bytes}", "pass e.g. --gpu-mem 80GB")
    for name in ("param_tensors", "prefetch_depth", "micro_batch", "seq_len"):
        if getattr(p, name) < 0:
            raise PlanError(
                f"{name} must be >= 0, got {getattr(p, name)}", f"pass a non-negative --{name.replace('_', '-')}"
            )
    if p.exchange not in EXCHANGES:
        raise PlanError(
            f"unknown exchange {p.exchange!r}",
            'use "ring" (NCCL on GPUs) or "direct" (flatshard on gloo: point-to-point exchanges)',
        )
    for name in ("inter_node_in_flight", "optimizer_across_replicas"):
        if not isinstance(getattr(p, name), bool):
            raise PlanError(f"{name} must be True or False, got {getattr(p, name)!r}", "pass a bool")
    if p.optimizer_across_replicas and p.shard_boundaries != "flat":
        raise PlanError(
            f"optimizer_across_replicas is not built with shard_boundaries={p.shard_boundaries!r} (the engine "
            "refuses the pair)",
            "pass --shard-boundaries flat, or leave out --optimizer-across-replicas",
        )
    for name in ("activation_bytes", "compute_time_s", "device_flops", "optimizer_time_s"):
        value = getattr(p, name)
        if value is not None and (not math.isfinite(value) or value < 0 or (name == "device_flops" and value == 0)):
            raise PlanError(
                f"{name} must be a positive number, got {value}",
                f"pass a valid --{name.removesuffix('_s').replace('_', '-')}",
            )
    if p.host_memory_bytes is not None and p.host_memory_bytes <= 0:
        raise PlanError(
            f"host memory must be positive, got {p.host_memory_bytes}", "pass e.g. --host-mem 1TB (per node)"
        )
    for name, flag in (("pcie_bandwidth", "--pcie-bw"), ("host_bandwidth", "--host-bw")):
        value = getattr(p, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise PlanError(f"{name} must be positive, got {value}", f"pass e.g. {flag} 25GB/s")
    _validate_boundaries(p)
    for f in p.sharding_factors or ():
        if f < 1 or w % f:
            raise PlanError(
                f"sharding factor F={f} does not divide world size W={w}",
                f"pass an F that divides {w}: {', '.join(str(d) for d in range(1, w + 1) if w % d == 0)}",
            )


def _validate_boundaries(p: PlanInputs) -> None:
    if p.shard_boundaries not in PLANNED:
        raise PlanError(
            f"unknown shard_boundaries {p.shard_boundaries!r}", f"use one of {', '.join(PLANNED)} (default flat)"
        )
    if p.unit_param_shapes is not None:
        if len(p.unit_param_shapes) != len(p.unit_elements):
            raise PlanError(
                f"unit_param_shapes has {len(p.unit_param_shapes)} units, unit_elements {len(p.unit_elements)}",
                "give one tuple of parameter shapes per unit",
            )
        for k, (shapes, t) in enumerate(zip(p.unit_param_shapes, p.unit_elements)):
            if sum(numel_of(s) for s in shapes) != t:
                raise PlanError(
                    f"unit {k}: its parameter shapes hold {sum(numel_of(s) for s in shapes)} elements, not {t}",
                    "give each unit's parameter shapes (they must add up to its elements)",
                )
    if p.root_param_shapes is not None and sum(numel_of(s) for s in p.root_param_shapes) != p.root_elements:
        raise PlanError(
            f"the root's parameter shapes hold {sum(numel_of(s) for s in p.root_param_shapes)} elements, "
            f"not {p.root_elements}",
            "give the root's parameter shapes (they must add up to root_elements)",
        )
