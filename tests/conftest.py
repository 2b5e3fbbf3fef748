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
