"""Every file path README.md, CONTRIBUTING.md, CHANGELOG.md and docs/ name exists, so a move of a file
cannot leave the pages pointing at nothing. Paths are those under src/, tests/, bench/ and examples/
ending in .py or .sh; ``runtime/x.py``-style paths are read from src/flatshard/."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
PATH = re.compile(
    r"(?<![\w/.-])((?:src|tests|bench|examples|runtime|fsdp2|state|checkpoint|planner)/[\w/]*\.(?:py|sh))"
)


def missing_paths(text: str) -> list[str]:
    named = set(PATH.findall(text))
    return sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "src" / "flatshard" / p).exists())


def test_the_pages_name_only_files_that_exist():
    gone = {page.name: missing for page in PAGES if (missing := missing_paths(page.read_text()))}
    assert not gone, f"pages naming files that do not exist: {gone}"


def test_a_moved_file_is_reported():
    assert missing_paths("see `src/flatshard/runtime/streams.py` and runtime/gather.py") == [
        "src/flatshard/runtime/streams.py"
    ]
