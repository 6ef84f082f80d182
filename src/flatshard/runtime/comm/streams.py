"""The device's streams, as FSDP orders work on an accelerator, behind one small interface.

[Note: stream discipline]
On an accelerator a unit's all-gather runs on a *gather* stream and its reductions on a *reduce* stream,
so both overlap the *compute* stream (the current stream: forward, backward, the optimizer). Work on
different streams is ordered by events alone (``record`` on one stream, ``wait`` on another), never by
``record_stream``; every buffer is allocated and freed on the compute stream, so the caching allocator,
which reuses a freed block in the order of the stream it belongs to, never hands a collective's buffer
to another stream's work early. The rules (runtime/unit.py and reduce.py follow them):
* gather: the gather stream waits for an event the compute stream records after the flat shard was last
  written (the optimizer, a load), then runs the all-gather into a buffer compute allocated, and records
  the gather's event;
* use: compute waits for the gather's event before it reads the gathered parameters (the copy-out of a
  rank-major gather included), so every read of a gathered buffer is after its gather;
* free: a buffer is freed by compute, after compute waited for the event of every other stream that used
  it (a gather never read still has its event waited for before its buffer goes);
* reduce: the reduce stream waits for an event compute records once the gradient (or its reduce-dtype
  copy) is written, runs the reduce-scatter and the all-reduce across replicas into a shard compute
  allocated, and records its event; compute waits for it before it divides and exposes the shard, and
  only then drops what the reduction read;
* prefetch: a gather is issued ahead only while fewer than two units besides the root hold gathered
  parameters (``limit_all_gathers``), counted from the buffers allocated and not yet freed.
Where the device has no streams (CPU, gloo) ``Streams`` makes every call a no-op and the collectives'
own ``Work.wait`` orders them. ``RecordingStreams`` logs every call instead, so a test runs a whole step on
CPU and checks its happens-before order (``check_schedule``: tests/test_streams.py); ``DeviceStreams``
runs the same calls on ``torch.Stream`` / ``torch.Event``.
"""

from __future__ import annotations

import contextlib
import enum
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Optional

import torch


class Lane(str, enum.Enum):
    """Which stream a piece of work runs on."""

    COMPUTE = "compute"
    GATHER = "gather"
    REDUCE = "reduce"

    def __str__(self) -> str:
        return self.value


class Streams:
    """No streams (CPU): every call does nothing; collectives order themselves by ``Work.wait``."""

    host_ordered = True  # collectives may run asynchronously with the host and be waited for (gloo's Work)

    def record(self, lane: Lane) -> Any:  # noqa: ARG002 - no streams, no events
        """An event marking everything issued on ``lane`` so far."""
        return None

    def wait(self, lane: Lane, event: Any) -> None:
        """Work issued on ``lane`` from now on runs after ``event``."""

    def on(self, lane: Lane) -> contextlib.AbstractContextManager:  # noqa: ARG002 - no streams
        """Issue the work of the block on ``lane``."""
        return contextlib.nullcontext()

    def use(self, lane: Lane, buffer: torch.Tensor, access: str, what: str) -> None:
        """``lane`` allocates, writes, reads or frees ``buffer`` (``access``); ``what`` names it in the log."""

    def order(self, producer: Lane, consumer: Lane) -> None:
        """``consumer`` waits for everything issued on ``producer`` so far."""
        if producer is not consumer:
            self.wait(consumer, self.record(producer))


class DeviceStreams(Streams):
    """The accelerator's streams: compute is the current stream, gather and reduce two of their own."""

    host_ordered = False  # collectives are issued in order on their stream; the host never waits

    def __init__(self, device: torch.device):
        self.device = device
        self._streams = {
            Lane.COMPUTE: None,  # the current stream when the work is issued
            Lane.GATHER: torch.Stream(device=device),
            Lane.REDUCE: torch.Stream(device=device),
        }

    def _stream(self, lane: Lane):
        stream = self._streams[lane]
        return torch.accelerator.current_stream(self.device) if stream is None else stream

    def record(self, lane: Lane) -> Any:
        return self._stream(lane).record_event()

    def wait(self, lane: Lane, event: Any) -> None:
        if event is not None:
            self._stream(lane).wait_event(event)

    @contextlib.contextmanager
    def on(self, lane: Lane) -> Iterator[None]:
        if lane is Lane.COMPUTE:
            yield
            return
        previous = torch.accelerator.current_stream(self.device)
        torch.accelerator.set_stream(self._stream(lane))
        try:
            yield
        finally:
            torch.accelerator.set_stream(previous)


def for_device(device: torch.device) -> Streams:
    """The streams of a run context computing on ``device``: the accelerator's, or none (CPU)."""
    if device.type == "cpu":
        return Streams()
    return DeviceStreams(device)


# ---- the recording stand-in, and the check of what it recorded --------------------------------------------
@dataclass
class Op:
    index: int
    lane: Lane
    kind: str  # "record", "wait", or a buffer access: "alloc", "write", "read", "free"
    event: Optional[int] = None  # record: the event made; wait: the event waited for
    buffer: Optional[int] = None  # the storage's identity (accesses)
    what: str = ""
    clock: dict = field(default_factory=dict)  # the vector clock after the op: lane -> ops of it before


class RecordingStreams(Streams):
    """Logs every record, wait and buffer access, with each lane's vector clock, as a device would order
    them; ``check_schedule(self.ops)`` checks the order."""

    def __init__(self):
        self.ops: list[Op] = []
        self._clocks: dict[Lane, dict[Lane, int]] = {lane: dict.fromkeys(Lane, 0) for lane in Lane}
        self._events: dict[int, dict[Lane, int]] = {}

    def _log(self, lane: Lane, kind: str, **kw) -> Op:
        clock = self._clocks[lane]
        clock[lane] += 1
        op = Op(len(self.ops), lane, kind, clock=dict(clock), **kw)
        self.ops.append(op)
        return op

    def record(self, lane: Lane) -> Any:
        event = len(self._events)
        op = self._log(lane, "record", event=event)
        self._events[event] = op.clock
        return event

    def wait(self, lane: Lane, event: Any) -> None:
        if event is None:
            return
        seen = self._events.get(event, {})
        clock = self._clocks[lane]
        for other, n in seen.items():
            clock[other] = max(clock[other], n)
        self._log(lane, "wait", event=event if event in self._events else -1 - event)

    def use(self, lane: Lane, buffer: torch.Tensor, access: str, what: str) -> None:
        self._log(lane, access, buffer=id(buffer.untyped_storage()), what=what)


def happens_before(a: Op, b: Op) -> bool:
    """Whether ``a`` is ordered before ``b`` on the device: in ``b``'s history through ``a``'s lane."""
    return a.index < b.index and b.clock[a.lane] >= a.clock[a.lane]


def check_schedule(ops: list[Op], *, max_gathered: Optional[int] = None) -> list[str]:
    """Every violation of [Note: stream discipline] in a recorded log, as sentences (empty: none): an
    access not ordered after another lane's earlier write of the same buffer (a read before its gather,
    a reduction before its gradient), a write not ordered after another lane's earlier reads, a free not
    ordered after every use since the allocation, an allocation or a free off the compute stream, a wait
    for an event never recorded; and, with ``max_gathered``, a prefetch that leaves more than that many
    units besides the root holding gathered parameters. A buffer never allocated in the log (a flat
    shard) lives throughout."""
    problems: list[str] = []
    live: dict[int, list[Op]] = {}  # buffer -> its accesses since its allocation
    gathered: set[int] = set()  # buffers of units' gathered parameters, the root's aside, now allocated
    for op in ops:
        if op.kind == "wait" and op.event is not None and op.event < 0:
            problems.append(f"op {op.index}: {op.lane} waits for an event that was never recorded")
        if op.buffer is None:
            continue
        if op.kind in ("alloc", "free") and op.lane is not Lane.COMPUTE:
            problems.append(f"op {op.index}: {op.what} {op.kind}ed on the {op.lane} stream, not compute")
        if op.kind == "alloc":
            live[op.buffer] = [op]
            if op.what.startswith("gathered ") and "(root)" not in op.what:
                gathered.add(op.buffer)
                if max_gathered is not None and "(prefetch)" in op.what and len(gathered) > max_gathered:
                    problems.append(
                        f"op {op.index}: a prefetch leaves {len(gathered)} units gathered (limit {max_gathered})"
                    )
            continue
        history = live.setdefault(op.buffer, [])
        for earlier in history:
            if earlier.lane is op.lane:
                continue
            conflict = op.kind in ("write", "free") or earlier.kind in ("write", "alloc")
            if conflict and not happens_before(earlier, op):
                problems.append(
                    f"op {op.index}: {op.lane} {op.kind}s {op.what} with no wait after {earlier.lane}'s "
                    f"{earlier.kind} (op {earlier.index})"
                )
        if op.kind == "free":
            del live[op.buffer]
            gathered.discard(op.buffer)
        else:
            history.append(op)
    return problems


def without_wait(ops: list[Op], index: Optional[int]) -> list[Op]:
    """The log ``ops`` as a device would order it had the wait at ``index`` never been issued: the other
    ops unchanged, renumbered, their vector clocks computed again (``None``: nothing removed, the clocks
    as recorded). The host issues the same calls whichever waits the streams keep, so this is the log a
    run whose schedule lacked that wait would record (tests/test_streams.py removes each wait in turn)."""
    if index is not None and ops[index].kind != "wait":
        raise ValueError(f"op {index} is a {ops[index].kind}, not a wait")
    clocks: dict[Lane, dict[Lane, int]] = {lane: dict.fromkeys(Lane, 0) for lane in Lane}
    events: dict[int, dict[Lane, int]] = {}
    out: list[Op] = []
    for op in ops:
        if op.index == index:
            continue
        clock = clocks[op.lane]
        if op.kind == "wait" and op.event is not None:
            for other, n in events.get(op.event, {}).items():
                clock[other] = max(clock[other], n)
        clock[op.lane] += 1
        new = Op(len(out), op.lane, op.kind, op.event, op.buffer, op.what, dict(clock))
        if op.kind == "record" and op.event is not None:
            events[op.event] = new.clock
        out.append(new)
    return out


def orders_no_access(ops: list[Op], index: int) -> bool:
    """Whether removing the wait at ``index`` leaves every two accesses to one buffer from different lanes
    in the order they had: the order that wait gives is also given by others (a second wait for the same
    event, or a later wait for a later event of the same lane before any access that needed it)."""
    rebuilt = iter(without_wait(ops, index))
    pairs = [(op, next(rebuilt)) for op in ops if op.index != index]  # (as recorded, as rebuilt)
    by_buffer: dict[int, list[tuple[Op, Op]]] = {}
    for pair in pairs:
        if pair[0].buffer is not None:
            by_buffer.setdefault(pair[0].buffer, []).append(pair)
    for accesses in by_buffer.values():
        for i, (b, b2) in enumerate(accesses):
            for a, a2 in accesses[:i]:
                if a.lane is not b.lane and happens_before(a, b) != happens_before(a2, b2):
                    return False
    return True
