"""pytest plugin for the conformance runs (copied beside the generated tests as ``conftest.py``).

Each test's outcome goes to ``$CONFORMANCE_LOG`` as one JSON line the moment it is known, and a test
that runs past ``$CONFORMANCE_TIMEOUT`` seconds ends the process (faulthandler prints where it hung):
run.py then records that test as failed by timeout and starts the rest anew. A hang is a failure,
never a wait.
"""

from __future__ import annotations

import faulthandler
import json
import os

_LOG = os.environ.get("CONFORMANCE_LOG")
_TIMEOUT = float(os.environ.get("CONFORMANCE_TIMEOUT", "0"))


def _write(record: dict) -> None:
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(record) + "\n")


def pytest_runtest_logstart(nodeid, location):  # noqa: ARG001 - pytest's hook signature
    _write({"id": nodeid, "event": "start"})
    if _TIMEOUT:
        faulthandler.dump_traceback_later(_TIMEOUT, exit=True)


def pytest_runtest_logfinish(nodeid, location):  # noqa: ARG001
    if _TIMEOUT:
        faulthandler.cancel_dump_traceback_later()


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":
        error = ""
        if report.failed:
            error = _short_error(report.longreprtext)
        elif report.skipped and isinstance(report.longrepr, tuple):
            error = str(report.longrepr[2])[:300]
        _write({"id": report.nodeid, "event": report.when, "outcome": report.outcome, "error": error})


def _short_error(text: str) -> str:
    """The exception lines of a failure (``E   ...``), or its last line: what a reader needs first."""
    lines = [line[4:].strip() for line in text.splitlines() if line.startswith("E   ")]
    picked = [line for line in lines if "Error" in line or "Exception" in line] or lines
    if not picked:
        picked = [line for line in text.splitlines() if line.strip()][-1:]
    return " | ".join(dict.fromkeys(picked))[:500]
