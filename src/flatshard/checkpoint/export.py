"""Exporting a checkpoint for a plain model or Hugging Face: ``flatshard consolidate``'s work.

The output is either one safetensors file (``OUT.safetensors``) or, given an existing directory,
Hugging Face's layout: ``model.safetensors`` when everything fits in one shard of ``max_shard_size``
bytes, else ``model-0000k-of-0000n.safetensors`` and ``model.safetensors.index.json``
(``{"metadata": {"total_size", "total_parameters"}, "weight_map": {key: shard}}``), shards filled in
state-dict order and a new one started before a tensor that would overflow it (a tensor larger than
the limit has a shard of its own), as ``save_pretrained`` does. Keys are the unwrapped model's
``state_dict()`` keys (tied weights under each name); floating-point tensors can be cast (``dtype``).

Streaming: one tensor at a time is read from the pieces of the checkpoint's files (verified against
their block checksums) and written, so the peak memory is about the largest tensor (twice, when
cast), never the model. Each file is written under a temporary name and renamed; in a directory the
index is written after its shards, and Hugging Face weight files of an earlier export that this one
does not list (a stale ``model.safetensors``, which ``from_pretrained`` would prefer, or shards of
another count) are removed last.
"""

from __future__ import annotations

import os
import re
from typing import Any, Optional, Union

import torch

from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import locate, manifest_in
from flatshard.checkpoint.format import ShardReader, ShardWriter, fsync_dir, write_json_atomic
from flatshard.state.model_view import dtype_from

SINGLE, INDEX = "model.safetensors", "model.safetensors.index.json"
_SHARD = re.compile(r"model-\d{5}-of-\d{5}\.safetensors")
DEFAULT_SHARD_SIZE = "5GB"
DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}
_UNITS = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(size: Union[int, str]) -> int:
    """Bytes from ``5GB``, ``500MB``, ``1.5GiB`` or a plain number (KB, MB, GB, TB are powers of 1000 as
    in Hugging Face's ``max_shard_size``; KiB, MiB, GiB, TiB powers of 1024)."""
    if isinstance(size, int) and not isinstance(size, bool) and size > 0:
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([KMGT]i?B|B)?\s*", str(size), re.IGNORECASE)
    value = int(float(m.group(1)) * _UNITS[(m.group(2) or "B").upper()]) if m else 0
    if value < 1:
        raise ValueError(
            f"the shard size {size!r} is not a size: give bytes, or a number with KB, MB, GB, TB (powers of "
            "1000, as Hugging Face) or KiB, MiB, GiB, TiB (powers of 1024), e.g. 5GB"
        )
    return value


def consolidate(
    ckpt: str,
    out: str,
    *,
    max_shard_size: Union[int, str, None] = None,
    dtype: Union[str, torch.dtype, None] = None,
    verbose: bool = False,
) -> dict:
    """Write the model of checkpoint ``ckpt`` to ``out``: a ``.safetensors`` file, or an existing
    directory (Hugging Face's layout, shards of at most ``max_shard_size``, default 5GB). ``dtype``
    (``"bf16"``, ``"fp16"``, ``"fp32"`` or a torch dtype) casts floating-point tensors. Returns what
    was written, for the caller to print."""
    ckpt, out = os.path.abspath(ckpt), os.path.abspath(out)
    where = locate(ckpt)
    manifest = manifest_in(where, ckpt)
    into_dir = _check_destination(out, where, max_shard_size)
    cast = _dtype(dtype)
    tensors, tensor_of = manifest["tensors"], manifest["model"]["tensor_of"]
    specs = []  # (state-dict key, checkpoint key, saved dtype, written dtype, shape)
    for key in (k for k in manifest["model"]["keys"] if k in tensor_of):
        entry = tensors[tensor_of[key]]
        saved = dtype_from(entry["dtype"])
        specs.append((key, tensor_of[key], saved, cast if cast and saved.is_floating_point else saved, entry["shape"]))
    meta = {"format": "pt", "flatshard_checkpoint": os.path.basename(ckpt), "step": str(manifest.get("step"))}
    if not into_dir:
        groups, names = [specs], [out]
    else:
        groups = _shards(specs, parse_size(max_shard_size if max_shard_size is not None else DEFAULT_SHARD_SIZE))
        n = len(groups)
        names = [SINGLE] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
        names = [os.path.join(out, name) for name in names]
    readers: dict[str, ShardReader] = {}
    info: dict[str, Any] = {"files": [], "tensors": len(specs), "bytes": 0, "largest_tensor_bytes": 0, "removed": []}
    try:
        for group, name in zip(groups, names):
            _write(where, manifest, group, name, meta, readers, info, verbose)
    finally:
        for r in readers.values():
            r.close()
    if into_dir:
        if len(names) > 1:
            weight_map = {key: os.path.basename(name) for group, name in zip(groups, names) for key, *_ in group}
            total = sum(_nbytes(s) for s in specs)
            numel = sum(int(torch.Size(s[4]).numel()) for s in specs)
            index = {"metadata": {"total_size": total, "total_parameters": numel}, "weight_map": weight_map}
            write_json_atomic(os.path.join(out, INDEX), index)
            info["files"].append(os.path.join(out, INDEX))
        info["removed"] = _remove_stale(out, {os.path.basename(f) for f in info["files"]})
        fsync_dir(out)
    return info


def _check_destination(out: str, where: str, max_shard_size) -> bool:
    """True for a directory output, False for one file; a ``CheckpointError`` saying how to fix it else."""
    inside = os.path.realpath(out if os.path.isdir(out) else os.path.dirname(out))
    if inside == os.path.realpath(where):
        raise CheckpointError(f"{out} is inside the checkpoint {where}: write the export somewhere else")
    if os.path.isdir(out):
        return True
    if out.endswith(".safetensors"):
        if max_shard_size is not None:
            raise CheckpointError(
                f"max_shard_size (--max-shard-size) splits the model into shards in a directory, but {out} "
                "names one file: give an existing directory as the output"
            )
        parent = os.path.dirname(out)
        if not os.path.isdir(parent):
            raise CheckpointError(f"the directory {parent} for {out} does not exist: create it first (mkdir -p)")
        return False
    ext = os.path.splitext(out)[1]
    if ext or os.path.exists(out):
        pickle = (
            " (.bin, .pt and .pth are pickle files, which flatshard never writes)"
            if ext in (".bin", ".pt", ".pth")
            else ""
        )
        raise CheckpointError(
            f"{out} is not a .safetensors file name{pickle}: name the output file *.safetensors, or give an "
            "existing directory for Hugging Face's sharded layout"
        )
    raise CheckpointError(
        f"the output directory {out} does not exist: create it (mkdir -p) for Hugging Face's layout "
        f"({SINGLE}, or model-0000k-of-0000n.safetensors and {INDEX}), or name a .safetensors file"
    )


def _dtype(dtype) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if str(dtype).lower() not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of bf16, fp16, fp32")
    return DTYPES[str(dtype).lower()]


def _nbytes(spec) -> int:
    return int(torch.Size(spec[4]).numel()) * torch.empty((), dtype=spec[3]).element_size()


def _shards(specs: list, limit: int) -> list[list]:
    """Consecutive groups of ``specs`` of at most ``limit`` bytes each (a larger tensor alone)."""
    groups: list[list] = [[]]
    size = 0
    for spec in specs:
        n = _nbytes(spec)
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(spec)
        size += n
    return groups


def _write(where: str, manifest: dict, group: list, path: str, meta: dict, readers, info: dict, verbose) -> None:
    tmp = path + ".partial"
    writer = ShardWriter(tmp, [(key, written, shape) for key, _, _, written, shape in group], meta)
    for key, ckey, saved, written, shape in group:
        full = torch.empty(int(torch.Size(shape).numel()), dtype=saved)  # one tensor at a time
        for name, a, b in manifest["tensors"][ckey]["pieces"]:
            if name not in readers:
                readers[name] = ShardReader(os.path.join(where, name), manifest["files"][name])
            readers[name].read_into(ckey, 0, full[a:b])
        info["largest_tensor_bytes"] = max(info["largest_tensor_bytes"], full.numel() * full.element_size())
        writer.write(key, full.to(written))
        if verbose:
            print(f"  {key:<50} {str(tuple(shape)):<20} {str(written).removeprefix('torch.')}")
        del full
    record = writer.close()
    os.replace(tmp, path)
    fsync_dir(os.path.dirname(path))
    info["files"].append(path)
    info["bytes"] += record["bytes"]


def _remove_stale(out: str, written: set[str]) -> list[str]:
    """Hugging Face weight files in ``out`` from an earlier export that this one does not list."""
    stale = [n for n in sorted(os.listdir(out)) if (n in (SINGLE, INDEX) or _SHARD.fullmatch(n)) and n not in written]
    for n in stale:
        os.remove(os.path.join(out, n))
    return [os.path.join(out, n) for n in stale]
