#!/usr/bin/env bash
# vLLM's Model Runner V2 with CUDA graphs and shmkv on a lent GPU machine, in
# one device call, from the folder scripts/gpu_v2_bundle.sh made here (carry
# it): a virtual environment beside the machine's torch and Triton with the
# bundle's wheels, vLLM's Python files unpacked beside the shim
# (scripts/gpu_v2/shim: stubs for vLLM's compiled parts), then v2_cases.py
# with FULL_AND_PIECEWISE CUDA graphs, and with FULL as well if that run did
# not pass. A pass is vLLM's Python on a shimmed runtime, not vLLM's
# CUDA wheel. Everything goes to $OUT; summary.json says what each step gave.
# Without a GPU it stops after the preflight (exit 3).
#
#   bash scripts/gpu_vllm_v2.sh gpu-v2
set -uo pipefail
BUNDLE="$(cd "${1:-gpu-v2}" && pwd)"
OUT="${OUT:-gpu-v2-out}"
PY="${PYTHON:-python3}"
VENV="${SHMKV_V2_VENV:-/tmp/shmkv-v2-venv}"
SRC="${SHMKV_V2_SRC:-/tmp/shmkv-v2-src}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
rm -rf "$SRC" && mkdir -p "$SRC"
"$PY" -m venv --system-site-packages "$VENV" >"$OUT/venv.log" 2>&1
# NOTE: --no-deps: the bundle holds what vLLM imports for this run, not every dependency it declares
"$VENV/bin/python" -m pip install -q --no-index --no-deps "$BUNDLE"/wheels/*.whl >"$OUT/install.log" 2>&1
install=$?
"$VENV/bin/python" - "$BUNDLE/vllm-src.tar.zst" "$SRC" >>"$OUT/install.log" 2>&1 <<'PY'
import sys, tarfile, zstandard
with open(sys.argv[1], "rb") as f, zstandard.ZstdDecompressor().stream_reader(f) as r:
    tarfile.open(fileobj=r, mode="r|").extractall(sys.argv[2], filter="data")
PY
unpack=$?
run_cases() {
  PYTHONPATH="$BUNDLE/shim:$SRC" "$VENV/bin/python" "$BUNDLE/v2_cases.py" --out "$OUT/$1" --cudagraph "$1" \
    >"$OUT/$1.json" 2>"$OUT/$1.log"
}
run_cases FULL_AND_PIECEWISE
cases=$?
full=skipped
if [ "$cases" -ne 0 ] && [ "$cases" -ne 3 ]; then
  run_cases FULL
  full=$?
fi
printf '{"install": %s, "unpack": %s, "full_and_piecewise": %s, "full": "%s"}\n' "$install" "$unpack" "$cases" \
  "$full" | tee "$OUT/summary.json"
[ "$cases" -eq 3 ] && exit 3
exit "$cases"
