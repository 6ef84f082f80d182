"""A local launch listens on loopback only ([Note: loopback-only local launch] in examples/local_launch.py).

Here: the store a launcher hosts for ranks started without torchrun (examples/big_model.py) listens on
127.0.0.1. The sockets of examples/train_gpt.py's own launch are checked in tests/test_example.py
(test_a_local_run_listens_on_loopback_only), beside the figure runs it watches: one file, so one worker
of the suite launches them once. Skipped only where the socket table cannot be read.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

from tests.helpers.sockets import job_listeners, socket_table_or_skip

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"


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
