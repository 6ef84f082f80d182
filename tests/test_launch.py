"""A local launch listens on loopback only ([Note: loopback-only local launch] in examples/local_launch.py).

examples/train_gpt.py starts 2 local ranks itself (bench/compare.py and examples/big_model.py launch the
same way) while this test reads the kernel's socket table (/proc/net/tcp and tcp6) every 50 ms and keeps
every listening socket held by the launcher or a process it started: the rendezvous store (the launcher)
and each rank's gloo listener. Every one must be on 127.0.0.1 (or ::1), never on 0.0.0.0 or ::, whether
MASTER_ADDR is unset or 127.0.0.1. Skipped only where the socket table cannot be read.
"""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TIMEOUT_S = 150


def _socket_table_or_skip() -> None:
    try:
        Path("/proc/net/tcp").read_text()
        Path(f"/proc/{os.getpid()}/fd").iterdir()
    except OSError as exc:
        pytest.skip(f"the socket table cannot be read here ({exc})")


def _descendants(root: int) -> set[int]:
    """``root`` and every process below it (torchrun starts its ranks in sessions of their own)."""
    parent = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the process ended while we read
    family, grew = {root}, True
    while grew:
        grew = False
        for pid, ppid in parent.items():
            if ppid in family and pid not in family:
                family.add(pid)
                grew = True
    return family


def _socket_inodes(pids: set[int]) -> dict[int, int]:
    """socket inode -> the pid holding it."""
    held = {}
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                held[int(target[8:-1])] = pid
    return held


def _decode(hex_addr: str, v6: bool) -> tuple[str, int]:
    addr, port = hex_addr.split(":")
    raw = bytes.fromhex(addr)
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))  # the kernel's words, host order
    return socket.inet_ntop(socket.AF_INET6 if v6 else socket.AF_INET, raw), int(port, 16)


def _listeners() -> list[tuple[str, int, int]]:
    """(address, port, inode) of every listening TCP socket of this machine."""
    rows = []
    for name, v6 in (("tcp", False), ("tcp6", True)):
        try:
            lines = Path(f"/proc/net/{name}").read_text().splitlines()[1:]
        except OSError:
            continue  # no IPv6 here
        for line in lines:
            fields = line.split()
            if fields[3] == "0A":  # TCP_LISTEN
                rows.append((*_decode(fields[1], v6), int(fields[9])))
    return rows


def _job_listeners(root: int) -> set[tuple[str, int, int]]:
    """(address, port, pid) of the listening sockets held by ``root`` or a process below it, now."""
    held = _socket_inodes(_descendants(root))
    return {(addr, port, held[inode]) for addr, port, inode in _listeners() if inode in held}


def _is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


@pytest.mark.parametrize("master_addr", [None, "127.0.0.1"])
def test_a_local_run_listens_on_loopback_only(tmp_path, master_addr):
    _socket_table_or_skip()
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    if master_addr is not None:
        env["MASTER_ADDR"] = master_addr
    cmd = [sys.executable, str(EXAMPLES / "train_gpt.py"), "--nproc", "2", "--model", "tiny", "--steps", "6"]
    cmd += ["--log-interval", "3", "--eval-batches", "1", "--sample-tokens", "0", "--quiet"]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True
    )
    seen: set[tuple[str, int, int]] = set()
    deadline = time.monotonic() + TIMEOUT_S
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            seen |= _job_listeners(proc.pid)
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        log = proc.communicate()[0].decode(errors="replace")
    assert proc.returncode == 0, f"train_gpt.py exited {proc.returncode}:\n{log[-3000:]}"
    exposed = sorted((a, p) for a, p, _ in seen if not _is_loopback(a))
    assert not exposed, f"listening beyond loopback: {exposed}"
    # what was seen is the job's: the launcher's store and a gloo listener in each of the 2 ranks
    holders = {pid for _, _, pid in seen}
    assert proc.pid in holders, f"no listener of the launcher seen (the rendezvous store): {sorted(seen)}"
    assert len(holders - {proc.pid}) == 2, f"expected a listener in each of 2 ranks: {sorted(seen)}"


def test_the_store_a_launcher_hosts_listens_on_loopback_only():
    """examples/big_model.py's ranks are clients of the store their launcher hosts (loopback_store)."""
    _socket_table_or_skip()
    sys.path.insert(0, str(EXAMPLES))
    try:
        spec = importlib.util.spec_from_file_location("local_launch_under_test", EXAMPLES / "local_launch.py")
        local_launch = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(local_launch)
    finally:
        sys.path.remove(str(EXAMPLES))
    store, port = local_launch.loopback_store()
    try:
        mine = {(a, p) for a, p, pid in _job_listeners(os.getpid()) if p == port}
        assert mine == {("127.0.0.1", port)}, mine
        import torch.distributed as dist

        client = dist.TCPStore("127.0.0.1", port, is_master=False)
        client.set("key", "value")
        assert store.get("key") == b"value"
        assert local_launch.loopback_env()["GLOO_SOCKET_IFNAME"] == local_launch.loopback_interface()
    finally:
        del store
