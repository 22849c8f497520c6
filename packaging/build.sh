#!/usr/bin/env bash
# Builds the muxd binary with PyInstaller from the project's environment.
#   packaging/build.sh            one file, dist/muxd (CPU torch; the default `make binary`)
#   packaging/build.sh --onedir   one folder, dist/muxd/muxd (needed with CUDA torch: one-file archives cap at 4 GB)
# PYTHON selects the interpreter whose environment is bundled (default .venv/bin/python).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-.venv/bin/python}
bundle=onefile
case "${1:-}" in
  "") ;;
  --onedir) bundle=onedir ;;
  *) echo "usage: packaging/build.sh [--onedir]" >&2; exit 2 ;;
esac
if ! "$PYTHON" -c "import PyInstaller" 2>/dev/null; then
  echo "PyInstaller is not installed in $PYTHON's environment: pip install -e '.[binary]'" >&2
  exit 2
fi
cuda=$("$PYTHON" -c "import torch; print(torch.version.cuda or '')")
if [ "$bundle" = onefile ] && [ -n "$cuda" ]; then
  echo "torch here is built for CUDA $cuda (several GB of libraries); a one-file binary caps at 4 GB." >&2
  echo "Build a one-folder bundle instead: packaging/build.sh --onedir" >&2
  exit 2
fi
rm -rf dist/muxd
MUXD_BUNDLE=$bundle "$PYTHON" -m PyInstaller --noconfirm --clean --log-level WARN \
  --distpath dist --workpath build/pyinstaller packaging/muxd.spec
if [ "$bundle" = onefile ]; then exe=dist/muxd; else exe=dist/muxd/muxd; fi
echo "built $exe ($(du -sh "$(dirname "$exe")/$(basename "$exe")" | cut -f1))"
"$exe" version
