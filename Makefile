# `make demo` and `make test` bootstrap .venv themselves. `make demo` installs the
# runtime dependencies alone (no torch, transformers or jupyter); `make test` and the
# results targets add the test extra on top. Each install step reruns only when
# pyproject.toml changes (its stamp file is older than it).
PYTHON ?= python3
VENV := .venv
RUNTIME_STAMP := $(VENV)/.installed-runtime
TEST_STAMP := $(VENV)/.installed-test
PY := $(VENV)/bin/python
# Three workers on two cores: the suite is mostly compiling, which runs on one thread
# per program, and workers wait on subprocesses. Measured once each, not side by side:
# 23:31 with three in a fresh clone, 24:23 with two. The suite's XLA flags (tests/
# conftest.py) took it from 25:16 to 17:46 on the same machine, three workers each;
# `CI=true bash .ci/run` in a fresh clone: 17:32 of pytest, 18:43 with the install
# (14:59 and 16:04 after the suite's cuts of 95b271c; 25:37 of pytest at da7e6cf on a
# machine that ran the 38M pair's RL rollouts at half that one's speed; 13:51 and 14:47
# at 0a6427f on one that ran them at 3.3x that slow one's speed; 19:55 and 23:51 at
# c825174, 21:37 and 24:08 at 771752c, on one that ran the tiny RL rollout at about
# two-thirds of that fast one's).
PYTEST_WORKERS ?= 3

.PHONY: demo test test-full results results-quick bench clean

$(PY):
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(RUNTIME_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e .
	touch $(RUNTIME_STAMP)

# The test extra includes the runtime dependencies, so this stamp implies the runtime one.
$(TEST_STAMP): pyproject.toml | $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(TEST_STAMP) $(RUNTIME_STAMP)

demo: $(RUNTIME_STAMP)
	$(PY) -m specrl_jax.cli demo
	@echo "specrl is installed in $(VENV)/bin: 'source $(VENV)/bin/activate' puts it on PATH (or run $(VENV)/bin/specrl train --help)"

# The default suite covers every verification mode, temperature, warp and k through a
# pairwise covering design; test-full adds the full cross
# product and the one timed test (both marked slow, ~25 min more). Whole files go to a
# worker (--dist loadfile) so that a file's fixtures and programs are built once.
test: $(TEST_STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile -m "not slow" --durations=15 tests

test-full: $(TEST_STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --durations=15 tests

clean:
	rm -rf $(VENV) .pytest_cache results/quick

# Regenerates every README figure and table into results/ (hours on 2 cores; reuses artifacts/).
results: $(TEST_STAMP)
	$(PY) experiments/results.py

results-quick: $(TEST_STAMP)
	$(PY) experiments/results.py --quick
