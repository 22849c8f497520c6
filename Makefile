# Two entry points for newcomers: `make serve` and `make test`. Both create .venv on first use.
# `make binary` builds the single-file CPU binary dist/muxd; `make test-binary` builds it and tests it (minutes).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test venv clean binary test-binary

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch unless a CUDA driver is present (the pyproject range alone would pull CUDA wheels).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	# with a GPU the install is the image's: the gpu extra (flashinfer, cuda-python) too
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[test,gpu]'; \
	else $(BIN)/pip install -q -e '.[test]'; fi
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/muxd serve --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q

$(VENV)/.binary: $(STAMP)
	$(BIN)/pip install -q -e '.[test,binary]'
	touch $@

binary: $(VENV)/.binary
	PYTHON=$(BIN)/python packaging/build.sh

test-binary: $(VENV)/.binary
	$(BIN)/python -m pytest -q -m slow tests/binary

clean:
	rm -rf $(VENV) build dist *.egg-info
