"""``flatshard plan`` as a newcomer meets it: the README's example, a default output that fits 100
columns, help on every option, flags that cannot take effect refused, the step's schedule named, and
the private _HYBRID_SHARD_ZERO2 recommended only on a margin the planner can tell apart.

Arithmetic only: no processes, no torch; each test runs in well under a second.
"""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

from flatshard.planner import Strategy
from flatshard.planner.cli import main as plan_main

ROOT = Path(__file__).resolve().parent.parent
GB = 10**9
WIDTH = 100
HYB, HYB2 = Strategy.HYBRID_SHARD, Strategy._HYBRID_SHARD_ZERO2

# llama2-7b on two nodes of 8 x 80 GB, bf16-mixed, one sequence of 4096 with checkpointing:
# _HYBRID_SHARD_ZERO2 at F=2 peaks at 97% of the budget and is predicted faster than HYBRID_SHARD
# by a fraction of a percent, from communication alone (no compute given).
SEVEN_B = [
    "--model",
    "llama2-7b",
    "--world",
    "16",
    "--gpu-mem",
    "80GB",
    "--precision",
    "bf16-mixed",
    "--micro-batch",
    "1",
    "--seq-len",
    "4096",
    "--checkpointing",
]


def readme_plan_argv() -> list[str]:
    """The arguments of README.md's first ``flatshard plan`` command (a command line, not prose)."""
    text = (ROOT / "README.md").read_text()
    m = re.search(r"^(?:\S*/)?flatshard plan ((?:.*\\\n)*.*)$", text, re.MULTILINE)
    assert m, "README.md has no `flatshard plan` command line"
    return shlex.split(m.group(1).replace("\\\n", " "), comments=True)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    rc = plan_main(argv)
    out, err = capsys.readouterr()
    return rc, out, err


def flat(text: str) -> str:
    """``text`` with its line breaks and runs of spaces as single spaces (prose is wrapped to 100)."""
    return " ".join(text.split())


# ---------------------------------------------------------------- the README's example
def test_readme_example_fits(capsys):
    argv = readme_plan_argv()
    assert "--micro-batch" in argv and "--seq-len" in argv  # activations counted: a real answer
    rc, out, err = run(argv + ["--json"], capsys)
    assert rc == 0, err
    doc = json.loads(out)
    assert doc["recommendation"]["strategy"] is not None and doc["activations_counted"] is True
    rc, out, _ = run(argv, capsys)
    assert rc == 0 and "recommendation: none" not in out
