"""flatshard's benchmarks and measurement tools: a package, each tool run from the repository root as
``python -m bench.<tool>`` (the Make targets do so), each printing figures; tests/ asserts behaviour.

The benchmark itself (``make bench``, docs/bench.md):
    compare.py            flatshard vs PyTorch FSDP2 vs DDP: python -m bench.compare [--quick]
    profile_step.py       where a step's time goes: torchrun --nproc-per-node=2 -m bench.profile_step 30M fp32
    gloo_collectives.py   gloo's collectives vs flatshard's exchanges: torchrun ... -m bench.gloo_collectives
    fsdp2_reference.py    PyTorch's FSDP2 built as the benchmark compares it (imported, not run)
    muon.py               Muon on whole matrices (fully_shard shard_boundaries="params") vs FSDP2 + full_tensor():
                          python -m bench.muon
fuzz/      the differential fuzzer: python -m bench.fuzz -n 200 --seed 0 (make fuzz)
cluster/   an emulated cluster of network namespaces, as root: python -m bench.cluster measure | run | clean,
           python -m bench.cluster.hsdp, .slow_link, .predict (make cluster; docs/multi_node.md)
faults/    failures on purpose: python -m bench.faults.soak (make soak), python -m bench.faults.replica_faults
gpu/       the check for a GPU machine: bash bench/gpu/check.sh [--cpu]
figures/   one figure each for docs/: python -m bench.figures.boundaries, .checkpoint_figures,
           .compress_accuracy
results/   the committed runs the docs quote and tests check

Imports between tools are package imports (``from bench.cluster import net``), and ranks a tool starts
run its worker as a module too (torchrun's ``-m``, ``run_local(..., module=True)``), from the root.
The example model and launcher come from examples/ as ``examples.gpt`` and ``examples.local_launch``:
examples/ stays a folder of scripts that import their siblings by file name, as a user's copy of one
beside the files it names does, so only the ones that import no sibling are importable this way
(examples/__init__.py). train_gpt.py is not: the soak runs it as a file, and compress_accuracy restates
its learning-rate schedule (tests/test_bench.py holds the two equal).
"""
