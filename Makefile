# Two entry points: `make run` and `make test`. Both create .venv when missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast bench figures lint clean

$(STAMP): pyproject.toml
	test -d $(VENV) || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch pinned exactly (CPU build from local disk; a range would pull CUDA wheels); numpy explicit.
	$(BIN)/pip install -q torch==2.13.0 numpy
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/hybridpar plan --model resnet50_w8 --cluster lassen --gpus 256 --batch 512

# The import contracts (pyproject.toml [tool.importlinter]) and ruff run before the tests, so CI runs them.
# Two pytest-xdist workers: many tests wait on spawned ranks, subprocesses or rendezvous, so two share the
# cores (the whole suite here: ~25 min alone, ~19 with two). --dist loadfile: a module runs on one
# worker, its module-scoped fixtures built once (xdist's loadgroup marks are not honoured with pytest 9);
# tests/conftest.py starts the longest modules first.
test: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile --durations=25 tests

test-fast: lint
	OMP_NUM_THREADS=1 $(BIN)/python -m pytest -q -n 2 --dist loadfile -m "not slow" tests

bench: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python benchmarks/run_all.py

# What mypy checks ([tool.mypy] in pyproject.toml); a package joins when it is clean.
MYPY_PATHS := src/hybridpar/layout src/hybridpar/plans src/hybridpar/cost src/hybridpar/cluster src/hybridpar/parallel \
	src/hybridpar/graph/types.py src/hybridpar/errors.py src/hybridpar/files.py src/hybridpar/jsonfile.py \
	src/hybridpar/humanize.py src/hybridpar/toposort.py src/hybridpar/host_allocator.py src/hybridpar/user_code.py

# Rewrite the figures of README.md and docs/results.md that the code computes (tests/test_readme_figures.py
# fails when they differ). Minutes with cold caches: the projection runs DLPlacer's ILP.
figures: $(STAMP)
	OMP_NUM_THREADS=1 $(BIN)/python scripts/write_figures.py

lint: $(STAMP)
	$(BIN)/lint-imports
	$(BIN)/ruff check src tests benchmarks scripts
	$(BIN)/mypy $(MYPY_PATHS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
