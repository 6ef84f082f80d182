"""The model fingerprint: at wrap time every rank checks that the others built the same model.

[Note: model fingerprint]
Ranks that built different models (an extra layer, another shape or dtype, a different wrap policy)
would pair collectives of different sizes (gloo aborts the process) or, worse, of equal sizes (4×5 and
5×4 train silently mixed). So before any unit is built, each rank lists what it is about to build, in
order: the options of the wrap call, then every unit and, per unit, every parameter's name, shape,
dtype and requires_grad. The ranks exchange a SHA-256 of that list (one all-gather of 32 bytes); only
when the digests differ do they exchange the lists themselves, to name the first entry that differs,
and every rank raises the same error.
"""

from __future__ import annotations

import hashlib
import json
from typing import Optional

import torch

from flatshard.runtime.comm import agree


def entries(options_line: str, units: list[tuple[str, list]]) -> list[str]:
    """What a rank is about to build: ``units`` is [(unit name, [(ParamInfo, parameter)])]."""
    out = [options_line]
    for name, params in units:
        out.append(f"unit {name!r} with {len(params)} parameters")
        prefix = "" if name == "<root>" else name + "."
        for info, param in params:
            out.append(
                f"unit {name!r} parameter {prefix}{info.name}: shape {tuple(_full_shape(info, param))}, "
                f"{param.dtype}, "
                f"requires_grad={info.requires_grad}"
            )
    return out


def _full_shape(info, param) -> tuple:
    """A tensor-parallel parameter's full shape (its TP piece's may differ per rank: fsdp2/tensor_parallel.py)."""
    return getattr(param, "flatshard_full_shape", info.shape)


def check_same_model(lines: list[str], group) -> None:
    """Raise the same ValueError on every rank of ``group`` unless every rank has the same ``lines``."""
    if agree.world_of(group) == 1:
        return
    digest = hashlib.sha256(json.dumps(lines).encode()).digest()
    local = torch.frombuffer(bytearray(digest), dtype=torch.uint8).to(agree.collective_device(group))
    everyone = agree.all_gather_padded(local, group).view(-1, len(digest)).cpu()
    if bool((everyone == everyone[0]).all()):
        return
    raise ValueError(_difference(agree.gather_json(lines, group)))


def _difference(all_lines: list[list[str]]) -> str:
    """The first entry where some rank's list differs from rank 0's, naming the ranks."""
    first: Optional[tuple[int, int]] = None  # (position, rank)
    for rank, lines in enumerate(all_lines[1:], start=1):
        n = next((i for i, (a, b) in enumerate(zip(all_lines[0], lines)) if a != b), min(len(lines), len(all_lines[0])))
        if first is None or n < first[0]:
            first = (n, rank)
    assert first is not None  # two lists at least: the ranks' lists differ
    position, rank = first

    def at(r: int) -> str:
        lines = all_lines[r]
        return lines[position] if position < len(lines) else "nothing more (its list ends here)"

    differ = [r for r in range(len(all_lines)) if at(r) != at(0)]
    return (
        f"ranks built different models: rank 0 has {at(0)!r} where rank {rank} has {at(rank)!r} "
        f"(entry {position} of what each rank wraps; ranks that differ from rank 0 there: {differ}). "
        "Build the same model on every rank (same code, config, dtype and seed) and wrap it with the same "
        "keywords and wrap policy."
    )


def options_line(
    strategy,
    factor,
    mixed_precision,
    offload: bool,
    world: int,
    boundaries: str = "flat",
    ranks_per_node: object = None,
    compress_inter_node: Optional[str] = None,
    optimizer_across_replicas: bool = False,
) -> str:
    """The wrap call's options that decide what every collective sends; ``ranks_per_node`` as resolved."""
    return (
        f"wrap: {strategy.name}, sharding_factor={factor!r}, mixed_precision={mixed_precision!r}, "
        f"offload_params={offload}, shard_boundaries={boundaries!r}, world_size={world}, "
        f"ranks_per_node={ranks_per_node!r}, compress_inter_node={compress_inter_node!r}, "
        f"shard_optimizer_across_replicas={optimizer_across_replicas}"
    )
