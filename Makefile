# Two entry points: `make run` (the main job: a real training run on local processes)
# and `make test` (the whole suite). Each creates .venv and installs flatshard the first time.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
ARGS ?=

.PHONY: run test test-slow lint install clean docs

install: $(VENV)/.installed

# constraints/cpu.txt pins the torch build of this project's machines; the package asks only for torch>=2.13
$(VENV)/.installed: pyproject.toml constraints/cpu.txt
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -c constraints/cpu.txt -e '.[examples,test,lint,docs]'
	touch $@

run: install
	$(PY) examples/train_gpt.py $(ARGS)

test: install  # the suite but its end-to-end jobs; two workers: [Note: the suite on two workers], [Note: two tiers] (tests/conftest.py)
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 -m "not slow" tests

test-slow: install  # the end-to-end jobs (tests marked slow): scripts launched as a user launches them
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=20 -m slow tests

lint: install  # ruff: the formatter's check and the linter; mypy over src/ (both configured in pyproject.toml)
	$(PY) -m ruff format --check src tests examples bench
	$(PY) -m ruff check src tests examples bench
	$(PY) -m mypy

.PHONY: bench
bench: install  # flatshard vs FSDP2 vs DDP (docs/bench.md); ARGS="--quick" for a short run
	$(PY) -m bench.compare $(ARGS)

docs: install  # the documentation site from docs/ into site/ (MkDocs-Material, mkdocstrings); warnings are errors
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict

clean:
	rm -rf $(VENV) src/*.egg-info site

.PHONY: cluster
cluster: install  # as root: an emulated 2-node cluster; calibration, measured and predicted steps; FSDP2's HSDP as users run it (docs/multi_node.md)
	$(PY) -m bench.cluster measure $(ARGS)
	$(PY) -m bench.cluster.hsdp

.PHONY: conformance
conformance: install  # PyTorch's FSDP2 tests on FSDP2 and on flatshard (tests/conformance/regenerate.py says where to get them)
	$(PY) -m pip install -q expecttest  # torch.testing._internal's helpers import it
	$(PY) tests/conformance/regenerate.py $(if $(SOURCE),--source $(SOURCE))
	$(PY) tests/conformance/run.py $(ARGS)

.PHONY: fuzz
N ?= 200
SEED ?= 0
fuzz: install  # differential fuzzer: N random configurations against the single-process reference and FSDP2 (a bench, not CI)
	$(PY) -m bench.fuzz -n $(N) --seed $(SEED) --json bench/results/fuzz.json $(ARGS)

.PHONY: soak
soak: install  # restart and resume through 48 injected faults at W = 4 (both front ends, FULL_SHARD and HYBRID_SHARD), checked bitwise against runs without (~25 min on 2 quiet cores)
	$(PY) -m bench.faults.soak --out bench/results/soak.json $(ARGS)

.PHONY: figures
# Every committed result file, each from its generator once, in this order, each stamped by bench/provenance.py
# (python -m bench.provenance lists them). Root for cluster and replica_faults; SOURCE=<PyTorch's
# test/distributed/_composable/fsdp> for conformance; TORCHTITAN_PYTHON=<a Python with torchtitan and triton>
# for frameworks' torchtitan run (recorded as not run without one). Not here: bench/results/gpu_check.json
# (needs a GPU: bash bench/gpu/check.sh).
figures: install
	$(PY) -m bench.figures.boundaries --json bench/results/boundaries.json
	$(PY) -m bench.figures.compress_accuracy
	$(PY) -m bench.compare
	$(MAKE) cluster
	$(PY) -m bench.cluster.hsdp --size 30M --batch-sizes 4 --steps 8 --out bench/results/cluster_hsdp_30M.json
	$(PY) -m bench.cluster.slow_link
	$(MAKE) fuzz
	$(PY) -m bench.fuzz.plants -n 200 --jobs 5
	$(PY) -m bench.faults.replica_faults
	$(PY) -m bench.faults.replica_faults --front fully_shard --out bench/results/replica_faults_fully_shard.json
	$(PY) -m bench.moe
	$(PY) -m bench.muon
	$(MAKE) soak
	$(MAKE) conformance
	$(PY) -m bench.frameworks $(if $(TORCHTITAN_PYTHON),--torchtitan-python $(TORCHTITAN_PYTHON))
	$(PY) -m bench.provenance
