"""The conformance differences docs/concepts/differences.md lists, read by run.py and test_conformance.py.

In that page (README.md names it), the first list after the paragraph that begins
with ``MARKER`` holds one bullet per reason: ``- <reason> Tests: `<test id>`, `<test id>` ...``; the list
ends at the first line that is neither a bullet nor its continuation.
"""

from __future__ import annotations

import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent.parent / "docs" / "concepts" / "differences.md"
MARKER = "PyTorch's own FSDP2 tests (`test/distributed/_composable/fsdp/`"


def listed_differences(readme: Path = README) -> dict[str, str]:
    """test id -> the reason README gives."""
    text = readme.read_text()
    start = text.find(MARKER)
    if start < 0:
        return {}
    bullets, current = [], None
    for line in text[start:].splitlines()[1:]:
        if line.startswith("- "):
            current = [line[2:]]
            bullets.append(current)
        elif current is not None and line.startswith("  ") and line.strip():
            current.append(line.strip())
        elif current is not None or line.startswith("#"):  # the list's end, or no list under the paragraph
            break
    listed = {}
    for bullet in bullets:
        text = " ".join(bullet)
        reason, _, tests = text.partition("Tests:")
        for test_id in re.findall(r"`([^`]+::[^`]+)`", tests):
            listed[test_id] = reason.strip()
    return listed
