"""A process that used flatshard on gloo gets one exit handler that hands the GIL to gloo's worker threads
before the interpreter finalizes ([Note: gloo's workers at exit], runtime/comm/mesh.py), whichever front
end it wrapped with and however many times. What the handler prevents (an abort after the script's last
line, now and then) is counted by the loop in CONTRIBUTING.md, minutes of runs, not a test."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = textwrap.dedent(
    """
    import atexit, tempfile, time
    import torch, torch.distributed as dist
    from torch import nn

    handlers = []
    register = atexit.register
    atexit.register = lambda fn, *a, **k: (handlers.append((fn, a)), register(fn, *a, **k))[1]
    import flatshard

    dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
    before = len(handlers)
    flatshard.FullyShardedDataParallel(nn.Linear(4, 4))
    flatshard.fully_shard(nn.Linear(4, 4))
    flatshard.fully_shard(nn.Linear(4, 4))
    sleeps = [a for fn, a in handlers[before:] if fn is time.sleep]
    print(len(sleeps), sleeps[0][0] if sleeps else None)
    dist.destroy_process_group()
    """
)


def test_one_exit_handler_that_releases_the_gil_once_gloo_is_used():
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120, cwd=ROOT, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    count, seconds = out.stdout.split()
    assert int(count) == 1, out.stdout
    assert float(seconds) > 0, out.stdout
