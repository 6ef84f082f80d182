"""Replica groups that drop out and rejoin: fault-tolerant HYBRID_SHARD / NO_SHARD on torchft.

    model = FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, ...)   # over this group's ranks
    manager = ft.Manager(model, optim, lighthouse_addr=..., replica_id="group3", hostname=...)
    optimizer = ft.Optimizer(manager, optim)   # zero_grad(): the quorum; step(): reduce, commit, step

How it works. A job is R replica groups of F ranks. Inside a group, flatshard shards as it always
does (the model is wrapped over the group's own ranks: FULL_SHARD for F > 1, NO_SHARD for F = 1); each
group is its own torchrun job with ``--max-restarts`` (and ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``),
so a rank that dies takes down and restarts only its group.
Across groups nothing is static: torchft's Lighthouse forms a quorum of the groups alive at each step,
torchft's Manager rebuilds a gloo group over them when the membership changes, and this module adds
the two flatshard-specific pieces:

* the gradient: after backward, each rank's grad shards are averaged over the replicas in the quorum
  (``manager.allreduce``: summed over the groups' rank k, divided by how many take part), in buckets
  of at most ``bucket_bytes``. Rank k of every group holds the same shard of every unit (the groups
  are built alike), so the sum is the sum of one shard. A step whose all-reduce fails (a peer died) is
  not committed anywhere: ``manager.should_commit()`` is false in every group, the optimizer does not
  step, and the next step's quorum leaves the dead group out;
* the state a restarted group takes from a healthy one: rank k of the healthy group serves its flat
  shard views, buffers and optimizer state (``state_dict``), and rank k of the joining group loads them
  in place (``load_state_dict``) before the optimizer step of the step it joins. torchft moves them
  over HTTP, memory to memory; nothing is written to disk. From that step on, both groups apply the
  same averaged gradient to the same bits, so every replica holds bitwise the same parameters and
  optimizer state (gloo's all-reduce hands every rank the same sum, and the division is the same).

A group that joins at step s computes a throw-away forward and backward at s (its gradient is zeroed,
it is not yet in the state), takes the state of step s and steps with the others: it misses the steps
between its death and s, and its batches of those steps are not trained on by anyone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable, Iterator, Mapping
from datetime import timedelta
from typing import Any, Optional

import torch
from torch import nn

try:
    import torchft
    from torchft._torchft import LighthouseServer
    from torchft.checkpointing.http_transport import HTTPTransport
    from torchft.manager import Manager as _TorchftManager
    from torchft.manager import WorldSizeMode
    from torchft.process_group import ProcessGroupGloo
except ImportError as exc:  # the optional dependency
    raise ImportError(
        "flatshard.ft needs torchft (replica groups that drop out and rejoin): pip install 'flatshard[ft]' "
        "(torchft>=0.2, which keeps the torch already installed when given --no-deps: "
        "pip install --no-deps torchft && pip install opentelemetry-sdk opentelemetry-exporter-otlp-proto-http)"
    ) from exc

__all__ = [
    "Lighthouse",
    "Manager",
    "Optimizer",
    "ProcessGroupGloo",
    "WorldSizeMode",
    "allreduce_gradients",
    "load_state_dict",
    "state_dict",
]

DEFAULT_BUCKET_BYTES = 25 * 2**20  # DDP's bucket_cap_mb


def Lighthouse(
    bind: str = "[::]:29510",
    min_replicas: int = 1,
    *,
    join_timeout_ms: int = 1000,
    quorum_tick_ms: int = 50,
    heartbeat_timeout_ms: int = 1000,
) -> LighthouseServer:
    """torchft's Lighthouse (the one process that forms each step's quorum), started in this process;
    ``.address()`` is what every group's ``Manager(lighthouse_addr=...)`` is given, ``.shutdown()``
    stops it. The timeouts are shorter than torchft's defaults (60 s to wait for a group that
    heartbeats but has not asked to join; 5 s without a heartbeat before a group is dead), so a
    healthy group waits at most about ``heartbeat_timeout_ms`` for a dead one to be dropped and
    ``join_timeout_ms`` for a restarted one to be let in."""
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


class _HTTPTransport(HTTPTransport):
    """torchft's HTTP checkpoint transport, advertising ``hostname`` instead of ``socket.gethostname()``
    (inside a network namespace, or on a machine whose hostname resolves to loopback, the peers could not
    reach the latter)."""

    def __init__(self, timeout: timedelta, hostname: str) -> None:
        self._hostname = hostname  # before torchft's __init__, which logs address()
        super().__init__(timeout=timeout, num_chunks=0)

    def address(self) -> str:
        port = self._server.socket.getsockname()[1]
        host = f"[{self._hostname}]" if ":" in self._hostname else self._hostname
        return f"http://{host}:{port}/checkpoint/"


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's (fully_shard's parameters and gradients) local shard; any other tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


class _Tensors:
    """The model's parameters (as the optimizer sees them: flat shard views, or fully_shard's DTensors)
    and buffers, by name, taken once when the Manager is built. torchft asks for the state from its
    quorum thread while the training thread runs forward, and during forward flatshard sets compute
    views on the modules in place of the registered parameters, so ``named_parameters()`` asked then
    would miss the units that are computing; the shard views themselves live as long as the model."""

    def __init__(self, model: nn.Module) -> None:
        self.parameters = dict(model.named_parameters())
        self.buffers = dict(model.named_buffers())


def state_dict(model: nn.Module | _Tensors, optimizer: Optional[torch.optim.Optimizer]) -> dict[str, Any]:
    """What rank k of a healthy group sends to rank k of a joining one: this rank's parameters as the
    optimizer sees them (flat shard views, or fully_shard's local shards), the buffers, and the
    optimizer's state. The tensors are the live ones, not copies: torchft serves them before this step's
    optimizer step and blocks that step until the transfer is done."""
    tensors = model if isinstance(model, _Tensors) else _Tensors(model)
    return {
        "parameters": {name: _local(p).detach() for name, p in tensors.parameters.items()},
        "buffers": dict(tensors.buffers),
        "optimizer": optimizer.state_dict() if optimizer is not None else {},
    }


def load_state_dict(
    model: nn.Module | _Tensors, optimizer: Optional[torch.optim.Optimizer], state: dict[str, Any]
) -> None:
    """Rank k of a joining group takes rank k of a healthy group's ``state_dict``, in place: the
    parameters are written into the flat shards (the optimizer keeps its tensors), the optimizer state
    is replaced. Raises ValueError naming the first parameter that differs when the groups were not
    built alike (another model, F or wrap policy)."""
    tensors = model if isinstance(model, _Tensors) else _Tensors(model)
    _check_same(tensors.parameters, state["parameters"], "parameters")
    _check_same(tensors.buffers, state["buffers"], "buffers")
    with torch.no_grad():
        for name, p in tensors.parameters.items():
            _local(p).copy_(state["parameters"][name])
        for name, b in tensors.buffers.items():
            b.copy_(state["buffers"][name])
    if optimizer is not None:
        optimizer.load_state_dict(state["optimizer"])


def _check_same(mine: Mapping[str, torch.Tensor], theirs: Mapping[str, torch.Tensor], what: str) -> None:
    for name in sorted(set(mine) | set(theirs)):
        a, b = mine.get(name), theirs.get(name)
        shape_a = None if a is None else tuple(_local(a).shape)
        shape_b = None if b is None else tuple(b.shape)
        if shape_a != shape_b:
            raise ValueError(
                f"the healthy replica's {what} do not match this one's at {name!r}: here {shape_a}, sent "
                f"{shape_b} (None: missing). Every replica group must build the same model with the same "
                "sharding (strategy, group size F, wrap policy) so that its rank k holds the same shards."
            )


def _buckets(grads: list[torch.Tensor], bucket_bytes: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for g in grads:
        nbytes = g.numel() * g.element_size()
        if bucket and (size + nbytes > bucket_bytes or g.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(g)
        size += nbytes
    if bucket:
        yield bucket


def allreduce_gradients(
    manager: _TorchftManager, parameters: Iterable[torch.Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES
) -> None:
    """Average this rank's gradients over the replica groups in this step's quorum, in place. Call it
    once per step, after backward (flatshard has reduced over the group) and before anything reads the
    gradients (``clip_grad_norm_``, the optimizer); ``Optimizer.step`` calls it when the step has not.
    A parameter with no gradient takes part as zeros and gets the average as its gradient, so every
    group sends the same buckets. One all-reduce per bucket of at most ``bucket_bytes``, all in flight
    at once; a failed one is reported to the manager (``should_commit`` is then false) and raises
    nothing here."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be positive; got {bucket_bytes}")
    params = [p for p in parameters if p.requires_grad and _local(p).numel() > 0]
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(_local(p.grad))
    pending = []
    for bucket in _buckets(grads, bucket_bytes):
        flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
        pending.append((bucket, flat, manager.allreduce(flat)))
    for bucket, flat, work in pending:
        work.wait()  # torchft divides by the participants in the work's callback
        with torch.no_grad():
            for g, piece in zip(bucket, torch.split(flat, [g.numel() for g in bucket])):
                g.copy_(piece.view_as(g))


def _check_torchrun_store() -> None:
    """A group restarted by torchrun must not share the store of its previous attempt."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and int(os.environ.get("TORCHELASTIC_MAX_RESTARTS", 0)):
        raise RuntimeError(
            "flatshard.ft.Manager under torchrun --max-restarts needs a fresh store for every restart: with "
            "torchrun's shared store (TORCHELASTIC_USE_AGENT_STORE=True) the restarted ranks read the keys the "
            "killed attempt left there (torchft's manager address, gloo's peer addresses) and fail to connect "
            "or hang. Start torchrun with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 in its environment."
        )


class Manager(_TorchftManager):
    """torchft's Manager for a flatshard model: one per rank, in every replica group.

    ``Manager(model, optimizer, min_replica_size=1, lighthouse_addr=..., replica_id=..., hostname=...)``
    builds torchft's Manager with a fault-tolerant gloo group across the replica groups, registers this
    rank's model and optimizer state for live recovery (``state_dict`` / ``load_state_dict`` above, under
    the key ``"flatshard"``; ``register_state_dict_fn`` adds more, e.g. a data loader's position) and
    an HTTP transport that advertises ``hostname``. Every other keyword is torchft's (``timeout``,
    ``quorum_timeout``, ``use_async_quorum``, ``world_size_mode``, ``init_sync``, ``store_addr``/
    ``store_port``, ``rank``/``world_size`` of this rank in its group; torchrun's environment by
    default). ``replica_id`` names the group (the same on its ranks, and across its restarts).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Optional[torch.optim.Optimizer],
        *,
        min_replica_size: int = 1,
        hostname: Optional[str] = None,
        timeout: timedelta = timedelta(seconds=30),
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        pg: Optional[Any] = None,
        **torchft_kwargs: Any,
    ) -> None:
        if "load_state_dict" in torchft_kwargs or "state_dict" in torchft_kwargs:
            raise TypeError(
                "flatshard.ft.Manager registers the model's and optimizer's state itself; pass more state "
                "with manager.register_state_dict_fn(key, load_fn, state_fn) after construction"
            )
        _check_torchrun_store()
        if min_replica_size < 1:
            raise ValueError(f"min_replica_size must be at least 1; got {min_replica_size}")
        hostname = hostname or socket.gethostname()
        self.model, self.optimizer, self.bucket_bytes = model, optimizer, bucket_bytes
        super().__init__(
            pg=pg if pg is not None else ProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replica_size,
            timeout=timeout,
            hostname=hostname,
            checkpoint_transport=torchft_kwargs.pop("checkpoint_transport", None) or _HTTPTransport(timeout, hostname),
            **torchft_kwargs,
        )
        self._tensors = tensors = _Tensors(model)  # now, not from torchft's thread during forward (see _Tensors)
        self.register_state_dict_fn(
            "flatshard",
            lambda state: load_state_dict(tensors, self.optimizer, state),
            lambda: state_dict(tensors, self.optimizer),
        )
        self.gradients_reduced = False  # set by allreduce_gradients through Optimizer, per step

    def allreduce_gradients(self, parameters: Optional[Iterable[torch.Tensor]] = None) -> None:
        """``allreduce_gradients`` over ``parameters`` (default: the model's), once per step."""
        params = self._tensors.parameters.values() if parameters is None else parameters
        allreduce_gradients(self, params, self.bucket_bytes)
        self.gradients_reduced = True


class Optimizer(torchft.Optimizer):
    """torchft's OptimizerWrapper for a flatshard model: ``zero_grad()`` starts this step's quorum;
    ``step()`` averages the gradients over the replica groups in it (unless
    ``manager.allreduce_gradients()`` already did this step, e.g. before clipping), then steps the
    wrapped optimizer only if ``manager.should_commit()``: every group of the quorum commits the step,
    or none does. ``step`` returns whether it committed."""

    def __init__(self, manager: Manager, optim: torch.optim.Optimizer) -> None:
        if not isinstance(manager, Manager):
            raise TypeError(
                f"flatshard.ft.Optimizer needs a flatshard.ft.Manager (it reduces the gradients through it); got "
                f"{type(manager).__name__}"
            )
        super().__init__(manager, optim)

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.manager.gradients_reduced = False
        super().zero_grad(set_to_none)

    def step(self, closure: Optional[object] = None) -> bool:
        if closure is not None:
            raise ValueError("flatshard.ft.Optimizer.step takes no closure (torchft's does not either)")
        if not self.manager.gradients_reduced:
            self.manager.allreduce_gradients(p for group in self.optim.param_groups for p in group["params"])
        self.manager.gradients_reduced = False
        if self.manager.should_commit():
            self.optim.step()
            return True
        return False
