"""Shared fixtures: unique cache names (segments are always unlinked after the
test), key helpers, and a child-process runner for crash tests."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Iterator

import pytest
import xxhash

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def key(i: int | str) -> bytes:
    """A deterministic 16-byte key."""
    return xxhash.xxh3_128_digest(f"test-key-{i}".encode())


def payload_for(k: bytes, n: int) -> bytes:
    """n bytes derived from the key alone, so any reader can check them."""
    block = xxhash.xxh3_128_digest(k) * 4  # 64 bytes
    return (block * (n // 64 + 1))[:n]


@pytest.fixture
def cache_name() -> Iterator[str]:
    from shmkv import Store

    name = f"shmkv-test-{uuid.uuid4().hex[:12]}"
    yield name
    Store.unlink(name)


class Child:
    """A Python child process running `code`; it talks through stdout lines."""

    def __init__(self, code: str) -> None:
        env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
        self.proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(code)],
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


@pytest.fixture
def child() -> Iterator[type[Child]]:
    made: list[Child] = []

    def make(code: str) -> Child:
        c = Child(code)
        made.append(c)
        return c

    yield make  # type: ignore[misc]
    for c in made:
        if c.proc.poll() is None:
            c.kill9()


# ---------------------------------------------------------------- vLLM ----
# Shared by the end-to-end tests: one small random-weight Llama, and one
# reference engine WITHOUT the connector that produces the greedy output of a
# prompt at a given split point (the split vLLM's own prefix cache would use:
# notes/vllm_connector_api.md §9).

E2E_TOKENS = 16


def random_prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(3, 4000) for _ in range(n)]


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory) -> str:
    from shmkv.models import write_llama

    return write_llama(str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def engine_logs(tmp_path_factory):
    return tmp_path_factory.mktemp("engine-logs")


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


@pytest.fixture(scope="session")
def reference(model_dir, engine_logs):
    from shmkv.bench.engines import EngineProcess, EngineSpec

    engine = EngineProcess(EngineSpec(model_dir, shmkv=None, prefix_caching=True), str(engine_logs / "ref.log"))
    yield Reference(engine)
    engine.close()


@pytest.fixture
def start_engine(model_dir, engine_logs):
    """start_engine(name, **spec) -> EngineProcess, closed after the test."""
    from shmkv.bench.engines import EngineProcess, EngineSpec

    made = []

    def start(label: str, **spec):
        e = EngineProcess(EngineSpec(model_dir, **spec), str(engine_logs / f"{label}.log"))
        made.append(e)
        return e

    yield start
    for e in made:
        e.close()


def read_digests(path: str) -> list[tuple[str, ...]]:
    import os

    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [tuple(line.split()) for line in f if line.strip()]
