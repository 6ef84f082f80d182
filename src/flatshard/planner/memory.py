"""Per-rank memory of one strategy at one sharding factor F.

[Note: planner memory model]
Unit u has T_u elements; with shard group size F rank k's flat shard has s_{k,u} elements and the
unit's unsharded flat N_u. ``shard_boundaries`` sets them, cut as the engine cuts (boundaries.py):
    "flat":   s_{k,u} = S_u = ceil(T_u / F) for every k (zero padding to N_u = F * S_u);
    "rows":   cuts moved to the row boundary nearest k * T_u / F; "params": every parameter whole on
              one rank, dealt largest first to the least loaded rank over the units in the order the
              engine builds them (the units, then the root); for both N_u = T_u (no padding) and the
              shards differ. These need the parameters' shapes; with unit sizes only, flat's.
Figures are for the largest rank, the one with the most elements n_k = sum_u s_{k,u} (rank 0 for
"flat", whose shards hold S_u real elements each: the last rank's optimizer state is smaller by its
padding); ``steady_per_rank`` has every shard rank's steady bytes (the same in every replica).

steady (between steps, every strategy): max_k n_k * (master + grad shard) + real_k * optimizer bytes
    (real_k: rank k's parameter elements, n_k less padding), plus AdamW's 4-byte ``step`` per original
    parameter when ``param_tensors`` is given, on every rank. For F = 1 the shard is the whole flat.
gathered g_u = N_u * compute bytes while unit u is unsharded (0 for F = 1 when the compute dtype is
    the master dtype: the flat shard is then used in place).
unsharded gradient ug_u = N_u * reduce bytes, from the unit's backward until its reduce-scatter
    (also for F = 1: gradient shards are counted resident through the step, so the new gradient
    cannot be the grad shard; it is reduced, added to the resident shard, and freed).

FULL_SHARD, HYBRID_SHARD (reshard after forward), prefetch depth d:
    forward at unit i:  root + g_i + g_{i+1} + ... + g_{i+d}
    backward at unit i: root + g_i + ug_i + g_{i-1} + ... + g_{i-d}; at the root: root + ug_root
    where "root" is g_root: the root unit stays gathered from its forward to the end of backward.
    g_i + ug_i is the end of unit i's backward: its parameters and its per-parameter gradients. The
    engine frees the parameters before joining the gradients into the flat gradient (unit.py,
    [Note: free before the flat gradient]), so the join adds nothing above this.
SHARD_GRAD_OP, _HYBRID_SHARD_ZERO2, NO_SHARD (no reshard after forward): every unit is gathered by
    the end of forward and freed after its own backward (its post-backward reshard), so
    forward: sum_u g_u; backward at unit i (forward order): g_0 + ... + g_i + ug_i.
activations: counted in full at both peaks (their maximum is at the forward/backward turn), so
    the peak is an upper bound. Without a model shape, a micro-batch and a sequence length (or an
    ``activation_bytes`` override) they are not counted at all: the table, the JSON and the
    recommendation then say so (``activations_note``), since such a peak is a lower bound.
forward_peak = steady + activations + max forward transient; backward_peak likewise; peak = max.
gather_buffer = the most gathered-parameter bytes at any moment (unsharded gradients excluded).

The documents' 16P/N + 4P/M is ``forward_peak`` with no root, d = 0 and no activations. Their
figure leaves out the unit's unsharded gradient, which exists in backward alongside its gathered
parameters, so the real peak of that case is 16P/N + 8P/M (fp32).

Optimizer state across replicas (``optimizer_across_replicas``: the engine's
``shard_optimizer_across_replicas=True``, [Note: optimizer state across replicas] in runtime/across_replicas.py;
the hybrids at 1 < F < W, "flat" only; R = W / F): a unit is cut as the "flat" layout over W ranks, pieces
P_u = ceil(T_u / W), and a flat shard is R of them: S_u = R * P_u (more than ceil(T_u / F) when W does not
divide T_u well), N_u = W * P_u. Owner rank v = shard rank * R + replicate rank holds
    params S_u * master (the whole flat shard, as the hybrid); grad shard P_u * grad shard bytes;
    optimizer state real_v * optimizer bytes (real_v: its piece's parameter elements) + the step tensors;
``steady_per_rank`` has the W owner ranks' figures (owner 0 is the largest). Transients as the hybrid's
with this N_u, and a unit's reduction holds its S_u-element shard (reduce dtype) while the reduce-scatter
across the replicas brings it to the P_u-element piece. Finished before the next unit, that is within
the unit's own g_u + ug_u; left in flight to the end of backward (the replicate groups span nodes, with
``inter_node_in_flight``), each reduced unit holds h_u = (S_u + P_u) * reduce bytes until then, added to
every later backward position (``held_reductions``: sum_u h_u).

Not counted: the reduce-scatter output buffer (S_u elements, 1/F of ug_u), allocator rounding
and fragmentation, CUDA context and workspaces (that is what ``headroom`` is for); and the plain
hybrid's all-reduced shards while in flight to the end of backward (S_u * reduce bytes per unit reduced,
as h_u above: the small GPT of tests/test_planner_engine.py at W = 4, F = 2 as two nodes of two measured
11% above its planned peak).

CPU offload (``CPUOffload(offload_params=True)``) is planned beside every plan by offload.py, whose
[Note: planner CPU offload model] has the formulas. In short: params, grad shards and optimizer state
(``steady``) move to a *host* figure per rank (and per node: times the node's ranks); the device
keeps the transients above with no in-place F = 1 (g_u = F * S_u * compute always), plus the staging
copies of the shards being gathered (S_u * compute each) and the reduced shard before its copy back
(S_u * reduce, and its master-dtype cast when the dtypes differ), and the activations.
"""

from __future__ import annotations

from dataclasses import dataclass

from flatshard.planner.boundaries import chunk_real, cut
from flatshard.planner.inputs import OPTIMIZERS, PlanInputs, Strategy


@dataclass(frozen=True)
class MemoryEstimate:
    """Per-rank bytes, of the largest rank. params/grads/optimizer are the persistent (steady) parts;
    ``steady_per_rank`` is every shard rank's steady bytes (their max is ``steady``)."""

    params: int
    grads: int
    optimizer: int
    gather_buffer: int
    unsharded_grad: int
    activations: int
    steady: int
    forward_peak: int
    backward_peak: int
    peak: int
    steady_per_rank: tuple[int, ...] = ()
    held_reductions: int = 0  # in-flight replicate reduce-scatters held at the end of backward (pieces)

    @property
    def imbalance(self) -> float:
        """max / min of the ranks' steady bytes (1.0: balanced)."""
        low = min(self.steady_per_rank, default=0)
        return self.steady / low if low else 1.0


@dataclass(frozen=True)
class Unit:
    """One unit as the planner sees it: elements, whether it is the root, its largest shard (what its
    collectives wait on), every shard rank's shard, the length of its unsharded flat, and with the
    optimizer state across replicas the piece P_u each rank owns (0 without)."""

    elements: int
    is_root: bool
    shard: int
    shards: tuple[int, ...] = ()
    padded: int = 0
    piece: int = 0
    real: tuple[int, ...] = ()  # every rank's parameter elements where padding is not at the end ("chunks")


def units_of(inputs: PlanInputs, f: int, pieces: bool = False) -> list[Unit]:
    """Units in forward order: the root first (when it holds parameters), then the others; each cut as
    the engine cuts it under ``inputs.boundaries_modelled`` (the units in build order: the others, then
    the root, so "params" deals the root against the others' loads). With ``pieces`` (the optimizer
    state across replicas, "flat" only) a flat shard is R pieces of P_u = ceil(T_u / W)."""
    mode = inputs.boundaries_modelled
    sizes = [(t, False, k) for k, t in enumerate(inputs.unit_elements)] + [(inputs.root_elements, True, -1)]
    loads = [0] * f
    built: dict[int, Unit] = {}
    for t, is_root, k in sizes:
        if t <= 0:
            continue
        if pieces:
            w = inputs.world_size
            piece = -(-t // w)
            built[k] = Unit(t, is_root, piece * (w // f), (piece * (w // f),) * f, w * piece, piece)
            continue
        if mode == "flat":
            s = -(-t // f)
            built[k] = Unit(t, is_root, s, (s,) * f, f * s)
            continue
        # a mode other than "flat" is modelled only with the shapes known (PlanInputs.boundaries_modelled),
        # the root's too since it holds parameters here (t > 0)
        unit_shapes = inputs.unit_param_shapes
        assert unit_shapes is not None
        shapes = inputs.root_param_shapes if is_root else unit_shapes[k]
        assert shapes is not None
        c = cut(shapes, f, mode, loads)
        for r, n in enumerate(c.sizes):
            loads[r] += n
        real = chunk_real(shapes, f) if mode == "chunks" else ()
        built[k] = Unit(t, is_root, max(c.sizes), c.sizes, c.bounds[-1], real=real)
    return [built[k] for k in (-1, *range(len(inputs.unit_elements))) if k in built]


def _real(u: Unit, rank: int) -> int:
    """Rank ``rank``'s parameter elements of unit ``u`` (its shard less padding: "flat" pads at the end,
    "chunks" every parameter's chunk)."""
    if u.real:
        return u.real[rank]
    start = sum(u.shards[:rank])
    return max(0, min(u.elements, start + u.shards[rank]) - start)


def replicas_cross_nodes(inputs: PlanInputs, f: int) -> bool:
    """Whether a replicate group at F ({j, j+F, j+2F, ...}) has ranks on more than one node."""
    g, w = inputs.ranks_per_node, inputs.world_size
    return any(j // g != (j + k * f) // g for j in range(f) for k in range(1, w // f))


def _owned(inputs: PlanInputs, units: list[Unit], f: int, pieces: bool) -> list[tuple[int, int, int]]:
    """Every rank's (flat shard, grad shard, real parameter) elements: per shard rank, or with ``pieces``
    per owner rank v = shard rank * R + replicate rank, whose grad shard and optimizer state cover its
    piece [v P_u, (v + 1) P_u) of each unit (the "flat" layout over W ranks)."""
    if not pieces:
        return [(sum(u.shards[k] for u in units),) * 2 + (sum(_real(u, k) for u in units),) for k in range(f)]
    held, grad = sum(u.shard for u in units), sum(u.piece for u in units)
    return [
        (held, grad, sum(max(0, min(u.elements, (v + 1) * u.piece) - v * u.piece) for u in units))
        for v in range(inputs.world_size)
    ]


def memory_estimate(inputs: PlanInputs, strategy: Strategy, f: int, pieces: bool = False) -> MemoryEstimate:
    """``pieces``: with the optimizer state across replicas (``inputs.across_replicas(strategy, f)``)."""
    rec = inputs.recipe
    opt_bytes, step_bytes = OPTIMIZERS[inputs.optimizer]
    units = units_of(inputs, f, pieces)
    ranks = _owned(inputs, units, f, pieces)
    per_rank = tuple(
        n * rec.master_bytes + g * rec.grad_shard_bytes + r * opt_bytes + inputs.param_tensors * step_bytes
        for n, g, r in ranks
    )
    top = max(range(len(ranks)), key=lambda k: (per_rank[k], -k))  # the largest rank (the first of equals)
    # "flat": rank 0's optimizer state is S_u per unit, as its shards hold only real elements
    params, grads = ranks[top][0] * rec.master_bytes, ranks[top][1] * rec.grad_shard_bytes
    optimizer = ranks[top][2] * opt_bytes + inputs.param_tensors * step_bytes
    steady = params + grads + optimizer

    in_place = f == 1 and rec.compute_bytes == rec.master_bytes
    gathered = [0 if in_place else u.padded * rec.compute_bytes for u in units]
    ugrad = [u.padded * rec.reduce_bytes for u in units]
    held = None  # the replicate reduce-scatters in flight to the end of backward: (S_u + P_u) * reduce each
    if pieces and inputs.inter_node_in_flight and replicas_cross_nodes(inputs, f):
        held = [(u.shard + u.piece) * rec.reduce_bytes for u in units]
    fwd, bwd, buffer = transients(units, gathered, ugrad, strategy, inputs.prefetch_depth, held)
    acts = activation_bytes(inputs)
    forward_peak, backward_peak = steady + acts + fwd, steady + acts + bwd
    return MemoryEstimate(
        params,
        grads,
        optimizer,
        buffer,
        max(ugrad, default=0),
        acts,
        steady,
        forward_peak,
        backward_peak,
        max(forward_peak, backward_peak),
        per_rank,
        sum(held or ()),
    )


def transients(
    units: list[Unit],
    gathered: list[int],
    ugrad: list[int],
    strategy: Strategy,
    depth: int,
    held: list[int] | None = None,
) -> tuple[int, int, int]:
    """(max forward transient, max backward transient, max gathered bytes) of gathered parameters
    ``gathered`` and unsharded gradients ``ugrad`` (bytes per unit, forward order) under ``strategy``;
    ``held``: bytes each unit holds from its reduction to the end of backward (reductions in flight)."""
    held = held or [0] * len(units)
    if strategy.reshard_after_forward:
        return _resharding_transients(units, gathered, ugrad, depth, held)
    # each unit is freed after its own backward, so unit i's backward holds units 0..i (and, in flight,
    # the reductions of the units after it, reduced before it)
    fwd = sum(gathered)
    bwd = max((sum(gathered[: i + 1]) + ugrad[i] + sum(held[i + 1 :]) for i in range(len(units))), default=0)
    return fwd, bwd, fwd


def _resharding_transients(
    units: list[Unit], gathered: list[int], ugrad: list[int], depth: int, held: list[int]
) -> tuple[int, int, int]:
    """(max forward transient, max backward transient, max gathered bytes) under FULL_SHARD."""
    root = sum(g for u, g in zip(units, gathered) if u.is_root)
    root_grad = sum(g for u, g in zip(units, ugrad) if u.is_root)
    inner = [i for i, u in enumerate(units) if not u.is_root]
    fwd_windows = [sum(gathered[j] for j in inner[k : k + depth + 1]) for k in range(len(inner))]
    bwd_windows = [sum(gathered[j] for j in inner[max(0, k - depth) : k + 1]) for k in range(len(inner))]
    fwd = root + max(fwd_windows, default=0)
    before = [sum(held[j] for j in inner[k + 1 :]) for k in range(len(inner))]  # reduced before inner[k]
    bwd = max(
        [root + w + ugrad[inner[k]] + before[k] for k, w in enumerate(bwd_windows)]
        + [root + root_grad + sum(held[j] for j in inner)]
    )
    buffer = root + max(fwd_windows + bwd_windows, default=0)
    return fwd, bwd, buffer


def activations_missing(inputs: PlanInputs) -> list[str]:
    """What the activation estimate lacks (empty when activations are counted): a model shape, a
    micro-batch, a sequence length, each named by its ``flatshard plan`` flag."""
    if inputs.activation_bytes is not None:
        return []
    missing = []
    if inputs.shape is None:
        missing.append("a model shape (--model, --hf-config, or --layers/--hidden/--vocab/--heads)")
    if not inputs.micro_batch:
        missing.append("--micro-batch")
    if not inputs.seq_len:
        missing.append("--seq-len")
    return missing


def activations_note(inputs: PlanInputs) -> str | None:
    """None when activations are counted; else one sentence saying they are not, and how to count them."""
    missing = activations_missing(inputs)
    if not missing:
        return None
    return (
        "activations are not counted, so every peak leaves them out and may fit where the real run does not: "
        f"pass {', '.join(missing)}, or --activation-bytes"
    )


def activation_bytes(inputs: PlanInputs) -> int:
    """Per-rank activation bytes for one micro-batch, or 0 without shape, micro-batch and length.

    Without checkpointing, a layer saves about s*b*h*(34 + 5*a*s/h) bytes at 2-byte activations
    (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models", 2022,
    no tensor parallelism), scaled by compute bytes / 2; the 5*a*s/h term is the attention score
    matrices, which fused (flash) attention does not keep, so ``flash_attention`` drops it. With
    per-layer checkpointing only each
    layer's input (s*b*h elements) is kept, plus one layer's full set while it is recomputed; that
    is O(L), not the O(sqrt L) of checkpointing every sqrt(L) layers. Both add the fp32 logits
    (s*b*vocab*4) for the loss.
    """
    if inputs.activation_bytes is not None:
        return int(inputs.activation_bytes)
    shape, b, s = inputs.shape, inputs.micro_batch, inputs.seq_len
    if shape is None or b == 0 or s == 0:
        return 0
    cb, h, a = inputs.recipe.compute_bytes, shape.hidden, shape.heads
    scores = 0 if inputs.flash_attention else 5 * a * s
    per_layer = s * b * (34 * h + scores) * cb // 2
    logits = s * b * shape.vocab * 4
    if inputs.activation_checkpointing:
        return shape.layers * s * b * h * cb + per_layer + logits
    return shape.layers * per_layer + logits
