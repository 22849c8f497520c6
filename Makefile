# Two entry points for newcomers: `make serve` and `make test`. Both create .venv on first use.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test venv clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch unless a CUDA driver is present (the pyproject range alone would pull CUDA wheels).
	# With a CUDA driver, the gpu extra (flashinfer) as well.
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[test,gpu]'; \
	else $(BIN)/pip install -q torch==2.13.0 && $(BIN)/pip install -q -e '.[test]'; fi
	touch $(STAMP)

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/muxd serve --port 8000

test: $(STAMP)
	$(BIN)/python -m pytest -q

clean:
	rm -rf $(VENV) build *.egg-info
