# Two commands set up a fresh machine: `make demo` and `make test` (see README.md).
# ORT_EXTRA=cpu (default) installs onnxruntime-training-cpu; ORT_EXTRA=cuda installs the CUDA build.
# TORCH picks the torch release (pinned, installed first, so pip never resolves an open-ended torch):
# 2.13.0 in .venv (the default), any other in its own .venv-<release>, e.g. `TORCH=2.14.1 make test`.
# ORT_EXTRA=ort (or ort-gpu) installs the maintained onnxruntime for engine="onnxruntime" instead, in its
# own venv (.venv-ort, .venv-ort-<release>): it installs the module `onnxruntime` too, so it never
# shares a venv with the training build; `make test` there runs the engine's own tests (docs/engines.md).
PYTHON ?= python3
TORCH ?= 2.13.0
ORT_EXTRA ?= cpu
ifneq ($(filter ort ort-gpu,$(ORT_EXTRA)),)
ENGINE_VENV := -$(ORT_EXTRA)
# (and the whole coverage suite's CASES on the engine, not slow there, about 5 minutes, and
# test_coverage_amp.ENGINE_AMP_FAST (gpt2 under bf16 autocast); issue 28's families on the engine:
# `.venv-ort/bin/python -m pytest -m slow tests/test_coverage.py -k onnxruntime`; and DDP and DeepSpeed
# ZeRO 1/2/3 on two ranks, about 1 minute; and test_gradients.py's fast cases, the `slow` marker's
# subset of each table: 30 on the engine, under a minute of CPU; all 88 take over 2 minutes of CPU;
# test_functions.py: its not-slow subset there (its ENGINE_SLOW tests: `-m slow`); test_ops.py: one test per
# op family below (the whole file: `.venv-ort/bin/python -m pytest tests/test_ops.py`, 7 minutes loaded)
ENGINE_TESTS := tests/test_engine_onnxruntime.py tests/test_compat.py tests/test_models.py tests/test_gradients.py \
	tests/test_functions.py \
	tests/test_wrapper.py tests/test_io.py \
	tests/test_mixed_precision.py tests/test_recompute.py tests/test_rnn.py \
	tests/test_ops.py::test_layer_norm tests/test_ops.py::test_gelu tests/test_ops.py::test_scaled_dot_product_attention \
	tests/test_ops.py::test_embedding tests/test_ops.py::test_nll_loss_on_non_log_softmax_input \
	tests/test_ops.py::test_cnn_ops tests/test_ops.py::test_einsum \
	tests/test_coverage.py::test_architecture_trains_like_eager \
	tests/test_coverage_amp.py::test_architecture_trains_under_autocast_on_the_onnxruntime_engine \
	tests/test_distributed.py::test_ddp_of_ortwrap_on_the_onnxruntime_engine_matches_eager_ddp \
	tests/test_distributed.py::test_deepspeed_zero_on_the_onnxruntime_engine_matches_plain_deepspeed \
	tests/test_distributed.py::test_zero3_per_submodule_gather_is_refused_on_the_onnxruntime_engine
ENGINE_TESTS += tests/test_hf_training.py tests/test_robustness.py
endif
ifeq ($(TORCH),2.13.0)
VENV ?= .venv$(ENGINE_VENV)
else
VENV ?= .venv$(ENGINE_VENV)-$(TORCH)
endif
PY := $(VENV)/bin/python
# `make test` leaves out the tests marked slow (model sweeps); `make test-slow` runs only those. In an
# engine venv (ORT_EXTRA=ort), `make test` runs the engine's tests (not slow there, but for
# test_gradients.py's slow cases, which run by hand: `.venv-ort/bin/python -m pytest tests/test_gradients.py`).
ifdef ENGINE_TESTS
PYTEST_ARGS ?= -m "not slow" $(ENGINE_TESTS)
else
PYTEST_ARGS ?= -m "not slow"
endif
STAMP := $(VENV)/.installed-$(ORT_EXTRA)-torch$(TORCH)

.PHONY: demo test test-slow test-opinfo test-all test-wheel bench bench-zoo bench-scale lint clean

# timm (tests/test_timm.py) goes in with --no-deps, pinned: it requires torchvision, which has no build
# here that fits the pinned torch; the test stubs torchvision while timm imports (its models never use it).
# Pillow (no dependencies of its own) is imported by timm's data package; huggingface_hub, safetensors
# and pyyaml come with transformers.
$(STAMP): pyproject.toml setup.py Makefile
	@echo ">> creating $(VENV): torch==$(TORCH) first, then ortwrap[$(ORT_EXTRA),dev]"
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q torch==$(TORCH)
	DS_BUILD_OPS=0 $(PY) -m pip install -q -e '.[$(ORT_EXTRA),dev]'
	$(PY) -m pip install -q --no-deps timm==1.0.31 'pillow>=9.1'
	@$(PY) -c "import torch, sys; v = torch.__version__.split('+')[0]; sys.exit(0 if v == '$(TORCH)' else 'torch changed to ' + v)"
	@touch $@

demo: $(STAMP)
	$(PY) examples/demo.py

test: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

test-slow: $(STAMP)
	$(PY) -m pytest -q -m "slow and not opinfo_all"

# PyTorch's whole OpInfo database through both exporters against tests/opinfo_expected.json (one sweep
# process per core; about 10-15 minutes on 2 cores). The quick subset runs in `make test`.
test-opinfo: $(STAMP)
	$(PY) -m pytest -q -m opinfo_all tests/test_opinfo.py

# The suite on both ends of the tested torch range (what .ci/run does).
test-all:
	$(MAKE) test TORCH=2.13.0
	$(MAKE) test TORCH=2.14.1
	$(MAKE) test-slow TORCH=2.13.0
	$(MAKE) test-opinfo TORCH=2.13.0

# What a user installs: build the sdist and, from it, the wheel (python -m build); install each, not
# editable, into a fresh venv (torch==$(TORCH) first, then ortwrap[$(ORT_EXTRA)]) and run
# tests/installed/ there, outside the checkout, with no C compiler (tests/installed/run.sh).
DIST ?= build/test-wheel
test-wheel: $(STAMP)
	rm -rf $(DIST)
	$(PY) -m build -q --outdir $(DIST) .
	tests/installed/run.sh $(PYTHON) $(DIST)/ortwrap-*.whl $(ORT_EXTRA) $(TORCH)
	tests/installed/run.sh $(PYTHON) $(DIST)/ortwrap-*.tar.gz $(ORT_EXTRA) $(TORCH)

# the bench extra (matplotlib, for bench_zoo's plot), without touching torch
BENCH_DEPS = $(PY) -c "import matplotlib" 2>/dev/null || $(PY) -m pip install -q 'matplotlib>=3.5'

bench: $(STAMP)
	$(BENCH_DEPS)
	$(PY) benchmarks/run_all.py

# The model zoo: eager, torch.compile and ortwrap on every architecture of tests/model_zoo.py, fp32 and bf16,
# 1 thread and all cores (long: hours on 2 cores); `make bench-zoo ZOO=--quick` runs 6 models at 1 thread
# (~10-15 min; what `make bench` runs). Writes build/bench-zoo/zoo.{json,md,png} (docs/performance.md).
ZOO ?=
bench-zoo: $(STAMP)
	$(BENCH_DEPS)
	$(PY) benchmarks/bench_zoo.py $(ZOO)

bench-scale: $(STAMP)
	$(PY) benchmarks/bench_scale.py

lint: $(STAMP)
	$(PY) -m ruff check ortwrap tests benchmarks examples
	$(PY) -m ruff format --check ortwrap tests benchmarks examples

clean:
	rm -rf .venv .venv-* *.egg-info .pytest_cache build ortwrap/bridge/*.so
