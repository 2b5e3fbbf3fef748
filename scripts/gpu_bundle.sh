#!/usr/bin/env bash
# The folder scripts/gpu_check.sh installs from on a lent GPU machine (no
# network there): the shmkv wheel built here for that machine's Python
# (3.12 by default, as the lent machines have) and the dependencies its image
# lacks, as wheels for that Python. Carry the folder with the device call.
#
#   scripts/gpu_bundle.sh gpu-wheels            # PYTHON=python3.12 by default
#   SHMKV_WHEEL_DIR=dist scripts/gpu_bundle.sh gpu-wheels   # its wheel for that Python, not built again
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-wheels}"
PY="${PYTHON:-python3.12}"
if ! "$PY" -c pass 2>/dev/null; then  # a pyenv shim of a version not selected: that version's own binary
  PY="$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
  [ -n "$PY" ] || { echo "gpu_bundle.sh: no Python 3.12 here (set PYTHON)" >&2; exit 2; }
fi
TARGET="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
mkdir -p "$OUT"
# SHMKV_WHEEL_DIR: a folder holding a wheel already built for that Python (scripts/build_wheel.sh), used as is
TAG="cp${TARGET/./}"
if [ -n "${SHMKV_WHEEL_DIR:-}" ] && ls "$SHMKV_WHEEL_DIR"/shmkv-*-"$TAG"-"$TAG"-manylinux_*.whl >/dev/null 2>&1; then
  cp "$SHMKV_WHEEL_DIR"/shmkv-*-"$TAG"-"$TAG"-manylinux_*.whl "$OUT"/
else
  PYTHON="$PY" bash scripts/build_wheel.sh "$OUT" >/dev/null
fi
# shmkv's dependencies for that Python, resolved together (versions that fit each other); those the lent
# machines' image already has are dropped (it holds numpy, xxhash, PyYAML, prometheus_client, packaging,
# anyio, h11, click, idna, typing-extensions: .library/device/KINDS.md)
"$PY" -m pip download -q --only-binary=:all: --python-version "$TARGET" \
  --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$OUT" zstandard fastapi uvicorn pydantic >/dev/null
(cd "$OUT" && rm -f numpy-* xxhash-* PyYAML-* pyyaml-* prometheus_client-* packaging-* anyio-* h11-* click-* \
  idna-* typing_extensions-* sniffio-*)
du -sh "$OUT" | cut -f1
ls "$OUT"
