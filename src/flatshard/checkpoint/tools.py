"""``flatshard consolidate`` and ``flatshard inspect``: checkpoints without processes or a model.

consolidate  streams the model's tensors, one at a time, from a checkpoint directory into a single
             safetensors file whose keys are the unwrapped model's ``state_dict()`` keys (loadable with
             ``safetensors.torch.load_file`` + ``load_state_dict(strict=True)``, and by Hugging Face
             ``from_pretrained`` for a HF model). Peak memory: the largest tensor, plus one checksum
             block; never the model. The output is written to a temporary name and renamed.
inspect      prints what a checkpoint holds and verifies every file's SHA-256 and every block CRC.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
from safetensors import safe_open

from flatshard.api import CheckpointError
from flatshard.checkpoint.directory import read_manifest
from flatshard.checkpoint.format import ShardReader, ShardWriter, fsync_dir, sha256_of
from flatshard.state.model_view import dtype_from


def consolidate(ckpt: str, out: str, *, verbose: bool = False) -> dict:
    """Write the full model state of checkpoint ``ckpt`` to ``out``; returns sizes for the caller to print."""
    manifest = read_manifest(os.path.abspath(ckpt))
    keys, tensor_of, tensors = manifest["model"]["keys"], manifest["model"]["tensor_of"], manifest["tensors"]
    specs = [
        (k, dtype_from(tensors[tensor_of[k]]["dtype"]), tensors[tensor_of[k]]["shape"]) for k in keys if k in tensor_of
    ]
    meta = {
        "format": "pt",
        "flatshard_checkpoint": os.path.basename(os.path.abspath(ckpt)),
        "step": str(manifest.get("step")),
    }
    tmp = out + ".partial"
    readers: dict[str, ShardReader] = {}
    largest = 0
    try:
        writer = ShardWriter(tmp, specs, meta)
        for key, dtype, shape in specs:
            entry = tensors[tensor_of[key]]
            numel = int(torch.Size(shape).numel())
            full = torch.empty(numel, dtype=dtype)  # one tensor at a time
            for name, a, b in entry["pieces"]:
                if name not in readers:
                    path = os.path.join(ckpt, name)
                    readers[name] = ShardReader(path, manifest["files"][name])
                readers[name].read_into(tensor_of[key], 0, full[a:b])
            writer.write(key, full)
            largest = max(largest, full.numel() * full.element_size())
            if verbose:
                print(f"  {key:<50} {str(tuple(shape)):<20} {entry['dtype']}")
            del full
        record = writer.close()
    finally:
        for r in readers.values():
            r.close()
    os.replace(tmp, out)
    fsync_dir(os.path.dirname(os.path.abspath(out)))
    return {"tensors": len(specs), "bytes": record["bytes"], "largest_tensor_bytes": largest}


def inspect(ckpt: str, *, verify: bool = True, out=sys.stdout) -> list[str]:
    """Print a summary of checkpoint ``ckpt``; returns the problems found (empty if it verified)."""
    ckpt = os.path.abspath(ckpt)
    manifest = read_manifest(ckpt)
    layout = manifest["layout"]
    print(f"flatshard checkpoint {ckpt}", file=out)
    print(
        f"  format {manifest['format_version']}, flatshard {manifest['flatshard_version']}, "
        f"torch {manifest['torch_version']}",
        file=out,
    )
    print(f"  step {manifest.get('step')}, extra {manifest.get('extra')}", file=out)
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
    problems = _verify(ckpt, manifest) if verify else []
    for p in problems:
        print(f"  PROBLEM {p}", file=out)
    if verify and not problems:
        print(f"  checksums: all {len(manifest['files'])} files verified (SHA-256 and every block CRC)", file=out)
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
        p = argparse.ArgumentParser(
            prog="flatshard consolidate", description="stream a flatshard checkpoint into one safetensors file"
        )
        p.add_argument("checkpoint")
        p.add_argument("output", help="the .safetensors file to write")
        p.add_argument("-v", "--verbose", action="store_true", help="list each tensor as it is written")
        args = p.parse_args(argv)
        try:
            info = consolidate(args.checkpoint, args.output, verbose=args.verbose)
        except CheckpointError as exc:
            print(f"flatshard consolidate: {exc}", file=sys.stderr)
            return 1
        print(
            f"wrote {args.output}: {info['tensors']} tensors, {info['bytes']:,} bytes "
            f"(largest tensor {info['largest_tensor_bytes']:,} bytes)"
        )
        return 0
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
