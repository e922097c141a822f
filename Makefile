# Each target sets itself up: the virtual environment is created and the package installed when missing.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# The CPU build of torch on this machine's disk; set TORCH_SPEC=torch to take the default build instead.
TORCH_SPEC ?= torch==2.13.0
RUN ?= demo

.PHONY: setup demo test lab bench clean-demo

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)" || $(BIN)/python -m pip install -q torch
	$(BIN)/python -m pip install -q -e '.[dev]'
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 >/dev/null
	touch $(STAMP)

setup: $(STAMP)

## Run the whole pipeline on the embedded default (params/demo/) into outputs/demo/.
demo: $(STAMP)
	$(BIN)/eagle3nb run params/$(RUN)/

## The whole test suite (CI runs exactly this).
test: $(STAMP)
	$(BIN)/python -m pytest

## JupyterLab on notebooks/.
lab: $(STAMP)
	$(BIN)/jupyter lab --notebook-dir=notebooks

## Benchmarks: ratios measured side by side.
bench: $(STAMP)
	for f in benchmarks/bench_*.py; do echo "== $$f"; $(BIN)/python $$f || exit 1; done
