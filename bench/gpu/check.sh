#!/usr/bin/env bash
# The GPU check in one command (bench/gpu/check.py says what it checks and where the JSON goes):
#   bash bench/gpu/check.sh           CUDA and NCCL, one rank per visible GPU
#   bash bench/gpu/check.sh --cpu     dry run on CPU: gloo, 2 ranks, CUDA hidden
# Other arguments go to the script (--steps N, --sizes-mib 64,256, --json PATH).
# Python: $PYTHON if set; else the first of .venv/bin/python and python3 whose torch serves the mode
# (sees a GPU, unless --cpu); else a venv in build/gpu_check_venv with `pip install -e .` (made once).
# The whole run is stopped after $GPU_CHECK_TIMEOUT seconds (default 540, under the ten minutes of a
# lent GPU, compiling included); the JSON is written
# after each check, so a hang keeps the results before it.
set -euo pipefail
cd "$(dirname "$0")/../.."  # the repository root: the ranks run -m bench.gpu.check from it

mode=cuda
for arg in "$@"; do
    if [[ $arg == --cpu ]]; then mode=cpu; fi
done
if [[ $mode == cpu ]]; then export CUDA_VISIBLE_DEVICES=""; fi

serves() {  # does Python "$1" import torch, with a GPU unless this is the CPU dry run?
    "$1" -c "import sys, torch; sys.exit(0 if '$mode' == 'cpu' or torch.cuda.is_available() else 1)" >/dev/null 2>&1
}
if [[ -n ${PYTHON:-} ]]; then
    py=$PYTHON
elif serves .venv/bin/python; then
    py=.venv/bin/python
elif serves python3; then
    py=python3
elif serves build/gpu_check_venv/bin/python; then  # made by an earlier run
    py=build/gpu_check_venv/bin/python
else
    echo "no Python with a usable torch: creating build/gpu_check_venv (pip install -e .)"
    python3 -m venv build/gpu_check_venv
    build/gpu_check_venv/bin/python -m pip install -q -e .
    py=build/gpu_check_venv/bin/python
fi

if [[ $mode == cpu ]]; then
    nproc=2
else
    nproc=$("$py" -c 'import torch; print(torch.cuda.device_count())')
    if [[ $nproc == 0 ]]; then echo "FAIL: $py's torch sees no GPU (--cpu runs the dry run)"; exit 2; fi
fi
echo "using $(command -v "$py") (Python $("$py" -c 'import platform; print(platform.python_version())'), $("$py" -c \
    'import torch; print("torch", torch.__version__, "CUDA", torch.version.cuda)')); $mode mode, $nproc ranks"

export PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
exec timeout --kill-after=15 "${GPU_CHECK_TIMEOUT:-540}" \
    "$py" -m torch.distributed.run --standalone --nproc-per-node="$nproc" -m bench.gpu.check "$@"
