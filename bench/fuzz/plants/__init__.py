"""Planted bugs the differential fuzzer (bench/fuzz/) must flag, one patch each against ``src/``:

a_skipped_update_bf16         bf16 parameters: one element of each flat shard keeps its first compute copy,
                              so the optimizer's updates to it never reach forward (a skipped update)
b_accumulate_in_param_dtype   fully_shard's unsynchronised window accumulates in the parameter dtype, not the
                              reduce dtype
c_micro_batch_dropped         the micro-batches of a window before its synchronised one are dropped (one, at
                              accum = 2)
d_hybrid_divided_by_F         the reduced gradient divided by the shard group's size F instead of W (hybrids)
e_shard_view_off_by_one       a parameter's shard view one element past its slice of the flat shard

``python -m bench.fuzz.plants -n N`` applies each in a throwaway worktree of HEAD (``git worktree add``,
``git apply``), runs ``python -m bench.fuzz -n N --seed 0`` there, and writes bench/results/fuzz_plants.json:
per bug, the configurations flagged of N and the first flagged index. tests/test_fuzz_plants.py checks that
every patch still applies to the tree (``git apply --check``) and that docs/internals/testing.md's table
(``python -m bench.fuzz.plants --table``) is the committed run's.
"""

from __future__ import annotations

from typing import Any

DESCRIPTIONS = {
    "a_skipped_update_bf16": "a skipped optimizer update on one element of each shard (bf16 parameters)",
    "b_accumulate_in_param_dtype": "unsynchronised gradients accumulated in the parameter dtype (fully_shard)",
    "c_micro_batch_dropped": "one micro-batch of a window dropped",
    "d_hybrid_divided_by_F": "a hybrid's gradient divided by F instead of W",
    "e_shard_view_off_by_one": "a shard view one element off",
}


def table(run: dict[str, Any]) -> list[str]:
    """The committed run as a Markdown table: per planted bug, the configurations flagged and the first one."""
    lines = ["| planted bug | configurations flagged | first flagged index |", "|---|---|---|"]
    for row in run["plants"]:
        first = "–" if row["first_flagged_index"] is None else str(row["first_flagged_index"])
        what = DESCRIPTIONS.get(row["bug"], row["bug"])
        lines.append(f"| {what} (`{row['bug']}`) | {row['flagged']} of {row['configurations']} | {first} |")
    return lines
