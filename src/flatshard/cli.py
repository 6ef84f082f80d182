"""The ``flatshard`` console script: one entry point, one subcommand per tool."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(
            "usage: flatshard {plan,consolidate,inspect} ...\n\n"
            "  plan          what fits, what it costs, which sharding factor to choose\n"
            "  consolidate   stream a checkpoint into one safetensors file (CKPT OUT.safetensors)\n"
            "  inspect       what a checkpoint holds; verify its checksums (CKPT)"
        )
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "plan":
        from flatshard.planner.cli import main as plan_main

        return plan_main(rest)
    if command in ("consolidate", "inspect"):
        from flatshard.checkpoint.tools import main as checkpoint_main

        return checkpoint_main(command, rest)
    print(f"flatshard: unknown command {command!r}; try `flatshard --help`", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
