"""The ``flatshard`` command (also ``python -m flatshard``): one entry point, one subcommand per tool.

    flatshard --version
    flatshard env [--json]                   what this machine is, for a bug report
    flatshard plan ...                       what fits, what it costs, which sharding factor to choose
    flatshard consolidate CKPT OUT ...       a checkpoint as safetensors a plain model loads
    flatshard inspect CKPT                   what a checkpoint holds; verify its checksums

The top level is argparse subcommands; each subcommand parses its own arguments with argparse under
the prog name ``flatshard COMMAND``, so help reads alike and a usage error is always ``usage: ...``
then ``flatshard COMMAND: error: ...`` on stderr, exit status 2. Subcommands load their modules only
when run, so ``flatshard plan`` and ``flatshard --version`` start without importing torch.
"""

from __future__ import annotations

import argparse
import os
import sys

import flatshard

COMMANDS = {
    "plan": "what fits, what it costs, which sharding factor to choose (no GPU needed)",
    "consolidate": "stream a checkpoint into safetensors a plain model or from_pretrained loads",
    "inspect": "what a checkpoint holds; verify its checksums",
    "env": "what this machine is (flatshard, torch and its build, backends, CPUs, GPUs), for a bug report",
}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="flatshard",
        description="Fully Sharded Data Parallel training for PyTorch: the command-line tools.",
        epilog="`flatshard COMMAND --help` shows the arguments of each command.",
    )
    p.add_argument("--version", action="version", version=f"flatshard {flatshard.__version__}")
    sub = p.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for name, summary in COMMANDS.items():
        # Each command parses its own arguments (so its --help is its own): take everything after it.
        sub.add_parser(name, help=summary, description=summary, add_help=False)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = _parser()
    # The top level reads the options before the command and the command; the command reads the rest.
    at = next((k for k, arg in enumerate(argv) if not arg.startswith("-")), len(argv))
    args, rest = parser.parse_args(argv[: at + 1]), argv[at + 1 :]  # exits 0 for --help/--version, 2 on error
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.command == "plan":
        from flatshard.planner.cli import main as plan_main

        return plan_main(rest)
    if args.command == "env":
        from flatshard.envreport import main as env_main

        return env_main(rest, flatshard.__version__, os.path.dirname(os.path.abspath(flatshard.__file__)))
    from flatshard.checkpoint.tools import main as checkpoint_main

    return checkpoint_main(args.command, rest)


if __name__ == "__main__":
    raise SystemExit(main())
