"""The planted bugs of the differential fuzzer (bench/fuzz/plants/): every patch still applies to the tree, so
``python -m bench.fuzz.plants`` plants what it says; the committed run flagged each of them, and the testing
page quotes it."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from bench.fuzz.plants.__main__ import patches

ROOT = Path(__file__).resolve().parents[1]
BUGS = [
    "a_skipped_update_bf16",
    "b_accumulate_in_param_dtype",
    "c_micro_batch_dropped",
    "d_hybrid_divided_by_F",
    "e_shard_view_off_by_one",
]


def test_every_planted_bug_has_its_patch():
    assert [p.stem for p in patches()] == BUGS


@pytest.mark.parametrize("bug", BUGS)
def test_the_patch_applies_to_the_tree(bug):
    patch = ROOT / "bench" / "fuzz" / "plants" / f"{bug}.patch"
    proc = subprocess.run(["git", "apply", "--check", str(patch)], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_the_committed_run_flagged_every_planted_bug():
    run = json.loads((ROOT / "bench" / "results" / "fuzz_plants.json").read_text())
    rows = {row["bug"]: row for row in run["plants"]}
    assert sorted(rows) == BUGS
    for bug, row in rows.items():
        assert row["flagged"] > 0, bug
        assert row["first_flagged_index"] == min(row["flagged_indices"]), bug


def test_the_testing_page_quotes_the_committed_run():
    """docs/internals/testing.md's planted-bug table is ``python -m bench.fuzz.plants --table`` of the committed
    file, with the commit it was measured at (a rerun fails this until the page says what the file says)."""
    from bench.fuzz.plants import table
    from bench.tables import measured_at

    run = json.loads((ROOT / "bench" / "results" / "fuzz_plants.json").read_text())
    page = (ROOT / "docs" / "internals" / "testing.md").read_text()
    assert "\n".join(table(run)) in page
    assert " ".join(measured_at(run).split()) in " ".join(page.split())
