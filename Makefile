# `make demo` and `make test` bootstrap .venv themselves; the install step reruns only
# when pyproject.toml changes (the stamp file is older than it).
PYTHON ?= python3
VENV := .venv
STAMP := $(VENV)/.installed
PY := $(VENV)/bin/python
PYTEST_WORKERS ?= 2

.PHONY: demo test test-full results results-quick bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m specrl_jax.cli demo

# The default suite covers every verification mode, temperature, warp and k through a
# pairwise covering design; test-full adds the full cross product and the one timed test (marked slow, ~25 min).
test: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) -m "not slow" --durations=15 tests

test-full: $(STAMP)
	$(PY) -m pytest -n $(PYTEST_WORKERS) --durations=15 tests

clean:
	rm -rf $(VENV) .pytest_cache results

# Regenerates every README figure and table into results/ (hours on 2 cores; reuses artifacts/).
results: $(STAMP)
	$(PY) experiments/results.py

results-quick: $(STAMP)
	$(PY) experiments/results.py --quick
