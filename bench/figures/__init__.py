"""One figure each for docs/, each run as ``python -m bench.figures.<name>`` from the repository root.

boundaries.py           per-rank bytes and imbalance of shard_boundaries "flat", "rows" and "params"
                        (README, docs/planner.md); pure arithmetic on the layouts
checkpoint_figures.py   save and load time and per-rank peak memory of a checkpoint, consolidate's peak
                        (docs/checkpoints.md)
compress_accuracy.py    the loss curve of compress_inter_node="int8" against fp32's, on 4 local ranks
                        (docs/multi_node.md); bench/results/compress_accuracy.json
"""
