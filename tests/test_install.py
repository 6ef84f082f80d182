"""``pip install .`` into an environment that already has torch keeps that torch: same version, same place.

The package asks for ``torch>=2.13`` only (pyproject.toml); the exact CPU build of the project's machines
comes from the Makefile's constraints file, not from the metadata. A fresh virtualenv sees this test
environment's packages through a .pth file (a folder of links to them, flatshard left out), so torch is
there without a 700 MB install, and pip installs offline (``--no-index``, the build backend from this
environment). Two cases: the real torch of this environment, and a stand-in for a user's other release:
the same torch files under a distribution record (dist-info) that says 2.99.0, as a newer release or a
nightly would, which an exact pin would have replaced. pip reads only the record, so this tests what pip
decides; no other build of torch is installed or imported.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SITE = Path(sysconfig.get_paths()["purelib"])  # this test environment's packages
PROBE = (
    "import importlib.metadata as m, json, sys, torch, flatshard; "
    "print(json.dumps([m.version('torch'), torch.__file__, flatshard.__file__, m.version('flatshard')]))"
)


def _source(tmp: Path) -> Path:
    """A copy of what the build reads, so building leaves nothing in the checkout."""
    src = tmp / "src_copy"
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        (src / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, src / name)
    shutil.copytree(ROOT / "src", src / "src", ignore=shutil.ignore_patterns("*.egg-info", "__pycache__"))
    return src


def _venv(tmp: Path, fake_torch: str | None) -> tuple[Path, Path]:
    """A fresh virtualenv (no pip of its own) that sees this environment's packages but not flatshard;
    with ``fake_torch``, torch's distribution says that version instead."""
    venv, farm = tmp / "venv", tmp / "shared"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=60)
    farm.mkdir()
    for entry in SITE.iterdir():
        name = entry.name
        if name.startswith(("flatshard", "__editable__", "pip")) or name.endswith(".pth"):
            continue
        if fake_torch and name.startswith("torch-") and name.endswith(".dist-info"):
            continue
        (farm / name).symlink_to(entry)
    if fake_torch:
        info = farm / f"torch-{fake_torch}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: torch\nVersion: {fake_torch}\n")
        (info / "RECORD").write_text("")
        (info / "INSTALLER").write_text("pip\n")
    python = venv / "bin" / "python"
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "shared_site.pth").write_text(f"{farm}\n")
    return python, Path(purelib)


def _probe(python: Path) -> list[str]:
    out = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("fake_torch", [None, "2.99.0"], ids=["this-torch", "another-release"])
def test_pip_install_keeps_the_torch_that_is_there(tmp_path, fake_torch):
    src = _source(tmp_path)
    python, purelib = _venv(tmp_path, fake_torch)
    before = subprocess.run(
        [str(python), "-c", "import importlib.metadata as m, torch; print(m.version('torch'), torch.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert before.returncode == 0, before.stderr[-3000:]
    version_before, file_before = before.stdout.split()
    assert version_before == (fake_torch or version_before)
    install = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(python),
            "--isolated",  # no user configuration or PIP_* variables: only what this command says
            "install",
            "--no-index",  # offline: a torch that pip wanted would fail here, not download
            "--no-build-isolation",  # the build backend (setuptools) comes from the shared packages
            str(src),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        # and no configuration files either (this machine's own caps and wheel folders included)
        env={**{k: v for k, v in os.environ.items() if not k.startswith("PIP_")}, "PIP_CONFIG_FILE": os.devnull},
    )
    assert install.returncode == 0, f"pip install . failed:\n{install.stdout[-3000:]}\n{install.stderr[-3000:]}"
    torch_version, torch_file, flatshard_file, flatshard_version = _probe(python)
    assert (torch_version, torch_file) == (version_before, file_before), "pip replaced the torch that was there"
    assert not any(p.name.startswith("torch") for p in purelib.iterdir()), sorted(os.listdir(purelib))
    assert Path(flatshard_file).is_relative_to(purelib)  # installed into the new environment, not linked
    assert (purelib / "flatshard" / "py.typed").exists()
    import flatshard

    assert flatshard_version == flatshard.__version__
