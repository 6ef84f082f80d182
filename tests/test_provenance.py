"""Every committed result file says where it comes from (bench/provenance.py): the commit, the tree of
src/, whether the tree was dirty, the command, the machine and its load before and after, the time."""

from __future__ import annotations

import json

import pytest

from bench import provenance

# Files whose writers do not stamp them yet, or that no run has regenerated since the writers do.
# strict: once a file is regenerated with its provenance, its entry here fails the test until removed.
NOT_YET_STAMPED: dict[str, str] = {}


def _params():
    for path in provenance.result_files():
        name = str(path.relative_to(provenance.ROOT))
        marks = [pytest.mark.xfail(strict=True, reason=NOT_YET_STAMPED[name])] if name in NOT_YET_STAMPED else []
        yield pytest.param(path, id=name, marks=marks)


@pytest.mark.parametrize("path", list(_params()))
def test_result_file_records_its_provenance(path):
    problems = provenance.check(json.loads(path.read_text()))
    assert not problems, f"{path.name}: {problems}"


def test_not_yet_stamped_names_only_files_that_exist():
    names = {str(p.relative_to(provenance.ROOT)) for p in provenance.result_files()}
    assert set(NOT_YET_STAMPED) <= names, set(NOT_YET_STAMPED) - names


def test_record_has_every_field_and_check_names_what_is_missing():
    doc = provenance.stamp({"figure": 1}, ["python", "-m", "bench.x", "--json", "out.json"])
    assert provenance.check(doc) == []
    prov = doc["provenance"]
    assert prov["command"] == "python -m bench.x --json out.json"
    assert len(prov["commit"]) == 40 and len(prov["src_tree"]) == 40
    del prov["load_1min_after"], prov["machine"]["avx512"]
    assert provenance.check(doc) == [
        "provenance.load_1min_after: missing or not float",
        "provenance.machine.avx512: missing",
    ]
    assert provenance.check({"figure": 1}) != []


def test_status_lists_every_result_file():
    from datetime import datetime

    text = provenance.status()
    minutes = 0.0
    for path in provenance.result_files():
        assert str(path.relative_to(provenance.ROOT)) in text
        prov = json.loads(path.read_text())["provenance"]
        minutes += (datetime.fromisoformat(prov["finished"]) - datetime.fromisoformat(prov["started"])).total_seconds()
    # [Note: what make figures costs] (bench/provenance.py): the sum of the records' own spans
    assert f"the commands behind these files ran {minutes / 3600:.1f} h in all" in text


def test_every_measured_at_line_in_the_docs_is_a_committed_file():
    """Each "Measured at commit ..." line of README.md and docs/ is bench.tables.measured_at of a result file
    as committed: a page cannot keep quoting a run after its file was regenerated. The history pages
    (docs/internals/*-history.md) keep replaced runs on purpose and are left out."""
    import re

    from bench.tables import measured_at

    current = {measured_at(json.loads(p.read_text())): p.name for p in provenance.result_files()}
    pages = [provenance.ROOT / "README.md", *sorted((provenance.ROOT / "docs").rglob("*.md"))]
    quoted = set()
    for page in pages:
        if page.name.endswith("-history.md"):
            continue
        text = " ".join(page.read_text().split())
        for line in re.findall(r"Measured at commit `[0-9a-f]+`.*?: `[^`]+`\.", text):
            assert line in current, f"{page.relative_to(provenance.ROOT)} quotes a run no result file holds: {line}"
            quoted.add(current[line])
    # every file is quoted so but the conformance record, whose page says its commit in prose (test_conformance)
    assert set(current.values()) - quoted == {"results.json"}
