"""What shard_boundaries cost in balance: per-rank bytes and imbalance of "flat", "rows" and "params".

    python -m bench.figures.boundaries              # the example GPT (examples/gpt.py "small") and llama-7b
    python -m bench.figures.boundaries --json bench/results/boundaries.json

Pure arithmetic on the layouts flatshard builds (``flatshard.runtime.layout.FlatLayout``, the class the
engine uses), one unit per transformer block plus the root, fp32 parameters: for each world size F and
each mode, the bytes of parameters each rank holds (its flat shards summed over units), the imbalance
max/min of those totals over ranks (1.00 is perfect), and the worst unit's imbalance (max/min of its
shards: what a unit's all-gather waits on, as every rank receives every shard). With AdamW, gradients and
optimizer state follow the parameters (16 bytes per element in all).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from bench import provenance
from flatshard.planner import preset
from flatshard.runtime.layout import FlatLayout, ParamInfo

MODES = ("flat", "rows", "params")


def _infos(named_shapes: list[tuple[str, tuple[int, ...]]]) -> list[ParamInfo]:
    out, offset = [], 0
    for name, shape in named_shapes:
        numel = math.prod(shape)
        out.append(ParamInfo(name, torch.Size(shape), numel, offset, True, ()))
        offset += numel
    return out


def example_gpt_units() -> list[list[ParamInfo]]:
    """examples/gpt.py's GPT ("small"), built on the meta device: one unit per Block, and the root."""
    from examples.gpt import GPT, PRESETS, Block

    with torch.device("meta"):
        model = GPT(PRESETS["small"])
    blocks = [m for m in model.modules() if isinstance(m, Block)]
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    units = [_infos([(n, tuple(p.shape)) for n, p in b.named_parameters()]) for b in blocks]
    root = [(n, tuple(p.shape)) for n, p in model.named_parameters() if id(p) not in in_blocks]
    return units + [_infos(root)]


def llama_units(name: str = "llama-7b") -> list[list[ParamInfo]]:
    """A Llama-shaped model from the planner's catalogue: per layer q, k, v, o, gate, up, down, two norms."""
    s = preset(name)
    d, i, kv = s.hidden, s.mlp_width, s.kv_count * (s.hidden // s.heads)
    layer = [
        ("q", (d, d)),
        ("k", (kv, d)),
        ("v", (kv, d)),
        ("o", (d, d)),
        ("gate", (i, d)),
        ("up", (i, d)),
        ("down", (d, i)),
        ("norm1", (d,)),
        ("norm2", (d,)),
    ]
    root = [("embed", (s.vocab, d)), ("norm", (d,))] + ([] if s.tied else [("head", (s.vocab, d))])
    return [_infos(layer) for _ in range(s.layers)] + [_infos(root)]


def figures(units: list[list[ParamInfo]], world: int, mode: str, bytes_per: int = 4) -> dict:
    per_rank = [0] * world
    worst = 1.0
    loads = [0] * world  # as one wrap call builds them: "params" balances across units
    for infos in units:
        layout = FlatLayout(infos, world, mode, loads)
        sizes = layout.shard_sizes
        for r, n in enumerate(sizes):
            per_rank[r] += n * bytes_per
        worst = max(worst, max(sizes) / (sum(sizes) / world))  # the all-gather waits on the largest shard
    return {
        "max_bytes": max(per_rank),
        "min_bytes": min(per_rank),
        "imbalance": max(per_rank) / min(per_rank) if min(per_rank) else math.inf,
        "worst_unit_max_over_mean": worst,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, help="write the figures to this file")
    args = p.parse_args(argv)
    models = {"example GPT (small)": example_gpt_units(), "llama-7b": llama_units()}
    out = {}
    print(
        f"{'model':<22} {'F':>2} {'mode':<7} {'max MB/rank':>12} {'min MB/rank':>12} {'imbalance':>9} "
        f"{'worst unit max/mean':>19}"
    )
    for name, units in models.items():
        total = sum(i.numel for u in units for i in u)
        for world in (2, 4, 8):
            for mode in MODES:
                f = figures(units, world, mode)
                out[f"{name}/F={world}/{mode}"] = {**f, "params": total}
                print(
                    f"{name:<22} {world:>2} {mode:<7} {f['max_bytes'] / 1e6:>12.3f} {f['min_bytes'] / 1e6:>12.3f} "
                    f"{f['imbalance']:>9.3f} {f['worst_unit_max_over_mean']:>19.2f}"
                )
    if args.json:
        args.json.write_text(json.dumps(provenance.stamp(out), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
