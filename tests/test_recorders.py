"""The recorders stay bounded ([Note: bounded recorders]): by default a CommRecorder keeps totals per
(phase, kind, group) and a MemoryRecorder its current and peak bytes, however many collectives and
samples pass through them; the event list and the timeline are opt-in, and reading one that was not
asked for is an error saying how to ask for it. In-process, on the recorders themselves."""

from __future__ import annotations

import inspect

import pytest
import torch

from flatshard import FullyShardedDataParallel as FSDP
from flatshard.runtime.instrument import CommEvent, CommRecorder, MemoryRecorder

EVENTS = [
    CommEvent("all_gather", "shard", 2, "forward", "<root>", 400, 200.0),
    CommEvent("all_gather", "shard", 2, "forward", "blocks.0", 40, 20.0),
    CommEvent("all_gather", "shard", 2, "backward", "blocks.0", 40, 20.0),
    CommEvent("reduce_scatter", "shard", 2, "backward", "blocks.0", 40, 20.0),
    CommEvent("all_reduce", "replicate", 3, "backward", "blocks.0", 8, 10.5),
]


def _fill(rec: CommRecorder, times: int) -> None:
    for _ in range(times):
        for e in EVENTS:
            rec.record(e)


def test_totals_are_the_same_with_and_without_the_event_list():
    lean, full = CommRecorder(), CommRecorder(events=True)
    _fill(lean, 3)
    _fill(full, 3)
    assert len(full.events) == 3 * len(EVENTS)
    for kind, phase, group in [
        (None, None, None),
        ("all_gather", None, None),
        ("all_gather", "forward", None),
        (None, "backward", "shard"),
        ("all_reduce", None, "replicate"),
        ("broadcast", None, None),
    ]:
        from_events = [
            e for e in full.events if kind in (None, e.kind) and phase in (None, e.phase) and group in (None, e.group)
        ]
        assert lean.count(kind, phase, group) == len(from_events)
        assert lean.tensor_bytes(kind, phase, group) == sum(e.tensor_bytes for e in from_events)
        assert lean.wire_bytes(kind, phase, group) == pytest.approx(sum(e.wire_bytes for e in from_events))
    assert lean.summary() == full.summary()
    assert lean.summary()["forward/all_gather/shard"] == {"count": 6, "tensor_bytes": 1320, "wire_bytes": 660.0}


def test_the_default_comm_recorder_keeps_no_events_and_says_how_to():
    rec = CommRecorder()
    _fill(rec, 1000)
    assert len(rec._totals) == 4  # one row per (phase, kind, group), not one per collective
    assert rec._events == []
    with pytest.raises(RuntimeError, match=r"record_comms\(events=True\)"):
        _ = rec.events
    rec.reset()
    assert rec.count() == 0 and rec.summary() == {}


def test_the_default_memory_recorder_keeps_no_timeline():
    p = torch.nn.Parameter(torch.zeros(10))
    lean = MemoryRecorder([], extra_params=[p])
    full = MemoryRecorder([], extra_params=[p], timeline=True)
    for _ in range(50):
        lean.sample()
        full.sample()
    assert lean.peak == full.peak and lean.peak["params"] == 40 and lean.peak_total == 40
    assert len(full.timeline) == 50 and full.timeline[-1][1]["params"] == 40
    assert lean._timeline == []
    with pytest.raises(RuntimeError, match=r"record_memory\(optimizer, timeline=True\)"):
        _ = lean.timeline
    with pytest.raises(RuntimeError, match="timeline=True"):
        lean.reset_timeline()
    full.reset_timeline()
    assert full.timeline == []


def test_the_front_end_takes_the_opt_ins_as_keywords():
    comms = inspect.signature(FSDP.record_comms).parameters
    memory = inspect.signature(FSDP.record_memory).parameters
    assert comms["events"].kind is inspect.Parameter.KEYWORD_ONLY and comms["events"].default is False
    assert memory["timeline"].kind is inspect.Parameter.KEYWORD_ONLY and memory["timeline"].default is False
