#!/usr/bin/env bash
# The checks a lent GPU machine runs, in one device call, from the wheel built
# here (no compiler and no network needed there):
#   1. a virtual environment beside the machine's torch (its system packages)
#      with the shmkv wheel and its missing dependencies from WHEELS
#      (scripts/gpu_bundle.sh makes that folder for the machine's Python);
#   2. `pytest -m gpu tests/` against the installed wheel;
#   3. `python -m shmkv.bench gpu --json`;
#   4. `shmkv check --json` (registration s/GiB, copies, the CUDA part against the driver).
# Everything goes to $OUT (the device call's output folder; ./gpu-check-out here).
# Each step runs whatever the one before gave; summary.json says what each returned.
#
#   bash scripts/gpu_check.sh gpu-wheels
set -uo pipefail
cd "$(dirname "$0")/.."
WHEELS="${1:-gpu-wheels}"
OUT="${OUT:-gpu-check-out}"
PY="${PYTHON:-python3}"
VENV="${SHMKV_GPU_VENV:-/tmp/shmkv-gpu-venv}"
mkdir -p "$OUT"
declare -A rc

"$PY" -m venv --system-site-packages "$VENV" >"$OUT/venv.log" 2>&1
"$VENV/bin/python" -m pip install -q --no-index --find-links "$WHEELS" shmkv >"$OUT/install.log" 2>&1
rc[install]=$?
"$VENV/bin/python" -P - >"$OUT/versions.json" 2>>"$OUT/install.log" <<'PY'
import json, sys
import shmkv, shmkv._C
out = {"python": sys.version.split()[0], "shmkv": shmkv.__file__}
try:
    import torch
    out.update(torch=torch.__version__, cuda=torch.version.cuda, gpu=torch.cuda.is_available())
except ImportError as e:
    out["torch"] = f"not importable: {e}"
try:
    import shmkv._C_cuda as c
    out["cuda_archs"] = c.ARCHITECTURES
except ImportError as e:
    out["cuda_part"] = f"not importable: {e}"
print(json.dumps(out))
PY
rc[versions]=$?

# pytest from the checkout's tests, shmkv from the wheel: the checkout's sources stay off sys.path
"$VENV/bin/python" -P -m pytest -m gpu tests/ -q -rs -n 0 -p no:cacheprovider --import-mode=importlib \
  --junitxml="$OUT/pytest-gpu.xml" >"$OUT/pytest-gpu.log" 2>&1
rc[pytest_gpu]=$?
"$VENV/bin/python" -P -m shmkv.bench gpu --json >"$OUT/bench-gpu.json" 2>"$OUT/bench-gpu.log"
rc[bench_gpu]=$?
# a cache of its own, removed after (the check creates the segment it checks)
cache="shmkv-gpu-check-$$"
SHMKV_CAPACITY="${SHMKV_CAPACITY:-8GiB}" "$VENV/bin/shmkv" check --cache "$cache" --json >"$OUT/check.json" \
  2>"$OUT/check.log"
rc[check]=$?
"$VENV/bin/python" -P -c "import sys; from shmkv import Store; from shmkv.paths import remove_cache_files; \
Store.unlink(sys.argv[1]); remove_cache_files(sys.argv[1])" "$cache" || true

{
  printf '{'
  sep=""
  for k in install versions pytest_gpu bench_gpu check; do printf '%s"%s": %s' "$sep" "$k" "${rc[$k]}"; sep=", "; done
  printf ', "pytest_summary": "%s"}\n' "$(tail -1 "$OUT/pytest-gpu.log" | tr -d '"')"
} >"$OUT/summary.json"
cat "$OUT/summary.json"
