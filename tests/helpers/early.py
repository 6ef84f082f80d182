"""Launches that start as soon as collection ends, for tests that mostly wait on them.

A run that waits out a collective timeout and then torchrun's 30 s grace period before its restart is
idle for most of a minute. Started with the session, that wait passes while the tests before the one
that checks the run do their work. A test module registers such a launch at import under the name of
the fixture that hands it out (``register``); tests/conftest.py starts the launches whose fixture a
collected test uses (``start_for``; nothing under --collect-only) and stops whatever is left at the end
of the session (``stop_all``); the fixture takes its launch (``take``), started then if nothing had
started it."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_REGISTERED: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}  # fixture -> (start, stop)
_STARTED: dict[str, Any] = {}


def register(fixture: str, start: Callable[[], Any], stop: Callable[[Any], None]) -> None:
    """``start()`` launches and returns a handle; ``stop(handle)`` ends it if it still runs and removes
    what it left."""
    _REGISTERED[fixture] = (start, stop)


def start_for(items) -> None:
    used = {name for item in items for name in getattr(item, "fixturenames", ())}
    for fixture, (start, _) in _REGISTERED.items():
        if fixture in used and fixture not in _STARTED:
            _STARTED[fixture] = start()


def take(fixture: str) -> Any:
    """The handle of the launch started for ``fixture``, or of one started now; the caller stops it."""
    handle = _STARTED.pop(fixture, None)
    return handle if handle is not None else _REGISTERED[fixture][0]()


def stop(fixture: str, handle: Any) -> None:
    _REGISTERED[fixture][1](handle)


def stop_all() -> None:
    while _STARTED:
        fixture, handle = _STARTED.popitem()
        stop(fixture, handle)
