"""Local ranks whose every listening socket is on 127.0.0.1: the launch used by train_gpt.py,
big_model.py and bench/compare.py when they start their ranks themselves.

[Note: loopback-only local launch]
What listens during a local job, and where, with torch 2.13 (read from torch/distributed/run.py,
elastic/rendezvous/ and the c10d TCPStore, and seen in /proc/net/tcp6 during a run):
* ``torchrun --standalone`` sets ``--rdzv-backend=c10d --rdzv-endpoint=localhost:0``: the agent hosts
  the rendezvous's TCPStore; then, for the ranks, the c10d handler starts a second TCPStore server
  named by the node's FQDN (``MASTER_ADDR``/``MASTER_PORT`` of the ranks, ``TORCHELASTIC_USE_AGENT_STORE``).
  A TCPStore server binds the wildcard address (``::``, every interface, IPv4 too) whatever host name
  it is given, with both server backends (libuv and the classic one); ``MASTER_ADDR=127.0.0.1`` only
  says where clients connect. The one way to bind elsewhere is ``master_listen_fd``: a socket the
  caller has bound. A ``static`` rendezvous, or ranks that host the store from env://, bind the same way.
* gloo listens on the address its device was made for: the one the host name resolves to, unless
  ``GLOO_SOCKET_IFNAME`` names an interface; NCCL's bootstrap likewise (``NCCL_SOCKET_IFNAME``).

So a local launch here is torchrun's own machinery (its argument parser and ``run``: the ranks see
what ``torchrun`` gives them) with a rendezvous handler of our own, ``flatshard-loopback``, registered through
torch's public ``rendezvous_handler_registry``: one node, no peers to wait for, and one TCPStore on a
socket bound to 127.0.0.1, shared by the agent and the ranks (``use_agent_store``; the agent's keys
under a prefix). Each round of the rendezvous -- the first start, and each restart under ``max_restarts``
-- gets a fresh store, as torchrun's own c10d rendezvous does: the ranks of a restart must not read
the keys of the ranks they replace (their process group's addresses). The ranks' gloo and NCCL sockets
are put on the loopback interface. Ranks started
without torchrun (big_model.py) are clients of ``loopback_store()``, hosted by their launcher.
tests/test_example.py reads the socket table during a run and finds no listener of the job elsewhere.

[Note: process groups at exit]
A rank that returns from its work and exits can abort afterwards ("terminate called without an active
exception", SIGABRT, torchrun's exitcode -6). A core dump shows where: a gloo worker thread
(``ProcessGroupGloo::runLoop``) destroys a barrier's work it has finished, which drops the last
reference to an earlier all-gather's output tensors, whose Python objects need the GIL; the main
thread is in ``Py_FinalizeEx`` by then, so taking the GIL ends the thread (``PyThread_exit_thread``),
and the forced unwind through a destructor calls std::terminate (pytorch/pytorch#179291 is the same
mechanism). ``destroy_process_group`` does not stop gloo's threads (gloo has no shutdown); destroying
the group does, and joins them. So a group alive when the interpreter finalizes is the risk: above
all one destroyed during finalization (its threads then release their last works at once), or one
whose worker is descheduled across the start of finalization on a loaded machine.
A wrapped model holds its groups (units, order checks, run context) and is not freed by reference
counting: its module hooks and units refer to each other (cycles a collection frees), and each unit's
post-accumulate-grad hook, kept in the unsharded flat's C++ autograd metadata, refers to its unit only
weakly ([Note: hooks hold units weakly] in flatshard's runtime/hooks.py), so a collection frees it all.
The launchers' ranks end with ``gc.collect()`` after ``main()`` returns, before ``sys.exit``: with the
model collectable, that destroys the groups and joins gloo's threads while the interpreter can still
hand them the GIL, instead of during finalization.
"""

from __future__ import annotations

import contextlib
import os
import socket
from datetime import timedelta

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import (
    RendezvousClosedError,
    RendezvousHandler,
    RendezvousInfo,
    RendezvousParameters,
    RendezvousStoreInfo,
    rendezvous_handler_registry,
)

LOOPBACK = "127.0.0.1"
BACKEND = "flatshard-loopback"
STORE_TIMEOUT = timedelta(minutes=5)  # TCPStore's own default: how long a client waits for a key


def loopback_store(timeout: timedelta = STORE_TIMEOUT) -> tuple[dist.TCPStore, int]:
    """A TCPStore server listening on 127.0.0.1 only, and its port (chosen by the kernel, so no race)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind((LOOPBACK, 0))
    sock.listen(socket.SOMAXCONN)
    port = sock.getsockname()[1]
    # detach(): the store owns the descriptor from here on; were it closed under the store's daemon,
    # the daemon would abort the process ("Unexpected poll revent on the master's listening socket").
    fd = sock.detach()
    store = dist.TCPStore(LOOPBACK, port, is_master=True, master_listen_fd=fd, wait_for_workers=False, timeout=timeout)
    return store, port


class LoopbackRendezvous(RendezvousHandler):
    """A one-node rendezvous whose store listens on 127.0.0.1 only (see the module's Note)."""

    def __init__(self, params: RendezvousParameters):
        if params.max_nodes != 1:
            raise ValueError(f"the {BACKEND} rendezvous is for one node; got --nnodes up to {params.max_nodes}")
        self._run_id = params.run_id
        self._stores: list[dist.TCPStore] = []  # one per round; kept until the launch ends
        self._closed = False

    def get_backend(self) -> str:
        return BACKEND

    @property
    def use_agent_store(self) -> bool:
        return True  # the ranks connect to our store (MASTER_ADDR/MASTER_PORT) instead of hosting one

    def next_rendezvous(self) -> RendezvousInfo:
        if self._closed:
            raise RendezvousClosedError(f"the {BACKEND} rendezvous of run {self._run_id} is closed")
        store, port = loopback_store()  # a fresh store each round: a restart reads no key of the ranks it replaces
        self._stores.append(store)
        agent = dist.PrefixStore(f"torchelastic/{self._run_id}/", store)
        return RendezvousInfo(agent, 0, 1, RendezvousStoreInfo(LOOPBACK, port))

    def is_closed(self) -> bool:
        return self._closed

    def set_closed(self) -> None:
        self._closed = True

    def num_nodes_waiting(self) -> int:
        return 0  # one node: nobody else ever joins

    def get_run_id(self) -> str:
        return self._run_id

    def shutdown(self) -> bool:
        self._closed = True
        return True


def _create_handler(params: RendezvousParameters) -> RendezvousHandler:
    return LoopbackRendezvous(params)


def loopback_interface() -> str:
    """The name of the loopback interface (``lo`` on Linux, ``lo0`` on macOS and the BSDs)."""
    names = {name for _, name in socket.if_nameindex()}
    return "lo" if "lo" in names or "lo0" not in names else "lo0"


def loopback_env() -> dict[str, str]:
    """What the ranks' environment needs for gloo and NCCL to listen on the loopback interface only. It
    replaces any interface set for multi-node runs: every rank of a local launch is on this machine."""
    lo = loopback_interface()
    return {"GLOO_SOCKET_IFNAME": lo, "NCCL_SOCKET_IFNAME": lo}


@contextlib.contextmanager
def _environ(values: dict[str, str]):
    before = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def run_local(nproc: int, script: str, script_args: list[str], max_restarts: int = 0, module: bool = False) -> None:
    """Run ``script`` on ``nproc`` local ranks through torchrun's machinery, every socket on loopback.
    After a rank fails, every rank is stopped and all are started again, up to ``max_restarts`` times
    (torchrun's ``--max-restarts``; the ranks see ``TORCHELASTIC_RESTART_COUNT``). With ``module=True``
    ``script`` is a module name that each rank runs as ``python -m script`` (torchrun's ``--module``),
    from this process's working directory.

    Raises torch's ChildFailedError when a rank fails with no restart left (torchrun has printed which
    and why)."""
    from torch.distributed import run as torchrun

    rendezvous_handler_registry.register(BACKEND, _create_handler)  # again with the same creator: a no-op
    parser = torchrun.get_args_parser()
    parser.allow_abbrev = False  # else torchrun reads a script's --nproc as an abbreviation of its --nproc-per-node
    launch = parser.parse_args(
        [
            f"--rdzv-backend={BACKEND}",
            f"--rdzv-endpoint={LOOPBACK}:0",
            "--nnodes=1",
            f"--nproc-per-node={nproc}",
            f"--max-restarts={max_restarts}",
            *(["--module"] if module else []),
            script,
            *script_args,
        ]
    )
    with _environ(loopback_env()):
        torchrun.run(launch)
