"""The ``flatshard`` command: ``--version``, ``env``, ``python -m flatshard``, and subcommands whose help
and usage errors read alike (``usage: flatshard CMD ...`` then ``flatshard CMD: error: ...``, status 2)."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import flatshard
from flatshard.cli import COMMANDS, main

SCRIPT = Path(sys.executable).parent / "flatshard"  # the console script pip installed beside this python


def run(*argv: str, module: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "flatshard", *argv] if module else [str(SCRIPT), *argv]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120)


def test_version_from_python_m_and_the_console_script():
    want = f"flatshard {flatshard.__version__}"
    assert flatshard.__version__ == importlib.metadata.version("flatshard")  # the metadata reads the same
    out = run("--version")
    assert (out.returncode, out.stdout.strip()) == (0, want), out.stderr
    assert SCRIPT.exists(), f"no console script at {SCRIPT}: install flatshard with pip (make install)"
    out = run("--version", module=False)
    assert (out.returncode, out.stdout.strip()) == (0, want), out.stderr


def test_version_and_plan_start_without_torch():
    code = (
        "import sys; from flatshard.cli import main\n"
        "try:\n    main(['--version'])\nexcept SystemExit:\n    pass\n"
        "rc = main(['plan', '--params', '7B', '--units', '32', '--world', '8', '--gpu-mem', '40GB', '--json'])\n"
        "print('torch' in sys.modules, rc, file=sys.stderr)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stderr.strip().splitlines()[-1] == "False 0", out.stderr[-2000:]


def test_help_lists_every_command(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: flatshard ")
    for name in ("plan", "consolidate", "inspect", "env"):
        assert name in COMMANDS and f"    {name}" in out
    assert main([]) == 2  # no command: the help, on stderr
    assert "commands:" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["bogus"], ["--bogus"], ["--bogus", "plan"]])
def test_unknown_command_or_option(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: flatshard ") and "\nflatshard: error: " in err


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_subcommand_has_help_in_the_same_form(command, capsys):
    try:
        rc = main([command, "--help"])
    except SystemExit as exc:  # argparse's own help exit
        rc = exc.code
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: flatshard {command}") and "options:" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", "--world", "8", "--no-such-flag"],
        ["plan", "--world", "8"],  # no model: a planner error, same form
        ["consolidate"],
        ["inspect"],
        ["env", "--no-such-flag"],
    ],
)
def test_every_subcommand_reports_usage_errors_in_the_same_form(argv, capsys):
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse's own error exit
        rc = exc.code
    assert rc == 2
    out, err = capsys.readouterr()
    command = argv[0]
    assert out == "" and "Traceback" not in err
    assert err.startswith(f"usage: flatshard {command}") and f"\nflatshard {command}: error: " in err, err


def test_env_reports_this_machine(capsys):
    import torch

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    lines = dict(line[2:].split(": ", 1) for line in out.splitlines() if line.startswith("- ") and ": " in line)
    assert lines["flatshard"] == flatshard.__version__
    assert lines["torch"] == torch.__version__
    assert lines["torch location"] == os.path.dirname(torch.__file__)
    assert lines["CPUs"] == str(os.cpu_count())
    assert "gloo" in lines["distributed backends"].split(", ")
    assert lines["Python"].startswith(sys.version.split()[0])
    if not torch.cuda.is_available():
        assert lines["GPUs"].startswith("none")
    assert main(["env", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["flatshard"] == flatshard.__version__ and doc["torch"] == torch.__version__
    assert doc["CPUs"] == os.cpu_count() and doc["torch built with CUDA"] == (
        torch.version.cuda or doc["torch built with CUDA"]
    )


def test_python_m_flatshard_runs_a_subcommand():
    out = run("plan", "--params", "7B", "--units", "32", "--world", "8", "--gpu-mem", "40GB", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["recommendation"]["strategy"] == "HYBRID_SHARD"
    out = run("plan", "--params", "70B", "--world", "8", "--gpu-mem", "40GB")
    assert out.returncode == 1 and "nothing fits" in out.stdout  # the planner's exit status comes through
