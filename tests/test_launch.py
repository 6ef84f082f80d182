"""A local launch listens on loopback only ([Note: loopback-only local launch] in examples/local_launch.py).

examples/train_gpt.py starts 2 local ranks itself (bench/compare.py and examples/big_model.py launch the
same way) while the socket table (/proc/net/tcp and tcp6) is read every 50 ms, keeping every listening
socket held by the launcher or a process it started: the rendezvous store (the launcher) and each rank's
gloo listener. Every one must be on 127.0.0.1 (or ::1), never on 0.0.0.0 or ::, whether MASTER_ADDR is
unset or 127.0.0.1. The runs watched are tests/test_example.py's figure runs (tests/helpers/train_gpt.py:
one launch serves both files). Skipped only where the socket table cannot be read.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

import pytest

from tests.helpers.sockets import is_loopback, job_listeners, socket_table_or_skip
from tests.helpers.train_gpt import MASTER_ADDR, WORLD, figure_run

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


@pytest.mark.parametrize("master_addr", [None, "127.0.0.1"])
def test_a_local_run_listens_on_loopback_only(master_addr):
    socket_table_or_skip()
    (strategy,) = [s for s, addr in MASTER_ADDR.items() if addr == master_addr]
    run = figure_run(strategy)
    seen = run.listeners
    exposed = sorted((a, p) for a, p, _ in seen if not is_loopback(a))
    assert not exposed, f"listening beyond loopback: {exposed}"
    # what was seen is the job's: the launcher's store and a gloo listener in each of the ranks
    holders = {pid for _, _, pid in seen}
    assert run.launcher in holders, f"no listener of the launcher seen (the rendezvous store): {sorted(seen)}"
    assert len(holders - {run.launcher}) == WORLD, f"expected a listener in each of {WORLD} ranks: {sorted(seen)}"


def test_the_store_a_launcher_hosts_listens_on_loopback_only():
    """examples/big_model.py's ranks are clients of the store their launcher hosts (loopback_store)."""
    socket_table_or_skip()
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("local_launch_under_test", EXAMPLES / "local_launch.py")
        local_launch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(local_launch)
    finally:
        sys.path.remove(str(EXAMPLES))
    store, port = local_launch.loopback_store()
    try:
        mine = {(a, p) for a, p, pid in job_listeners(os.getpid()) if p == port}
        assert mine == {("127.0.0.1", port)}, mine
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        client.set("key", "value")
        assert store.get("key") == b"value"
        assert local_launch.loopback_env()["GLOO_SOCKET_IFNAME"] == local_launch.loopback_interface()
    finally:
        del store
