#!/usr/bin/env bash
# Builds the CPU image of muxd without a Docker daemon or a registry: a Debian 12 root filesystem made from Debian's
# packages (mmdebstrap) becomes the base image, then podman (buildah) builds the Dockerfile on it with FLAVOR=cpu.
#   packaging/image/build-cpu.sh              # -> localhost/muxd:cpu
#   TAG=muxd:test packaging/image/build-cpu.sh
# Needs root, mmdebstrap and podman (RUN steps run in a chroot, ISOLATION=oci for a runtime); torch's CPU wheel is fetched with pip from wherever
# pip is set up to look (PyTorch's CPU index: PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu).
# BUILD_CA_BUNDLE=FILE: a CA bundle pip inside the build must trust (behind a proxy that intercepts TLS).
set -euo pipefail
cd "$(dirname "$0")/../.."
TAG=${TAG:-localhost/muxd:cpu}
BASE=${BASE:-localhost/muxd-base:bookworm}
PYTHON=${PYTHON:-python3}
torch=$(grep -o '^torch==[^ ]*' packaging/lock/requirements-cpu.txt)
mkdir -p build/image
"$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.11 \
  --platform manylinux_2_28_x86_64 --dest packaging/wheels "$torch"
if ! podman image exists "$BASE"; then
  mmdebstrap --variant=minbase --include=ca-certificates,python3,python3-venv,passwd bookworm \
    build/image/rootfs.tar
  podman import --change 'CMD ["/bin/bash"]' build/image/rootfs.tar "$BASE"
fi
extra=()
if [ -n "${BUILD_CA_BUNDLE:-}" ]; then  # a network that intercepts TLS: pip inside the build must trust its CA
  extra=(--volume "$BUILD_CA_BUNDLE:/run/build-ca.crt:ro" --build-arg PIP_CERT=/run/build-ca.crt)
fi
podman build --isolation "${ISOLATION:-chroot}" --network host "${extra[@]}" --build-arg BASE_IMAGE="$BASE" \
  --build-arg FLAVOR=cpu --format docker --tag "$TAG" --file Dockerfile .
podman image inspect "$TAG" --format '{{.Id}} {{.Size}}'
