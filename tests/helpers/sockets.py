"""The kernel's socket table (/proc/net/tcp and tcp6), read for the listening sockets a launched job holds:
the launcher's rendezvous store and each rank's gloo listener ([Note: loopback-only local launch] in
examples/local_launch.py)."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest


def _unreadable() -> str | None:
    """Why the socket table cannot be read here, or None."""
    try:
        Path("/proc/net/tcp").read_text()
        Path(f"/proc/{os.getpid()}/fd").iterdir()
    except OSError as exc:
        return str(exc)
    return None


def socket_table_or_skip() -> None:
    reason = _unreadable()
    if reason is not None:
        pytest.skip(f"the socket table cannot be read here ({reason})")


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


def job_listeners(root: int) -> set[tuple[str, int, int]]:
    """(address, port, pid) of the listening sockets held by ``root`` or a process below it, now."""
    held = _socket_inodes(_descendants(root))
    return {(addr, port, held[inode]) for addr, port, inode in _listeners() if inode in held}


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    return ip.is_loopback or (ip.version == 6 and ip.ipv4_mapped is not None and ip.ipv4_mapped.is_loopback)


def run_watched(cmd: list[str], cwd, env: dict, timeout: float, what: str) -> tuple[str, set, int]:
    """Run a command that starts ranks itself, reading the socket table every 50 ms while it runs:
    (its output, every (address, port, pid) it or a process below it listened on, its pid). Where the table
    cannot be read, nothing is seen. A timeout or a non-zero exit fails the test with the end of the output."""
    watch = _unreadable() is None
    with tempfile.TemporaryFile() as out:  # a file, not a pipe: output never blocks the job
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        seen: set[tuple[str, int, int]] = set()
        deadline = time.monotonic() + timeout
        try:
            while proc.poll() is None and time.monotonic() < deadline:
                if watch:
                    seen |= job_listeners(proc.pid)
                time.sleep(0.05)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            out.seek(0)
            log = out.read().decode(errors="replace")
    assert proc.returncode == 0, f"{what} exited {proc.returncode}:\n{log[-4000:]}"
    return log, seen, proc.pid
