#!/bin/sh
# The one recipe of the muxd image, run by the Dockerfile for either flavour (FLAVOR build argument):
#   cuda  Ubuntu 24.04 on NVIDIA's CUDA runtime base: Python 3.12, plus the compilers flashinfer's JIT (nvcc, CUDA
#         headers) and torch.compile (gcc, Python headers) need at run time; packaging/lock/requirements-cuda.txt
#   cpu   Debian 12: Python 3.11 only (muxd runs eager on a CPU); packaging/lock/requirements-cpu.txt
# Python packages come from the lock, every file checked against its hash; wheels that are not on PyPI (torch's
# CPU build) are taken from packaging/wheels/ when build-cpu.sh put them there. Distribution packages are left
# unpinned: the base image pins the release they come from.
set -eu
flavor=$1
if [ -z "${PIP_CERT:-}" ]; then unset PIP_CERT; fi  # the build argument, empty unless the build's network needs it
case "$flavor" in
  cuda) packages="python3 python3-venv python3-dev gcc g++ cuda-nvcc-13-0 cuda-cudart-dev-13-0" ;;
  cpu) packages="python3 python3-venv ca-certificates" ;;
  *) echo "install.sh: FLAVOR must be cuda or cpu, got '$flavor'" >&2; exit 2 ;;
esac
export DEBIAN_FRONTEND=noninteractive
apt-get update
# shellcheck disable=SC2086
apt-get install -y --no-install-recommends $packages
rm -rf /var/lib/apt/lists/*

python3 -m venv /opt/muxd
/opt/muxd/bin/pip install --no-cache-dir --require-hashes --find-links packaging/wheels \
  -r "packaging/lock/requirements-$flavor.txt"
# muxd itself: its dependencies (and the gpu extra's, for cuda) are all in the lock, so nothing else is resolved
/opt/muxd/bin/pip install --no-cache-dir --no-deps --no-build-isolation .
/opt/muxd/bin/pip check

# an unprivileged user (numeric, so runAsNonRoot policies can verify it); its home holds the JIT caches
# (flashinfer, Triton, Inductor); models are mounted at /models
useradd --create-home --uid 10001 --user-group --shell /usr/sbin/nologin muxd
mkdir -p /models
chown 10001:10001 /models
