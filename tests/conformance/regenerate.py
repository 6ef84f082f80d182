"""Write the conformance copies of PyTorch's FSDP2 tests: mechanically transformed, never edited by hand.

PyTorch's test files are not part of this repository and must never be committed to it. Get them from a
PyTorch checkout at the release flatshard pins (``torch.version.git_version`` of the installed wheel;
for torch 2.13.0 that is the tag ``v2.13.0``, commit cf30153c4c131c8164ee7798e5022d810682e2cb):

    git clone --depth 1 --branch v2.13.0 https://github.com/pytorch/pytorch /tmp/pytorch
    python tests/conformance/regenerate.py --source /tmp/pytorch/test/distributed/_composable/fsdp

The helpers they import (``torch.testing._internal.common_fsdp``, ``common_distributed``,
``common_utils``, ``distributed._tensor.common_dtensor``) ship in the wheel. The copies go to
``.conformance/generated/`` (gitignored), in two variants:

- ``torch/``: device changes only, so the baseline is PyTorch's own FSDP2 on CPU with gloo;
- ``flatshard/``: the same, with FSDP2's public names imported from flatshard instead.

The transformations, all textual and listed here (``TRANSFORMS``, ``SWAPPED``):

- every file first imports ``_conformance_shim`` (tests/conformance/shim.py, copied beside it): the
  test helpers run on CPU at world size 2 (``skip_if_lt_x_gpu`` runs the test; ``FSDPTest`` starts
  two gloo processes); in the flatshard variant the helpers that call ``fully_shard`` call flatshard's;
- device ``"cuda"`` -> ``"cpu"``, backend ``"nccl"`` -> ``"gloo"``, ``.cuda()`` -> ``.cpu()``, device
  counts -> 2 (emulated devices), ``torch.device(type, current_device())`` -> ``torch.device(type)``,
  ``current_accelerator().type`` -> ``"cpu"``, DDP's ``device_ids=[self.rank]`` -> ``None``;
- flatshard variant: ``from torch.distributed.fsdp import fully_shard, FSDPModule, ...`` (and the
  private and old paths that export the same public names) import those names from ``flatshard``;
  every other name keeps its PyTorch import.

The files fetched for the committed results, and the commit each was read at, are in sources.json.
"""

from __future__ import annotations

import argparse
import ast
import re
import shutil
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
DEFAULT_OUT = ROOT / ".conformance" / "generated"
SHIM = "_conformance_shim"

# (pattern, replacement), applied in order to every file of both variants
TRANSFORMS: list[tuple[str, str]] = [
    (
        r"torch\.device\(\s*(\w+)\.type,\s*torch\.get_device_module\(\1\)\.current_device\(\)\s*\)",
        r"torch.device(\1.type)",
    ),
    (r"""(["'])cuda\1""", r"\1cpu\1"),
    (r"""(["'])cuda:(\d+)\1""", r"\1cpu\1"),
    (r"""(["'])nccl\1""", r"\1gloo\1"),
    (r"\.cuda\(\)", ".cpu()"),
    (r"torch\.cuda\.device_count\(\)", "2"),
    (r"torch\.accelerator\.device_count\(\)", "2"),
    (r"torch\.get_device_module\(\w*\)\.device_count\(\)", "2"),
    (r"torch\.accelerator\.current_accelerator\(\)\.type", '"cpu"'),
    (r"torch\.cuda\.synchronize\(\)", "torch.cpu.synchronize()"),
    (r"device_ids=\[self\.rank\]", "device_ids=None"),  # DDP on CPU takes no device ids
]

# modules whose public FSDP2 names the flatshard variant imports from flatshard instead
FSDP2_MODULES = {
    "torch.distributed.fsdp",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed.fsdp._fully_shard._fully_shard",
    "torch.distributed.fsdp._fully_shard._fsdp_api",
}
SWAPPED = {
    "fully_shard",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "CPUOffloadPolicy",
    "UnshardHandle",
    "register_fsdp_forward_method",
}


def device_only(text: str) -> str:
    for pattern, replacement in TRANSFORMS:
        text = re.sub(pattern, replacement, text)
    return _with_shim(text)


def _with_shim(text: str) -> str:
    """The shim import goes before the first import (after the header comments and docstring)."""
    tree = ast.parse(text)
    first = next(node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom)))
    lines = text.splitlines(keepends=True)
    lines.insert(first.lineno - 1, f"import {SHIM}  # noqa: F401  (conformance: CPU/gloo helpers)\n")
    return "".join(lines)


def swap_imports(text: str) -> str:
    """FSDP2's public names from flatshard; one import statement becomes at most two, on the same lines."""
    tree = ast.parse(text)
    lines = text.splitlines(keepends=True)
    for node in sorted(ast.walk(tree), key=lambda n: -getattr(n, "lineno", 0)):
        if not (isinstance(node, ast.ImportFrom) and node.module in FSDP2_MODULES):
            continue
        swapped = [a for a in node.names if a.name in SWAPPED]
        if not swapped:
            continue
        kept = [a for a in node.names if a.name not in SWAPPED]
        indent = re.match(r"\s*", lines[node.lineno - 1]).group(0)
        parts = [f"from flatshard import {_names(swapped)}"]
        if kept:
            parts.append(f"from {node.module} import {_names(kept)}")
        span = node.end_lineno - node.lineno + 1
        lines[node.lineno - 1 : node.end_lineno] = [indent + "; ".join(parts) + "\n"] + ["\n"] * (span - 1)
    return "".join(lines)


def _names(aliases: list[ast.alias]) -> str:
    return ", ".join(a.name if a.asname is None else f"{a.name} as {a.asname}" for a in aliases)


def regenerate(source: Path, out: Path) -> list[str]:
    files = sorted(p for p in source.glob("*.py") if p.name.startswith(("test_", "_test")))
    if not files:
        raise SystemExit(f"{source} holds no test_*.py files: pass PyTorch's test/distributed/_composable/fsdp")
    for variant in ("torch", "flatshard"):
        target = out / variant
        if target.exists():
            shutil.rmtree(target)
        target.mkdir(parents=True)
        shutil.copy(HERE / "shim.py", target / f"{SHIM}.py")
        shutil.copy(HERE / "plugin.py", target / "conftest.py")
        (target / "pytest.ini").write_text("[pytest]\n")  # not the repository's settings
        for path in files:
            text = device_only(path.read_text())
            if variant == "flatshard":
                text = swap_imports(text)
            (target / path.name).write_text(text)
    return [p.name for p in files]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--source",
        type=Path,
        default=ROOT / ".conformance" / "upstream",
        help="PyTorch's test/distributed/_composable/fsdp (default .conformance/upstream)",
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    names = regenerate(args.source, args.out)
    print(f"wrote {len(names)} files in two variants under {args.out}: {', '.join(names)}")


if __name__ == "__main__":
    main()
