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
