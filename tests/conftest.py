"""Session hooks: the launches that collected tests mostly wait on start when collection ends, and what
is left of them stops with the session (tests/helpers/early.py); compiled code is cached apart for each
CPU setting ([Note: one inductor cache per CPU setting])."""

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
    if not session.config.option.collectonly:
        early.start_for(session.items)


def pytest_sessionfinish(session, exitstatus) -> None:
    early.stop_all()
