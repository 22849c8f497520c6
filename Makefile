# Two entry points for newcomers: `make serve` and `make test`. Both create .venv on first use.
# `make binary` builds the single-file CPU binary dist/muxd from the locked packages; `make test-binary` builds it and
# tests it (minutes). `make image-cpu` builds the CPU image without a Docker daemon; `make lock` re-pins the locks.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: serve test venv clean binary test-binary image-cpu lock

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# The CPU build of torch unless a CUDA driver is present (the pyproject range alone would pull CUDA wheels).
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q torch==2.13.0; fi
	# with a GPU the install is the image's: the gpu extra (flashinfer, cuda-python) too
	if command -v nvidia-smi >/dev/null 2>&1; then $(BIN)/pip install -q -e '.[test,gpu]'; \
	else $(BIN)/pip install -q -e '.[test]'; fi
	touch $(STAMP)

# The GPU machines' Triton (the CUDA lock's) apart from the one installed: the tests compile muxd's kernels with both,
# since a newer Triton may accept kernel code the GPU machines' rejects
GPU_TRITON := $(VENV)/gpu-triton/.installed
$(GPU_TRITON): $(STAMP) packaging/lock/requirements-cuda.txt
	rm -rf $(VENV)/gpu-triton
	$(BIN)/pip install -q --no-deps --target $(VENV)/gpu-triton \
		"$$(grep -o '^triton==[0-9.]*' packaging/lock/requirements-cuda.txt)"
	touch $@

venv: $(STAMP)

serve: $(STAMP)
	$(BIN)/muxd serve --port 8000

# two workers (CI has two cores), each test file on one of them (a file's module fixtures start servers once); the
# suite starts many Python processes, so they keep their bytecode (__pycache__, git-ignored) even where the
# environment says not to (PYTHONDONTWRITEBYTECODE): each would compile muxd's modules again
test: $(STAMP) $(GPU_TRITON)
	PYTHONDONTWRITEBYTECODE= $(BIN)/python -m pytest -q -n 2 --dist loadfile

# the binary holds exactly the packages of the CPU lock (the CPU image's too), each checked against its hash
$(VENV)/.binary: $(STAMP) packaging/lock/requirements-cpu.txt
	$(BIN)/pip install -q --require-hashes -r packaging/lock/requirements-cpu.txt
	$(BIN)/pip install -q --no-deps -e .
	$(BIN)/pip install -q 'pyinstaller>=6.10'
	touch $@

binary: $(VENV)/.binary
	PYTHON=$(BIN)/python packaging/build.sh

test-binary: $(VENV)/.binary
	$(BIN)/python -m pytest -q -m slow tests/binary

image-cpu:
	packaging/image/build-cpu.sh

# Re-pin both locks (hashes included) from pyproject.toml and packaging/lock/*.in, for the image's Python and platform.
# torch's CPU build is not on PyPI: point uv at it with UV_FIND_LINKS=DIR or UV_EXTRA_INDEX_URL (PyTorch's CPU index).
LOCK := --generate-hashes --no-header --no-annotate --quiet --python-platform x86_64-manylinux_2_28
lock: $(STAMP)
	$(BIN)/pip install -q uv
	$(BIN)/uv pip compile pyproject.toml packaging/lock/cuda.in --extra gpu --python-version 3.12 $(LOCK) \
		-o packaging/lock/requirements-cuda.txt
	$(BIN)/uv pip compile pyproject.toml packaging/lock/cpu.in --python-version 3.11 $(LOCK) \
		-o packaging/lock/requirements-cpu.txt

clean:
	rm -rf $(VENV) build dist *.egg-info
