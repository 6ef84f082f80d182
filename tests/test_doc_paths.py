"""Every file path README.md, CONTRIBUTING.md, CHANGELOG.md and docs/ (every page, at any depth) name
exists, so a move of a file cannot leave the pages pointing at nothing. Paths are those under src/,
tests/, bench/ and examples/ ending in .py or .sh; ``runtime/x.py``-style paths are read from
src/flatshard/. The links of the pages outside the site (README.md and the two beside it) lead to files
that exist."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").rglob("*.md"))]
PATH = re.compile(
    r"(?<![\w/.-])((?:src|tests|bench|examples|runtime|fsdp2|state|checkpoint|planner)/[\w/]*\.(?:py|sh))"
)


def missing_paths(text: str) -> list[str]:
    named = set(PATH.findall(text))
    return sorted(p for p in named if not (ROOT / p).exists() and not (ROOT / "src" / "flatshard" / p).exists())


def test_the_pages_name_only_files_that_exist():
    gone = {
        page.relative_to(ROOT).as_posix(): missing for page in PAGES if (missing := missing_paths(page.read_text()))
    }
    assert not gone, f"pages naming files that do not exist: {gone}"


def test_a_moved_file_is_reported():
    assert missing_paths("see `src/flatshard/runtime/streams.py` and runtime/gather.py") == [
        "src/flatshard/runtime/streams.py"
    ]


LINK = re.compile(r"\]\(((?!https?:|#|mailto:)[^)#\s]+)(?:#[^)]*)?\)")


def broken_links(text: str, page: Path) -> list[str]:
    """Relative markdown links of ``page`` whose target file does not exist."""
    return sorted(t for t in set(LINK.findall(text)) if not (page.parent / t).exists())


def test_the_readme_links_only_to_pages_that_exist():
    # the docs/ pages' own links are checked by `make docs` (mkdocs build --strict); README is outside the site
    for page in (ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md"):
        assert not broken_links(page.read_text(), page), (page.name, broken_links(page.read_text(), page))


def test_a_broken_link_is_reported():
    assert broken_links("[a](docs/index.md) [b](docs/gone.md#x) [c](https://x.org/y.md)", ROOT / "README.md") == [
        "docs/gone.md"
    ]
