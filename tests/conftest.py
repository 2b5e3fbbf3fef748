"""Shared fixtures: unique cache names (segments are always unlinked after the
test), child processes, daemons, a private redis-server, and the vLLM
engines of the end-to-end tests. Plain helpers live in helpers.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator

import pytest
from helpers import VLLM_RUNNERS, Child, DaemonProcess, Reference, check_runner, fresh_cache_name, runner_env

from shmkv.engines.forks import fork_engine

cache_name = pytest.fixture(fresh_cache_name, name="cache_name")


@pytest.fixture(autouse=True)
def _shmkv_logger_restored():
    """A connector built in the test process sets up the shmkv logger (a
    handler of its own, no propagation): restored after every test, so a
    later test in the same worker still sees shmkv's records in caplog."""
    import logging

    log = logging.getLogger("shmkv")
    saved = log.handlers[:], log.propagate, log.level
    yield
    log.handlers[:] = saved[0]
    log.propagate = saved[1]
    log.setLevel(saved[2])


def pytest_configure(config) -> None:
    """Every vLLM engine start of the run is noted in one file (all xdist
    workers append to the controller's): the summary adds them up."""
    if "PYTEST_ENGINE_START_LOG" not in os.environ:
        fd, path = tempfile.mkstemp(prefix="shmkv-engine-starts-", suffix=".txt")
        os.close(fd)
        os.environ["PYTEST_ENGINE_START_LOG"] = path


# The run leaves /dev/shm, the runtime directory and the temporary directory as it found them:
# leftovers.py (a plugin of its own, so that a nested session in a test can load it too)
from leftovers import pytest_sessionfinish, pytest_sessionstart  # noqa: E402,F401
from schedule import longest_first  # noqa: E402


def pytest_report_header(config) -> str:
    """The CPU this run is on and what vLLM chose on it (tests/support/vllm_host.py)."""
    from vllm_host import header

    return header()


def pytest_terminal_summary(terminalreporter) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    path = os.environ.get("PYTEST_ENGINE_START_LOG", "")
    try:
        with open(path) as f:
            rows = [line.split() for line in f if line.strip()]  # LABEL KIND TEST SECONDS (engine.note_start)
    except OSError:
        return
    starts = [float(r[-1]) for r in rows]
    if starts:
        terminalreporter.write_line(f"vLLM engine starts: {len(starts)}, {sum(starts):.0f} s in all "
                                    f"(mean {sum(starts) / len(starts):.1f} s, longest {max(starts):.1f} s)")
        by_kind: dict[str, list[float]] = {}
        for r in rows:
            by_kind.setdefault(r[1] if len(r) >= 4 else "-", []).append(float(r[-1]))
        terminalreporter.write_line("  by kind: " + ", ".join(
            f"{k} {len(v)} ({sum(v):.0f} s)" for k, v in sorted(by_kind.items(), key=lambda kv: -sum(kv[1]))))
    if os.path.basename(path).startswith("shmkv-engine-starts-"):  # this run's own (pytest_configure)
        os.unlink(path)


def pytest_collection_modifyitems(config, items) -> None:
    """The longest files first (schedule.py); the default runner choice (V1
    on the cases marked v1 only); and a CUDA GPU without shmkv._C_cuda must
    not pass the gpu tests by skipping them all."""
    longest_first(items)
    if config.getoption("--vllm-runner") == "default":
        left_out = [item for item in items if _v1_left_out(item)]
        if left_out:
            config.hook.pytest_deselected(items=left_out)
            items[:] = [item for item in items if not _v1_left_out(item)]
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    from helpers import cuda_build_missing

    why = cuda_build_missing()
    if why is not None:
        raise pytest.UsageError(f"a CUDA GPU is here but {why}; rebuild shmkv where nvcc is found (CUDA_HOME or nvcc "
                                "on PATH): pip install --no-build-isolation --no-deps -e .")

second_cache = pytest.fixture(fresh_cache_name, name="second_cache")

@pytest.fixture
def child() -> Iterator[type[Child]]:
    made: list[Child] = []

    def make(code: str, **kw) -> Child:
        c = Child(code, **kw)
        made.append(c)
        return c

    yield make  # type: ignore[misc]
    for c in made:
        if c.proc.poll() is None:
            c.kill9()


# --------------------------------------------------------------- daemon ---

@pytest.fixture
def daemon(tmp_path) -> Iterator:
    """daemon(cache, *args) -> a started DaemonProcess (stopped after the test)."""
    made: list[DaemonProcess] = []

    def start(cache: str, *args: str, ready: bool = True, **container) -> DaemonProcess:
        """`container`: pid_namespace, private_shm, env (DaemonProcess)."""
        d = DaemonProcess(cache, *args, log_path=str(tmp_path / f"daemon-{len(made)}.log"), **container)
        made.append(d)
        if ready:
            d.wait_ready()
        return d

    yield start
    for d in made:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()

@pytest.fixture
def small_store(cache_name) -> Iterator:
    """A 16 MiB segment of the test's own, mapped on first touch."""
    from shmkv import Store

    s = Store.create(cache_name, 16 << 20, populate=False)
    yield s
    s.close()


def _private_server(make) -> Iterator:
    """Start a throwaway server (its binary missing: a failure naming it), kill it after."""
    try:
        server = make()
    except FileNotFoundError as e:
        pytest.fail(str(e))
    yield server
    server.kill()


@pytest.fixture
def redis_server(tmp_path) -> Iterator:
    """A private redis-server on a loopback port (shmkv.engines.redis_server.PrivateRedis)."""
    from shmkv.engines.redis_server import PrivateRedis

    yield from _private_server(lambda: PrivateRedis(str(tmp_path)))


@pytest.fixture
def redis_cluster(tmp_path) -> Iterator:
    """A private Redis Cluster of 3 primaries on loopback (shmkv.engines.redis_server.PrivateRedisCluster)."""
    from shmkv.engines.redis_server import PrivateRedisCluster

    yield from _private_server(lambda: PrivateRedisCluster(str(tmp_path)))


# ---------------------------------------------------------------- vLLM ----
# Shared by the end-to-end tests: one small random-weight Llama, and one
# reference engine WITHOUT the connector that produces the greedy output of a
# prompt at a given split point: the split vLLM's own prefix cache would use,
# since recomputing a different number of tail tokens alone can flip a greedy
# token (rounding), even with exact KV.
#
# Engines run EngineCore in their own process (EngineSpec.in_process: one
# Python importing vLLM per engine instead of three), forked from a server
# that imported vLLM once (shmkv/engines/forks.py), unless a test checks
# vLLM's process split itself: it passes in_process=False (the connector's
# halves then talk only through pickled metadata, as in every deployment).
# On V2 (a GPU host's runner) vLLM's EngineCore and workers are forked, as
# on a GPU host (EngineSpec.fork_children); on V1 they are spawned, as
# vLLM-CPU starts them (a fresh Python importing vLLM each: the start a CPU
# deployment pays, about a minute on 2 cores).
#
# Every test that starts an engine is parametrized by vLLM model runner:
# "v2" is Model Runner V2, what vLLM 0.32 runs on a GPU (through the
# test-only shim tests/vllm_v2/sitecustomize.py: Triton's interpreter runs
# its kernels here), "v1" the runner vLLM-CPU picks itself. By default V2
# runs every case and V1 the cases marked `v1` (the call orders only V1 has:
# its delayed frees, preemption, state pre-copy and drafter paths);
# --vllm-runner both|v1|v2 chooses otherwise. The parameter is
# session-scoped, so pytest runs each runner's cases together and starts one
# reference engine per runner.

def pytest_addoption(parser) -> None:
    parser.addoption("--vllm-runner", choices=("default", "both", *VLLM_RUNNERS), default="default",
                     help="the vLLM model runner(s) of the vLLM end-to-end cases: default = V2 on every case and "
                          "V1 on the cases marked v1; both = every case on both")


def pytest_generate_tests(metafunc) -> None:
    if "vllm_runner" in metafunc.fixturenames:
        chosen = metafunc.config.getoption("--vllm-runner")
        metafunc.parametrize("vllm_runner", VLLM_RUNNERS if chosen in ("default", "both") else (chosen,),
                             scope="session")


def _v1_left_out(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return (callspec is not None and callspec.params.get("vllm_runner") == "v1"
            and item.get_closest_marker("v1") is None)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from shmkv.engines.models import write_llama

    return write_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def mla_dir(tmp_path_factory) -> str:
    """A tiny DeepSeek-V2 (MLA) checkpoint."""
    from shmkv.engines.models import write_mla

    return write_mla(str(tmp_path_factory.mktemp("tiny-mla")))

@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-logs")

# The test engines' KV cache: 256 MiB (262,144 tokens of the test model), not vLLM-CPU's smallest setting
# of its variable (1 GiB): vLLM allocates and zeroes it at every start (half a second a start, ~200 starts
# a run). A test that sizes the cache itself (blocks, bytes, the variable) keeps its own.
TEST_KV_CACHE_BYTES = 256 << 20


def with_test_kv_cache(llm_kwargs: dict) -> dict:
    if "num_gpu_blocks_override" in llm_kwargs or "kv_cache_memory_bytes" in llm_kwargs:
        return llm_kwargs
    return {"kv_cache_memory_bytes": TEST_KV_CACHE_BYTES, **llm_kwargs}


@pytest.fixture(scope="session")
def reference(model_dir, engine_logs, vllm_runner):
    from shmkv.engines.engine import EngineProcess, EngineSpec

    engine = EngineProcess(EngineSpec(model_dir, shmkv=None, prefix_caching=True, in_process=True,
                                      env=runner_env(vllm_runner), llm_kwargs=with_test_kv_cache({})),
                           str(engine_logs / f"ref-{vllm_runner}.log"), launch=fork_engine)
    check_runner(engine.log_path, vllm_runner)
    yield Reference(engine)
    engine.close()

@pytest.fixture
def start_engine(model_dir, engine_logs, vllm_runner):
    """start_engine(name, **spec) -> EngineProcess on this test's vLLM
    runner, closed after the test (EngineCore in the engine's process unless
    the spec says in_process=False)."""
    from shmkv.engines.engine import EngineProcess, EngineSpec

    made = []

    def start(label: str, **spec):
        spec.setdefault("in_process", True)
        # V2, the GPU's runner, starts vLLM's own processes as a GPU host does (forked: vLLM's default there;
        # no import of vLLM per process); V1, vLLM-CPU's runner, spawns them as vLLM-CPU does
        spec.setdefault("fork_children", vllm_runner == "v2")
        spec["env"] = {**runner_env(vllm_runner), **spec.get("env", {})}
        if "VLLM_CPU_KVCACHE_SPACE" not in spec["env"]:
            spec["llm_kwargs"] = with_test_kv_cache(spec.get("llm_kwargs", {}))
        e = EngineProcess(EngineSpec(spec.pop("model_dir", model_dir), **spec),
                          str(engine_logs / f"{label}-{vllm_runner}.log"), launch=fork_engine)
        made.append(e)
        check_runner(e.log_path, vllm_runner)
        return e

    yield start
    with contextlib.ExitStack() as closing:  # every one closed, even when closing one fails
        for e in made:
            closing.callback(e.close)


@pytest.fixture
def sticky_tmp() -> Iterator[str]:
    """A root-owned sticky world-writable directory, like /tmp: only shmkv's
    own modes and checks protect what is in it."""
    d = tempfile.mkdtemp(prefix="shmkv-sticky-", dir="/tmp")
    os.chmod(d, 0o1777)
    yield d
    shutil.rmtree(d, ignore_errors=True)
