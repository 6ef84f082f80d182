"""tests/conformance/results.json (what ``make conformance`` recorded: PyTorch's own FSDP2 tests run on
PyTorch's FSDP2 and on flatshard's ``fully_shard``, CPU/gloo) against README.md's "Differences from
PyTorch FSDP": every public test that passes on PyTorch's FSDP2 and fails on flatshard is listed there
with its reason, and nothing else is. CI cannot fetch PyTorch's test files, so it checks the record;
``make conformance`` makes it anew from them."""

from __future__ import annotations

import json
from pathlib import Path

from tests.conformance.readme import listed_differences

RESULTS = Path(__file__).resolve().parent / "conformance" / "results.json"


def _tests() -> list[dict]:
    return json.loads(RESULTS.read_text())["tests"]


def _differences() -> dict[str, dict]:
    return {
        t["id"]: t
        for t in _tests()
        if t["category"] == "public" and t["baseline"] == "passed" and t["flatshard"] != "passed"
    }


def test_every_test_has_both_outcomes_and_a_category():
    tests = _tests()
    assert tests
    for t in tests:
        assert t["baseline"] in ("passed", "failed", "skipped"), t
        assert t["flatshard"] in ("passed", "failed", "skipped"), t
        assert t["category"] in ("public", "internals"), t


def test_every_difference_is_listed_in_the_readme_with_its_reason():
    listed = listed_differences()
    missing = sorted(set(_differences()) - set(listed))
    assert not missing, f"fail on flatshard, pass on FSDP2, not in README.md's differences: {missing}"
    for test_id, t in _differences().items():
        assert listed[test_id], f"{test_id}: README.md lists it without a reason"
        assert t["reason"] == listed[test_id], f"{test_id}: results.json's reason is not README.md's"


def test_the_readme_lists_no_test_that_is_not_a_difference():
    stale = sorted(set(listed_differences()) - set(_differences()))
    assert not stale, f"README.md lists tests that flatshard passes or FSDP2 fails: {stale}"


def test_the_readme_counts_are_the_recorded_ones():
    import re

    from tests.conformance.readme import README

    tests = _tests()
    public = [t for t in tests if t["category"] == "public" and t["baseline"] == "passed"]
    internals = [t for t in tests if t["category"] == "internals" and t["baseline"] == "passed"]
    text = " ".join(README.read_text().split())
    said = re.search(
        r"of the (\d+) public tests that pass on PyTorch's FSDP2 here, flatshard's fully_shard passes (\d+) .*?"
        r"(\d+) more pass on FSDP2 but read or patch its private parts .*? flatshard passes (\d+) of those",
        text,
    )
    assert said, "README.md's conformance counts are missing"
    recorded = (
        len(public),
        sum(t["flatshard"] == "passed" for t in public),
        len(internals),
        sum(t["flatshard"] == "passed" for t in internals),
    )
    assert tuple(int(g) for g in said.groups()) == recorded, (said.groups(), recorded)
    failing = recorded[0] - recorded[1]
    assert f"The {failing} it fails" in text, f"README.md should say 'The {failing} it fails'"


def test_the_page_names_the_commit_and_src_tree_of_the_record():
    """differences.md says which commit and src/ tree the record was run at: the record's own, and every
    test in it at that tree (a record that mixes runs at two trees says so, or fails here)."""
    from tests.conformance.readme import README

    record = json.loads(RESULTS.read_text())
    prov = record["provenance"]
    trees = {t.get("src_tree") for t in record["tests"]}
    assert trees == {prov["src_tree"]}, f"the record mixes src trees {sorted(map(str, trees))}"
    text = " ".join(README.read_text().split())
    said = f"at commit `{prov['commit'][:7]}` (every test at the `src/` tree `{prov['src_tree'][:7]}`)"
    assert said in text, f"{README.name} should say the record was run {said}"


def test_flaky_pairs_margin_is_assert_equals_tolerance():
    """tests/conformance/flaky_pair.py's margin: 0 when bitwise equal, above 1 exactly where assertEqual's
    fp32 tolerance (atol 1e-5 + rtol 1.3e-6 * |ref|) fails."""
    import pytest
    import torch

    from tests.conformance.flaky_pair import _margin

    ref = torch.tensor([100.0, 0.0])
    assert _margin(ref.clone(), ref) == 0.0
    inside = ref + torch.tensor([1e-4, 5e-6])  # 1e-4 < 1e-5 + 1.3e-4; 5e-6 < 1e-5
    outside = ref + torch.tensor([0.0, 2e-5])
    assert _margin(inside, ref) <= 1.0
    torch.testing.assert_close(inside, ref)
    assert _margin(outside, ref) > 1.0
    with pytest.raises(AssertionError):
        torch.testing.assert_close(outside, ref)


def test_the_record_is_the_newest_full_run_and_the_page_counts_the_runs():
    """tests/conformance/runs.json keeps every full run at the record's src/ tree (tests/conformance/runs.py):
    the record is the newest of them, and differences.md says how many there were and names each test whose
    outcome changed between them (or says that none did)."""
    from tests.conformance import runs as conformance_runs
    from tests.conformance.readme import README

    record = json.loads(RESULTS.read_text())
    runs = conformance_runs.load()
    assert runs, "tests/conformance/runs.json holds no full run"
    trees = {run["provenance"]["src_tree"] for run in runs}
    assert trees == {record["provenance"]["src_tree"]}, f"runs at {sorted(trees)}, the record at another tree"
    assert runs[-1]["outcomes"] == conformance_runs.outcomes(record), "results.json is not the newest full run"
    text = " ".join(README.read_text().split())
    files = sum(name.endswith(".py") for name in record["sources"])
    said = f"{len(runs)} full run{'s' if len(runs) > 1 else ''} of the {files} files at that tree"
    assert said in text, f"{README.name} should say '{said}'"
    diff = conformance_runs.changed(runs)
    if not diff:
        assert "every test had the same outcome in each run" in text, "the page should say no outcome changed"
    for test_id in diff:
        assert f"`{test_id}`" in text, f"{test_id} changed outcome between runs; the page should name it"


def test_runs_changed_names_a_test_whose_outcome_differs_in_any_run():
    from tests.conformance.runs import changed

    runs = [
        {"outcomes": {"a": "passed/passed", "b": "passed/passed"}},
        {"outcomes": {"a": "passed/passed", "b": "passed/failed"}},
        {"outcomes": {"a": "passed/passed"}},
    ]
    assert changed(runs) == {"b": ["passed/passed", "passed/failed", "not run"]}
    assert changed(runs[:1]) == {}
