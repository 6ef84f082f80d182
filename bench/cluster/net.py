"""The emulated cluster itself: N network namespaces ("nodes") joined by rate-limited links, and a
torchrun job across them. ``python -m bench.cluster`` is its command line; tests/test_cluster.py uses it directly:

    with Cluster(Topology(nodes=2, nproc=2, rate_bits=10**9)) as cluster:
        result = cluster.run(["examples/train_gpt.py", "--strategy", "HYBRID_SHARD"], timeout=300, log_dir=logs)

Needs root (network namespaces), ``ip`` and ``tc`` (iproute2); ``unavailable()`` says why not.

[Note: the emulated cluster]
* Nodes: one network namespace each, ``fsc<pid>n<i>``, with ``lo`` up and one interface ``fs0`` at
  10.77.0.<i+1>/24. Addresses exist only inside these namespaces; the machine's own interfaces, routes
  and addresses are never touched, and two clusters at once (two pids) do not see each other.
* Links: with 2 nodes one veth pair joins them; with more, each node's veth ends in a bridge ``br0``
  inside a namespace of its own (``fsc<pid>br``), a switch with one port per node. A ``tbf`` qdisc on
  both ends of every veth limits each direction to the rate (the node's upload on its own end, its
  download on the switch's end), with a queue of ``queue_ms`` (100 ms) at the rate: deep enough that
  TCP sees delay rather than drops (at 20 ms, 200 Mbit/s dropped packets and each drop costs a 200 ms
  retransmission timeout). ``--delay`` adds a ``netem`` delay beneath it where the kernel has netem
  (not every kernel does: the script says so and stops rather than run without it).
* Ranks on one node talk over that namespace's loopback (gloo binds to ``fs0``'s address, and the kernel
  routes traffic to a local address through ``lo``): the fast link. Ranks on different nodes talk over
  the veth: the slow link. So the two link classes of a real cluster are both here, and only the
  inter-node one is limited.
* A job: one ``torchrun --nnodes=N --nproc-per-node=P --node-rank=i`` per node, started inside its
  namespace, c10d rendezvous on node 0 (10.77.0.1:29500), ``GLOO_SOCKET_IFNAME=fs0``.
* Teardown, always: on exit, an exception, a timeout, SIGINT, SIGTERM or SIGHUP, every process started in
  the namespaces is killed (by id: each node's process group, then whatever ``ip netns pids`` still
  lists) and the namespaces are deleted, which deletes their links. Namespaces of an earlier run whose
  process is gone are removed first (``clean`` does only that). Every job has a timeout; when one node
  fails, the others are stopped at once rather than left waiting for the rendezvous.
"""

from __future__ import annotations

import dataclasses
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository: every job runs from it
PREFIX = "fsc"
SUBNET = "10.77.0"
IFNAME = "fs0"
RDZV_PORT = 29500
_NS_RE = re.compile(rf"^{PREFIX}(\d+)(n\d+|br|probe)$")


class ClusterError(RuntimeError):
    """The cluster could not be set up or a job on it failed (the message says why and what to do)."""


# ---- what this machine allows -------------------------------------------------------------------------
def unavailable() -> str | None:
    """Why an emulated cluster cannot run here, or None when it can (root, ``ip`` and ``tc`` present)."""
    if sys.platform != "linux":
        return f"network namespaces are Linux only (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (run as root, e.g. in CI)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed (iproute2)"
    probe = f"{PREFIX}{os.getpid()}probe"
    made = _sh("ip", "netns", "add", probe, check=False)
    _sh("ip", "netns", "del", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip()}"
    return None


def _sh(*cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise ClusterError(f"`{' '.join(cmd)}` failed: {proc.stderr.strip() or proc.stdout.strip()}")
    return proc


def parse_rate(text: str) -> int:
    """'1gbit', '200mbit', '500kbit' (or a plain number of bits/s) -> bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)(bit|bps)?\s*", text.lower())
    if not m:
        raise ClusterError(f"cannot read the rate {text!r}: write it as tc does, e.g. 1gbit, 200mbit, 500kbit")
    scale = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9}[m.group(2)]
    bits = int(float(m.group(1)) * scale)
    if bits <= 0:
        raise ClusterError(f"the rate must be positive, got {text!r}")
    return bits


def rate_name(bits: int) -> str:
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}"
    return f"{bits}bit"


# ---- stale namespaces -----------------------------------------------------------------------------------
def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _namespaces() -> list[str]:
    out = _sh("ip", "netns", "list", check=False).stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def _kill_inside(ns: str) -> None:
    """SIGKILL every process inside namespace ``ns`` (processes a cluster run started there), by id."""
    for pid in _sh("ip", "netns", "pids", ns, check=False).stdout.split():
        try:
            os.kill(int(pid), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass


def remove_stale() -> list[str]:
    """Delete the namespaces of cluster runs whose process is gone (a run that was killed); their names."""
    removed = []
    for ns in _namespaces():
        m = _NS_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            _kill_inside(ns)
            _sh("ip", "netns", "del", ns, check=False)
            removed.append(ns)
    return removed


# ---- the cluster ------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Topology:
    """N nodes of P ranks; every link between nodes limited to ``rate_bits`` per direction (None: no
    limit), with ``delay_ms`` one-way delay added (netem; 0 adds none) and a queue of ``queue_ms`` at
    the rate on each end."""

    nodes: int = 2
    nproc: int = 2
    rate_bits: int | None = 10**9
    delay_ms: float = 0.0
    queue_ms: float = 100.0

    def __post_init__(self) -> None:
        if not 2 <= self.nodes <= 200:
            raise ClusterError(f"--nodes must be between 2 and 200, got {self.nodes}")
        if self.nproc < 1:
            raise ClusterError(f"--nproc must be at least 1, got {self.nproc}")
        if self.delay_ms < 0:
            raise ClusterError(f"--delay must be >= 0 ms, got {self.delay_ms}")

    @property
    def world(self) -> int:
        return self.nodes * self.nproc


@dataclasses.dataclass
class JobResult:
    codes: list[int | None]  # per node: torchrun's exit status (None: killed at the timeout)
    seconds: float
    logs: list[Path]
    timed_out: bool

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(c == 0 for c in self.codes)

    def tails(self, chars: int = 3000) -> str:
        return "\n".join(f"---- node {i} ({p}) ----\n{p.read_text()[-chars:]}" for i, p in enumerate(self.logs))


class _Interrupted(BaseException):
    """A signal arrived while the cluster was up: unwind through the teardown, then exit."""

    def __init__(self, signum: int):
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


class Cluster:
    """``with Cluster(Topology(...)) as c: c.run([...])``: the namespaces and links exist inside the block."""

    def __init__(self, topo: Topology):
        self.topo = topo
        self.tag = f"{PREFIX}{os.getpid()}"
        self.nodes = [f"{self.tag}n{i}" for i in range(topo.nodes)]
        self.switch = f"{self.tag}br" if topo.nodes > 2 else None
        self._made: list[str] = []
        self._procs: list[subprocess.Popen] = []
        self._old_handlers: dict[int, object] = {}

    # -- setup and teardown --------------------------------------------------------------------------
    def __enter__(self) -> Cluster:
        why = unavailable()
        if why:
            raise ClusterError(f"cannot build an emulated cluster: {why}")
        self._trap_signals()
        try:
            remove_stale()
            for ns in self._made_namespaces():
                if ns in _namespaces():  # this pid's own leftover (a crash inside this process)
                    _kill_inside(ns)
                    _sh("ip", "netns", "del", ns, check=False)
            self._build()
        except _Interrupted as sig:
            self.close()
            raise SystemExit(128 + sig.signum) from None
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()
        if exc[0] is _Interrupted:  # the teardown ran: now behave as the signal would have
            raise SystemExit(128 + exc[1].signum)

    def _made_namespaces(self) -> list[str]:
        return self.nodes + ([self.switch] if self.switch else [])

    def _build(self) -> None:
        for ns in self._made_namespaces():
            _sh("ip", "netns", "add", ns)
            self._made.append(ns)
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        if self.switch is None:  # two nodes: one veth pair
            a, b = self.nodes
            _sh("ip", "link", "add", IFNAME, "netns", a, "type", "veth", "peer", "name", IFNAME, "netns", b)
            ends = [(a, IFNAME), (b, IFNAME)]
        else:
            _sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _sh("ip", "-n", self.switch, "link", "set", "br0", "up")
            ends = []
            for i, ns in enumerate(self.nodes):
                port = f"p{i}"
                _sh(
                    "ip", "link", "add", IFNAME, "netns", ns, "type", "veth", "peer", "name", port, "netns", self.switch
                )
                _sh("ip", "-n", self.switch, "link", "set", port, "master", "br0")
                _sh("ip", "-n", self.switch, "link", "set", port, "up")
                ends += [(ns, IFNAME), (self.switch, port)]
        for i, ns in enumerate(self.nodes):
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", IFNAME)
            _sh("ip", "-n", ns, "link", "set", IFNAME, "up")
        for ns, dev in ends:
            self._shape(ns, dev)

    def _shape(self, ns: str, dev: str) -> None:
        """tbf at the rate on this end's egress; netem beneath it for the delay."""
        rate, delay = self.topo.rate_bits, self.topo.delay_ms
        parent = ["root"]
        if delay > 0:
            proc = _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", "netem", "delay",
                       f"{delay}ms", "limit", "100000", check=False)  # fmt: skip
            if proc.returncode != 0:
                raise ClusterError(
                    f"this kernel cannot add a delay (tc netem: {proc.stderr.strip()}); "
                    "run with --delay 0 (the link is then rate-limited only), or on a kernel with CONFIG_NET_SCH_NETEM"
                )
            parent = ["parent", "1:", "handle", "2:"]
        if rate is None:
            return
        burst = max(rate // 8 // 1000, 64 * 1024)  # 1 ms at the rate, at least 64 KiB (one GSO segment)
        limit = max(int(rate / 8 * self.topo.queue_ms / 1000), 4 * burst)
        _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, *parent, "tbf", "rate", f"{rate}bit",
            "burst", str(burst), "limit", str(limit))  # fmt: skip

    def close(self) -> None:
        """Kill what runs in the namespaces and delete them; safe to call twice. Signals wait meanwhile."""
        for sig in self._old_handlers:
            signal.signal(sig, signal.SIG_IGN)  # a second Ctrl-C must not cut the teardown short
        for proc in self._procs:
            _stop(proc)
        self._procs.clear()
        for ns in reversed(self._made):
            _kill_inside(ns)
            _sh("ip", "netns", "del", ns, check=False)
        self._made.clear()
        self._restore_signals()

    def _trap_signals(self) -> None:
        def handler(signum, _frame):
            raise _Interrupted(signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            try:
                self._old_handlers[sig] = signal.signal(sig, handler)
            except ValueError:  # not the main thread: the finally blocks still tear down
                break

    def _restore_signals(self) -> None:
        for sig, old in self._old_handlers.items():
            signal.signal(sig, old)
        self._old_handlers.clear()

    # -- reading it ------------------------------------------------------------------------------------
    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def link_bytes(self) -> list[dict[str, int]]:
        """Per node, the bytes its link interface sent and received so far (the kernel's counters)."""
        out = []
        for ns in self.nodes:
            stats = Path(f"/sys/class/net/{IFNAME}/statistics")
            cmd = ["ip", "netns", "exec", ns, "cat", str(stats / "tx_bytes"), str(stats / "rx_bytes")]
            tx, rx = (int(v) for v in _sh(*cmd).stdout.split())
            out.append({"tx": tx, "rx": rx})
        return out

    def qdiscs(self) -> str:
        """``tc -s qdisc`` of every shaped end (what the links are set to, and what they passed)."""
        text = []
        for ns in self._made_namespaces():
            text.append(f"[{ns}]\n" + _sh("tc", "-n", ns, "-s", "qdisc", "show").stdout)
        return "\n".join(text)

    # -- a job -----------------------------------------------------------------------------------------
    def torchrun_argv(self, node: int, script: list[str], rdzv_id: str) -> list[str]:
        t = self.topo
        return [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={t.nodes}", f"--nproc-per-node={t.nproc}", f"--node-rank={node}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.address(0)}:{RDZV_PORT}", f"--rdzv-id={rdzv_id}",
            # node 0 hosts the rendezvous store: torchrun cannot tell by its hostname inside a namespace
            f"--rdzv-conf=is_host={int(node == 0)}", f"--local-addr={self.address(node)}", "--max-restarts=0",
            *script,
        ]  # fmt: skip

    def run(self, script: list[str], timeout: float, log_dir: Path, env: dict | None = None) -> JobResult:
        """Run ``script`` (a path and its arguments, or ``-m``, a module and its arguments) as one torchrun job
        over every node, from ROOT; bounded by ``timeout``."""
        if not self._made:
            raise ClusterError("the cluster is not up: use `with Cluster(topology) as cluster: cluster.run(...)`")
        log_dir.mkdir(parents=True, exist_ok=True)
        rdzv_id = uuid.uuid4().hex[:8]
        job_env = dict(os.environ, GLOO_SOCKET_IFNAME=IFNAME, **(env or {}))
        job_env.setdefault("OMP_NUM_THREADS", "1")
        logs, started = [], time.monotonic()
        for i, ns in enumerate(self.nodes):
            logs.append(log_dir / f"node{i}.log")
            with open(logs[-1], "w") as log:
                cmd = ["ip", "netns", "exec", ns, *self.torchrun_argv(i, script, rdzv_id)]
                # a session of its own: the node's agent and every rank it starts are one process group
                proc = subprocess.Popen(
                    cmd, cwd=ROOT, env=job_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
                )
            self._procs.append(proc)
        timed_out = False
        try:
            while any(p.poll() is None for p in self._procs):
                failed = any(p.poll() not in (None, 0) for p in self._procs)
                if failed or time.monotonic() - started > timeout:
                    timed_out = not failed
                    break
                time.sleep(0.1)
        finally:
            codes = [p.poll() for p in self._procs]
            for proc in self._procs:
                _stop(proc)
            self._procs.clear()
        return JobResult(codes, time.monotonic() - started, logs, timed_out)


def _stop(proc: subprocess.Popen) -> None:
    """End a node's process group (torchrun's agent and its ranks): SIGTERM, then SIGKILL after 5 s."""
    if proc.poll() is not None:
        return
    for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive ports that are free now, below the kernel's ephemeral range.

    [Note: ports below the ephemeral range] A port the kernel hands out (bind to 0) lies inside
    ``ip_local_port_range``, and so do the ports P + 1 ... P + G after it, which every outgoing connection of
    the run (the lighthouse's, the stores', gloo's) may take as its own local port before torchrun binds them:
    a rendezvous that failed with EADDRINUSE. Ports below the range are taken only by listeners, which the
    trial binds here see."""
    try:
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(10000, max(10001, low - count))
        socks = []
        try:
            for port in range(base, base + count):
                s = socket.socket()
                socks.append(s)
                s.bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {count} consecutive free ports between 10000 and {low}: pass --port")
