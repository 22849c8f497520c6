# muxd's image. One recipe (packaging/image/install.sh, the locked Python packages of packaging/lock/), two flavours:
#   CUDA, for real deployments (x86_64; the host needs a driver for CUDA 13 and the NVIDIA container toolkit):
#     docker build -t muxd .
#     docker run --gpus all -p 8000:8000 -v /path/to/models:/models muxd --model /models/Qwen2.5-7B-Instruct
#   CPU (the embedded model, demos and tests), on Debian 12; packaging/image/build-cpu.sh builds it without a daemon:
#     docker build --build-arg BASE_IMAGE=debian:bookworm-slim --build-arg FLAVOR=cpu -t muxd:cpu .
# Arguments after the image name are `muxd serve` flags; the server binds 0.0.0.0:8000 inside the container.
ARG BASE_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04
FROM ${BASE_IMAGE}
ARG FLAVOR=cuda
# a CA bundle for pip, only where the build's network intercepts TLS (mounted for the build, never in the image)
ARG PIP_CERT=

ENV VIRTUAL_ENV=/opt/muxd \
    PATH=/opt/muxd/bin:/usr/local/cuda/bin:${PATH} \
    CUDA_HOME=/usr/local/cuda \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /src
COPY pyproject.toml README.md ./
COPY packaging ./packaging
COPY appliance ./appliance
RUN sh packaging/image/install.sh "${FLAVOR}"

USER 10001:10001
WORKDIR /home/muxd
ENV MUXD_HOST=0.0.0.0 \
    MUXD_PORT=8000
EXPOSE 8000
# /health answers as soon as the server is up, also while the model loads (GET /ready says when it can serve).
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s --retries=3 \
    CMD ["python3", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('MUXD_PORT', '8000') + '/health', timeout=4)"]
ENTRYPOINT ["muxd", "serve"]
