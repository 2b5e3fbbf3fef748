#!/usr/bin/env bash
# What scripts/gpu_vllm_v2.sh needs on a lent GPU machine (no network there,
# 64 MiB per device call), in one folder:
#   vllm-src.tar.zst  vLLM 0.32's Python files (the installed vLLM's, no
#                     compiled parts: the machine's torch is another build);
#   wheels/           the shmkv wheel and its dependencies (scripts/gpu_bundle.sh)
#                     and the packages vLLM imports that the lent image lacks
#                     (.library/device/KINDS.md), all for that machine's Python;
#   shim/             scripts/gpu_v2/shim (stubs for vLLM's compiled parts);
#   v2_cases.py       the cases scripts/gpu_vllm_v2.sh runs.
#
#   scripts/gpu_v2_bundle.sh gpu-v2        # PYTHON=python3.12 by default (the lent machines' Python)
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-gpu-v2}"
PY="${PYTHON:-python3.12}"
if ! "$PY" -c pass 2>/dev/null; then
  PY="$(ls -d "$(pyenv root 2>/dev/null)"/versions/3.12*/bin/python3.12 2>/dev/null | tail -1)"
  [ -n "$PY" ] || { echo "gpu_v2_bundle.sh: no Python 3.12 here (set PYTHON)" >&2; exit 2; }
fi
TARGET="$("$PY" -c 'import sys; print(f"{sys.version_info[0]}.{sys.version_info[1]}")')"
VLLM_DIR="$(python3 -c 'import os, vllm; print(os.path.dirname(vllm.__file__))')"
VLLM_VERSION="$(python3 -c 'import vllm; print(vllm.__version__)')"
case "$VLLM_VERSION" in 0.32.*) ;; *) echo "gpu_v2_bundle.sh: vLLM $VLLM_VERSION here; the shim is for 0.32" >&2; exit 2;; esac
rm -rf "$OUT"
mkdir -p "$OUT/wheels"
PYTHON="$PY" bash scripts/gpu_bundle.sh "$OUT/wheels" >/dev/null
# vLLM's own imports for an offline LLM on V2 with the Triton attention backend, less what the lent
# image holds; pinned to this checkout's vLLM's versions. Optional ones vLLM guards are left out
# (boto3 for s3:// models, llguidance loaded lazily for structured outputs).
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET" \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_34_x86_64 --platform any -d "$OUT/wheels" -r scripts/gpu_v2/requirements.txt >/dev/null
# vLLM finds its platform by its distribution's version ("cpu" in it: the CPU platform): the source travels
# with a dist-info of its own that names vLLM's version alone, so the CUDA platform is the one found there
META="$(mktemp -d)"
mkdir -p "$META/vllm-$VLLM_VERSION.dist-info"
printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s\nSummary: vLLM Python files for shmkv GPU checks (no compiled parts)\n' \
  "$VLLM_VERSION" >"$META/vllm-$VLLM_VERSION.dist-info/METADATA"
(cd "$(dirname "$VLLM_DIR")" && find vllm -name __pycache__ -prune -o -type f ! -name '*.so' -print \
  | LC_ALL=C sort | tar -cf - -T - -C "$META" "vllm-$VLLM_VERSION.dist-info" \
  | python3 -c 'import sys, zstandard; zstandard.ZstdCompressor(level=9, threads=-1).copy_stream(sys.stdin.buffer, sys.stdout.buffer)') \
  >"$OUT/vllm-src.tar.zst"
rm -rf "$META"
cp -r scripts/gpu_v2/shim "$OUT/shim"
cp scripts/gpu_v2/v2_cases.py "$OUT/v2_cases.py"
echo "$VLLM_VERSION" >"$OUT/VLLM_VERSION"
bytes="$(du -sb "$OUT" | cut -f1)"
echo "gpu_v2_bundle.sh: $OUT holds $((bytes / 1048576)) MiB (vLLM $VLLM_VERSION source, $(ls "$OUT/wheels" | wc -l) wheels for Python $TARGET)"
if [ "$bytes" -gt $((60 * 1048576)) ]; then
  echo "gpu_v2_bundle.sh: over 60 MiB: a device call carries 64 MiB in all" >&2
  exit 1
fi
