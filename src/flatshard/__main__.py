"""``python -m flatshard``: the ``flatshard`` command (see cli.py)."""

from flatshard.cli import main

raise SystemExit(main())
