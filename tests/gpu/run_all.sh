#!/usr/bin/env bash
# Runs the GPU tests on a CUDA machine and prints a short table last.
#   bash tests/gpu/run_all.sh            (from the repository root)
set -uo pipefail
cd "$(dirname "$0")/../.."
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name(0))"
python3 -m pytest -q -p no:cacheprovider tests/gpu "$@" 2>&1 | tee /tmp/muxd-gpu-tests.log
status=${PIPESTATUS[0]}
echo
echo "| suite | result |"
echo "| --- | --- |"
echo "| tests/gpu | $(tail -n 1 /tmp/muxd-gpu-tests.log) |"
exit "$status"
