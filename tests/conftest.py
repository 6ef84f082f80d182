"""Session hooks: the launches that collected tests mostly wait on start when collection ends, and what
is left of them stops with the session (tests/helpers/early.py; not under pytest-xdist, [Note: the suite
on two workers]); compiled code is cached apart for each CPU setting ([Note: one inductor cache per CPU
setting])."""

from __future__ import annotations

import getpass
import os
import tempfile

from tests.helpers import early

# [Note: one inductor cache per CPU setting]
# The suite runs as it is and as a machine without AVX-512 would run it (ATEN_CPU_CAPABILITY=avx2
# ONEDNN_MAX_CPU_ISA=AVX2). torch.compile's on-disk cache does not tell those apart: a graph compiled
# under one setting and loaded under the other computed NaN losses (tests/test_compile.py, the compiled
# rows of bench.compare; each passes with a cold cache). So unless the caller chose a cache, the suite and
# every process it starts (the variable is inherited) use one cache per pair of settings.
if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
    _setting = "-".join(os.environ.get(v, "default") for v in ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA"))
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}", f"flatshard-tests-{_setting}"
    )


# [Note: two tiers]
# ``make test`` runs the tests not marked ``slow``; ``make test-slow`` runs those; CI (.ci/run) runs both,
# so every claim a test holds is checked on every change, and ``make test`` stays the quick loop (under 7
# minutes on 2 cores without AVX-512). A test is marked ``slow`` when one run of it takes tens of seconds
# for one of two reasons:
# - it launches a program as a user launches it, in processes of its own (torchrun on the example with
#   kills and restarts, replica groups dropped and rejoined, the fuzzer and benchmark scripts, every code
#   block of the docs, ``pip install``, a job over the emulated link, the frameworks' trainers): each start
#   imports torch again and many wait out a timeout or a restart;
# - it repeats at another world size a sweep that ``make test`` runs at W = 3, the size that shows the
#   most (padding, more than two ranks): the parity of every strategy, the boundary modes, whole
#   parameters, no_sync; or it is the 256-micro-batch case beside the 64 one that shows the same
#   difference, or torch.compile on the 2 x 2 mesh beside the 1-D cases.
# Every multi-process test on the pooled ranks that is the only check of a behaviour stays in ``make
# test``. Measured on 2 cores of an AMD EPYC, AVX2 only, two workers: the whole suite took 18m23s (604
# tests); after the split, ``make test`` took 5m55s (566 tests) on the idle machine but 8m21s and 7m54s
# (567) in the fresh-clone CI runs that followed. With the longest files first ([Note: the longest files
# first]), one reference per trajectory and five steps (tests/helpers/cases.py), the hybrid sweep's
# bitwise twins without a reference and the stream check once per schedule structure, the next
# fresh-clone CI run took 5m59s (569 tests). One worker was slower (38% of the quick tier in 4 minutes):
# its tests compute rather than wait.


# [Note: the longest files first]
# Under ``--dist loadfile`` pytest-xdist hands each worker one file at a time from a queue; by default it
# orders that queue by number of tests, so a file of one long multi-process test (the hybrid sweep, the
# stream check, torch.compile) came last and ran while the other worker had nothing left: the tier ended
# up to a file's length after the work did. The Makefile turns that order off (``--no-loadscope-reorder``)
# and this hook puts the files that took longest first, each tier in its order of measured seconds (2
# cores of an AMD EPYC, AVX2 only), then every other file in collection order: the longest first is the
# greedy schedule whose tail is at most the shortest files'. A stale list costs only that tail.
LONGEST_FIRST = [
    # make test-slow
    "test_restart.py",
    "test_doc_blocks.py",
    "test_example.py",
    "test_fuzz.py",
    "test_replica_faults_fully_shard.py",
    "test_replica_faults.py",
    "test_frameworks.py",
    "test_memory_cap.py",
    # make test (both tiers for test_parity.py)
    "test_parity.py",
    "test_hybrid.py",
    "test_loops.py",
    "test_mesh_groups.py",
    "test_activation_checkpointing.py",
    "test_tensor_parallel.py",
    "test_compile.py",
    "test_moe.py",
    "test_checkpoint_fully_shard.py",
    "test_streams.py",
    "test_dp_mesh_dims.py",
    "test_shard_boundaries.py",
    "test_overlap_precision.py",
    "test_fully_shard_whole.py",
    "test_fully_shard.py",
    "test_optimizer_across_replicas.py",
    "test_reliability.py",
    "test_fsdp2_reduction_settings.py",
    "test_fully_shard_across_replicas.py",
]


def pytest_collection_modifyitems(session, config, items) -> None:
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: a file's tests keep their order


def pytest_collection_finish(session) -> None:
    # [Note: the suite on two workers]
    # ``make test`` runs the files on two pytest-xdist workers (``-n 2 --dist loadfile``: a file's tests
    # on one worker, in order, so a module's fixtures are made once; each worker keeps its own rank pools,
    # tests/helpers/dist_pool.py). The multi-process tests spend much of their time waiting (process
    # starts, gloo rendezvous, the collective timeouts a fault test waits out): on 2 cores without
    # AVX-512, one worker ran the suite in 24m49s using 19 CPU-minutes; two ran it in 17m51s using 18.
    # Three were slower still (the cores saturated, load above 20) and timing-bound tests failed. Every
    # worker collects every test but runs only some, so an early launch is not started at collection: the
    # fixture that takes it starts it, in the worker that runs its test.
    if not session.config.option.collectonly and "PYTEST_XDIST_WORKER" not in os.environ:
        early.start_for(session.items)


def pytest_sessionfinish(session, exitstatus) -> None:
    early.stop_all()
