"""Shared by the transfer engine's tests: a small segment of the test's own name."""

from __future__ import annotations

import pytest

from shmkv import Store


@pytest.fixture
def store(cache_name):
    """16 MiB, 256-byte alignment: room for a few chunks of the tests' toy caches."""
    s = Store.create(cache_name, 16 << 20, alignment=256)
    yield s
    s.close()
