"""The differential fuzzer (``make fuzz``): ``python -m bench.fuzz -n 200 --seed 0`` from the repository root.

__main__.py   the command line: draws configurations, runs each on its pool, judges and tallies them
config.py     what one configuration draws, from (master seed, index)
models.py     the models configurations are drawn from
build.py      one configuration's wrapped model, FSDP2 beside it, and the optimizers, inside a rank
gathers.py    parameters that gather themselves (FSDP2's all-gather extension)
worker.py     one configuration on one rank, compared with the reference every step
check.py      the comparisons and their tolerances
pool.py       the spawned gloo ranks that run configurations one after another
"""
