# Two commands set up a fresh machine: `make demo` and `make test` (see README.md).
# ORT_EXTRA=cpu (default) installs onnxruntime-training-cpu; ORT_EXTRA=cuda installs the CUDA build.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
ORT_EXTRA ?= cpu
PYTEST_ARGS ?=

.PHONY: demo test bench lint clean

$(VENV)/.installed-$(ORT_EXTRA): pyproject.toml Makefile
	@echo ">> creating $(VENV) and installing torch==2.13.0 first, then ortwrap[$(ORT_EXTRA),dev]"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==2.13.0
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[$(ORT_EXTRA),dev]'
	@touch $@

demo: $(VENV)/.installed-$(ORT_EXTRA)
	$(PY) examples/demo.py

test: $(VENV)/.installed-$(ORT_EXTRA)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(VENV)/.installed-$(ORT_EXTRA)
	$(PY) benchmarks/run_all.py

lint: $(VENV)/.installed-$(ORT_EXTRA)
	$(PY) -m ruff check ortwrap tests benchmarks examples

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
