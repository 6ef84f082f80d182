"""``flatshard consolidate`` and ``flatshard inspect``: checkpoints without processes or a model.

consolidate  streams the model's tensors, one at a time, from a checkpoint directory into a single
             safetensors file, or into Hugging Face's sharded layout in a directory (export.py has the
             formats), keys the unwrapped model's ``state_dict()`` keys (loadable with
             ``safetensors.torch.load_file`` + ``load_state_dict(strict=True)``, and by Hugging Face
             ``from_pretrained`` for a HF model), optionally cast to bf16 or fp16. Peak memory: the
             largest tensor, plus one checksum block; never the model.
inspect      prints what a checkpoint holds and verifies every file's SHA-256 and every block CRC (a
             fully_shard checkpoint's DCP files, which carry none: their sizes, each read whole).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors import safe_open

from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import committed, read_manifest
from flatshard.checkpoint.export import DEFAULT_SHARD_SIZE, consolidate
from flatshard.checkpoint.format import ShardReader, sha256_of

__all__ = ["consolidate", "inspect", "main"]


def inspect(ckpt: str, *, verify: bool = True, out=None) -> list[str]:
    """Print a summary of checkpoint ``ckpt`` to ``out`` (default: the current ``sys.stdout``); returns the
    problems found (empty if it verified)."""
    out = out if out is not None else sys.stdout
    ckpt = os.path.abspath(ckpt)
    manifest = read_manifest(ckpt)
    where = committed(ckpt) or ckpt
    layout = manifest["layout"]
    print(f"flatshard checkpoint {ckpt}", file=out)
    if where != ckpt:
        print(f"  read from {where}: a save replacing it stopped mid-commit (the next save restores it)", file=out)
    print(
        f"  format {manifest['format_version']}, flatshard {manifest['flatshard_version']}, "
        f"torch {manifest['torch_version']}",
        file=out,
    )
    print(f"  step {manifest.get('step')}, extra {manifest.get('extra')}", file=out)
    if layout.get("kind") == "dcp-safetensors":
        return _inspect_dcp(where, manifest, verify, out)
    print(
        f"  saved at W={manifest['world_size']}, {layout['strategy']}, F={layout['shard_size']}, "
        f"R={layout['replicate_size']}, {len(layout['units'])} units",
        file=out,
    )
    model_keys = manifest["model"]["keys"]
    numel = sum(int(torch.Size(t["shape"]).numel()) for k, t in manifest["tensors"].items() if k.startswith("model/"))
    print(f"  model: {len(model_keys)} state-dict keys, {numel:,} elements", file=out)
    optim = manifest.get("optim")
    if optim:
        print(
            f"  optimizer: {len(optim['param_groups'])} param groups, state for {len(optim['state'])} parameters",
            file=out,
        )
    total = sum(r["bytes"] for r in manifest["files"].values())
    print(f"  files: {len(manifest['files'])}, {total:,} bytes", file=out)
    for name, t in ((k, manifest["tensors"][v]) for k, v in manifest["model"]["tensor_of"].items()):
        print(f"    {name:<48} {str(tuple(t['shape'])):<16} {t['dtype']:<9} in {len(t['pieces'])} piece(s)", file=out)
    problems = _verify(where, manifest) if verify else []
    for p in problems:
        print(f"  PROBLEM {p}", file=out)
    if verify and not problems:
        print(f"  checksums: all {len(manifest['files'])} files verified (SHA-256 and every block CRC)", file=out)
    return problems


def _inspect_dcp(ckpt: str, manifest: dict, verify: bool, out) -> list[str]:
    """The rest of ``inspect`` for a fully_shard checkpoint ([Note: fully_shard checkpoints are DCP
    safetensors], dtensors.py): its files carry no checksums, so verifying reads each one whole as
    safetensors (reading the manifest checked that each is there at its recorded size)."""
    print(f"  saved at W={manifest['world_size']} by fully_shard, DCP's safetensors files", file=out)
    print(f"  model: {len(manifest['model']['keys'])} state-dict keys", file=out)
    optim = manifest.get("optim")
    if optim:
        print(f"  optimizer: {len(optim['param_groups'])} param groups", file=out)
    files = manifest["files"]
    print(f"  files: {len(files)}, {sum(r['bytes'] for r in files.values()):,} bytes", file=out)
    problems = []
    for name in files if verify else ():  # read_manifest has checked that each is there at its size
        try:
            with safe_open(os.path.join(ckpt, name), framework="pt") as f:
                for key in f.keys():
                    f.get_tensor(key)
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors
            problems.append(f"{name}: not a valid safetensors file ({exc})")
    for p in problems:
        print(f"  PROBLEM {p}", file=out)
    if verify and not problems:
        print(
            f"  files: all {len(files)} present at their sizes and read whole as safetensors (no checksums)", file=out
        )
    return problems


def _verify(ckpt: str, manifest: dict) -> list[str]:
    problems = []
    for name, rec in manifest["files"].items():
        path = os.path.join(ckpt, name)
        if sha256_of(path) != rec["sha256"]:
            problems.append(f"{name}: checksum mismatch (SHA-256 of the file differs from the manifest's)")
            continue
        try:
            with ShardReader(path, rec) as reader:
                for key in rec["blocks"]:
                    reader.read(key)
            with safe_open(path, framework="pt") as f:  # the reference reader agrees that it is safetensors
                if set(f.keys()) != set(rec["blocks"]):
                    problems.append(f"{name}: its tensors differ from the manifest's")
        except CheckpointError as exc:
            problems.append(f"{name}: {exc}")
        except Exception as exc:  # noqa: BLE001 - safetensors' own errors
            problems.append(f"{name}: not a valid safetensors file ({exc})")
    return problems


def main(command: str, argv: list[str]) -> int:
    if command == "consolidate":
        return _consolidate_main(argv)
    p = argparse.ArgumentParser(
        prog="flatshard inspect", description="what a flatshard checkpoint holds; verify its checksums"
    )
    p.add_argument("checkpoint")
    p.add_argument("--no-verify", action="store_true", help="skip reading every byte to check the checksums")
    args = p.parse_args(argv)
    try:
        problems = inspect(args.checkpoint, verify=not args.no_verify)
    except CheckpointError as exc:
        print(f"flatshard inspect: {exc}", file=sys.stderr)
        return 1
    return 1 if problems else 0


def _consolidate_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="flatshard consolidate",
        description="stream a flatshard checkpoint into one safetensors file, or into Hugging Face's "
        "layout in a directory (model.safetensors, or model-0000k-of-0000n.safetensors shards and "
        "model.safetensors.index.json), keys the plain model's state_dict() keys",
    )
    p.add_argument("checkpoint")
    p.add_argument("output", help="a .safetensors file to write, or an existing directory for Hugging Face's layout")
    p.add_argument(
        "--max-shard-size",
        metavar="SIZE",
        help=f"the largest shard in a directory output (default {DEFAULT_SHARD_SIZE}); KB, MB, GB are powers of "
        "1000 as in Hugging Face, KiB, MiB, GiB powers of 1024",
    )
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], help="cast floating-point tensors (default: as saved)")
    p.add_argument("-v", "--verbose", action="store_true", help="list each tensor as it is written")
    args = p.parse_args(argv)
    try:
        info = consolidate(
            args.checkpoint, args.output, max_shard_size=args.max_shard_size, dtype=args.dtype, verbose=args.verbose
        )
    except (CheckpointError, ValueError, OSError) as exc:
        print(f"flatshard consolidate: {exc}", file=sys.stderr)
        return 1
    files = info["files"]
    what = files[0] if len(files) == 1 else f"{len(files) - 1} shards and the index in {args.output}"
    print(
        f"wrote {what}: {info['tensors']} tensors, {info['bytes']:,} bytes "
        f"(largest tensor {info['largest_tensor_bytes']:,} bytes)"
    )
    for path in info["removed"]:
        print(f"removed {path} (an earlier export's, not part of this one)")
    return 0
