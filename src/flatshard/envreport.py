"""``flatshard env``: what this machine is, as a bug report needs it (like ``accelerate env``).

flatshard, torch and how it was built (CUDA, cuDNN, debug), Python, the platform, the distributed
backends this torch has, CPUs, GPUs, the optional packages, and the environment variables that change
how a distributed run starts. Plain ``- name: value`` lines to paste into an issue, or one JSON object
with ``--json``. Nothing here fails: what cannot be read is reported as such.

An entry-level module beside cli.py: it imports nothing of flatshard (cli.py passes the version in).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import os
import platform
import sys
from typing import Any

OPTIONAL = ("numpy", "safetensors", "rich", "matplotlib", "transformers")
ENV_PREFIXES = ("NCCL_", "TORCH_", "CUDA_", "OMP_", "GLOO_")
ENV_NAMES = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "WORLD_SIZE",
    "RANK",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MALLOC_MMAP_THRESHOLD_",
)


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _torch(report: dict[str, Any]) -> None:
    try:
        torch = importlib.import_module("torch")
    except Exception as exc:  # an env report must print whatever torch's import does
        report["torch"] = f"not importable ({type(exc).__name__}: {exc})"
        return
    report["torch"] = torch.__version__
    report["torch location"] = os.path.dirname(torch.__file__) if torch.__file__ else "unknown (no __file__)"
    report["torch debug build"] = bool(torch.version.debug)
    report["torch built with CUDA"] = torch.version.cuda or "no (CPU-only or another accelerator)"
    if getattr(torch.version, "hip", None):
        report["torch built with ROCm/HIP"] = torch.version.hip
    cudnn = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
    report["cuDNN"] = cudnn or "not available"
    report["torch git revision"] = getattr(torch.version, "git_version", "unknown")
    report["torch threads"] = torch.get_num_threads()
    _distributed(torch, report)
    _gpus(torch, report)


def _distributed(torch: Any, report: dict[str, Any]) -> None:
    dist = torch.distributed
    if not dist.is_available():
        report["torch.distributed"] = "not available in this torch build"
        return
    checks = {
        "gloo": "is_gloo_available",
        "nccl": "is_nccl_available",
        "mpi": "is_mpi_available",
        "ucc": "is_ucc_available",
        "xccl": "is_xccl_available",
    }
    found = [name for name, fn in checks.items() if getattr(dist, fn, lambda: False)()]
    report["distributed backends"] = ", ".join(found) or "none"
    if "nccl" in found:
        try:
            report["NCCL version"] = ".".join(str(v) for v in torch.cuda.nccl.version())
        except Exception as exc:  # NCCL can be compiled in but not loadable on this machine
            report["NCCL version"] = f"unknown ({type(exc).__name__})"


def _gpus(torch: Any, report: dict[str, Any]) -> None:
    try:
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception as exc:  # a broken driver raises here; say so instead of failing the report
        report["GPUs"] = f"unknown ({type(exc).__name__}: {exc})"
        return
    if count == 0:
        report["GPUs"] = "none visible to torch (CUDA not available)"
        return
    gpus = []
    for i in range(count):
        props = torch.cuda.get_device_properties(i)
        gpus.append(f"{i}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute {props.major}.{props.minor}")
    report["GPUs"] = gpus
    report["bf16 supported"] = bool(torch.cuda.is_bf16_supported())


def _cpus(report: dict[str, Any]) -> None:
    report["CPUs"] = os.cpu_count()
    if hasattr(os, "sched_getaffinity"):
        report["CPUs usable by this process"] = len(os.sched_getaffinity(0))


def collect(version: str, location: str) -> dict[str, Any]:
    """The report as an ordered dict of name -> value (a string, a number, a bool or a list of strings)."""
    report: dict[str, Any] = {"flatshard": version, "flatshard location": location}
    report["Python"] = f"{platform.python_version()} ({platform.python_implementation()}, {sys.executable})"
    report["platform"] = platform.platform()
    report["machine"] = platform.machine()
    _cpus(report)
    _torch(report)
    for name in OPTIONAL:
        report[name] = _version(name)
    env = {k: v for k, v in sorted(os.environ.items()) if k in ENV_NAMES or k.startswith(ENV_PREFIXES)}
    report["environment"] = [f"{k}={v}" for k, v in env.items()] or "none of the variables that change a run"
    return report


def render(report: dict[str, Any]) -> str:
    lines = []
    for name, value in report.items():
        if isinstance(value, list):
            lines.append(f"- {name}:")
            lines += [f"    {item}" for item in value]
        else:
            lines.append(f"- {name}: {value}")
    return "\n".join(lines)


def main(argv: list[str], version: str, location: str) -> int:
    p = argparse.ArgumentParser(
        prog="flatshard env",
        description="Print what this machine is (flatshard, torch and its build, Python, platform, "
        "distributed backends, CPUs, GPUs): paste it into a bug report.",
    )
    p.add_argument("--json", action="store_true", help="print one JSON object instead of lines")
    args = p.parse_args(argv)
    report = collect(version, location)
    if args.json:
        print(json.dumps(report, indent=1))
    else:
        print("Copy and paste the lines below into a flatshard bug report.\n")
        print(render(report))
    return 0
