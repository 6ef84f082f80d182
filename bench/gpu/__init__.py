"""The check for a machine with GPUs: ``bash bench/gpu/check.sh`` (``--cpu`` for the dry run on CPU).

check.sh    picks a Python whose torch serves the mode and starts the ranks: torchrun ... -m bench.gpu.check
check.py    parity against plain PyTorch, CPU offload, the all-gather's bandwidth; the JSON report
fronts.py   flatshard's two front ends beside PyTorch's FSDP2: losses, step times, compiled, overlap
"""
