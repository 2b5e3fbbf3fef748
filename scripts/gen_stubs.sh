#!/usr/bin/env bash
# Regenerate shmkv/_C.pyi from the built extension (pybind11-stubgen, the
# version scripts/setup.sh pins). tests/store/test_shared_constants.py fails
# when the checked-in stub and the built module differ.
set -euo pipefail
cd "$(dirname "$0")/.."
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
"${PYTHON:-python3}" -m pybind11_stubgen shmkv._C -o "$out" >/dev/null
cp "$out/shmkv/_C.pyi" shmkv/_C.pyi
echo "shmkv/_C.pyi regenerated"
