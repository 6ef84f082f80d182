"""Session hooks: the launches that collected tests mostly wait on start when collection ends, and what
is left of them stops with the session (tests/helpers/early.py)."""

from __future__ import annotations

from tests.helpers import early


def pytest_collection_finish(session) -> None:
    if not session.config.option.collectonly:
        early.start_for(session.items)


def pytest_sessionfinish(session, exitstatus) -> None:
    early.stop_all()
