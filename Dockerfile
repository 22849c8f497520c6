# muxd on an NVIDIA CUDA runtime base (x86_64; the host needs a driver for CUDA 13 and the NVIDIA container toolkit).
#   docker build -t muxd .
#   docker run --gpus all -p 8000:8000 -v /path/to/models:/models muxd --model /models/Qwen2.5-7B-Instruct
# Arguments after the image name are `muxd serve` flags; the server binds 0.0.0.0:8000 inside the container.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${CUDA_IMAGE}

# Python 3.12 in a virtual environment. Compiled code is built at run time, so the runtime base gets a small
# toolchain: gcc/g++ and Python's headers for torch.compile (Triton launchers, Inductor), nvcc and the CUDA runtime
# headers for flashinfer's JIT-compiled attention kernels. Distribution packages are left unpinned: the base tag
# pins the release they come from.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends python3 python3-venv python3-dev gcc g++ \
        cuda-nvcc-13-0 cuda-cudart-dev-13-0 \
    && rm -rf /var/lib/apt/lists/*

ENV VIRTUAL_ENV=/opt/muxd \
    PATH=/opt/muxd/bin:/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/muxd

# The same install as the project's own (`pip install .[gpu]`): versions are the ranges in pyproject.toml.
WORKDIR /src
COPY pyproject.toml README.md ./
COPY appliance ./appliance
# hadolint ignore=DL3013
RUN pip install --no-cache-dir ".[gpu]"

# An unprivileged user (numeric, so runAsNonRoot policies can verify it); its home holds the JIT caches (flashinfer,
# Triton, Inductor). Models are mounted at /models.
RUN useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin muxd \
    && mkdir -p /models \
    && chown 10001:10001 /models
USER 10001:10001
WORKDIR /home/muxd

ENV MUXD_HOST=0.0.0.0 \
    MUXD_PORT=8000
EXPOSE 8000
# /health answers as soon as the server is up, also while the model loads (GET /ready says when it can serve).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MUXD_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["muxd", "serve"]
