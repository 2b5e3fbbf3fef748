"""Tenants: requests with different cache salts (vLLM's `cache_salt`) never
share chunks through shmkv, in either direction, and salted namespaces are
never written to the namespace registry."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv.namespaces import known

pytestmark = pytest.mark.slow


def test_salts_separate_tenants(cache_name, start_engine, reference):
    e = start_engine("tenants", shmkv={"cache_name": cache_name, "capacity": "64MiB"})
    p, q = random_prompt(700, seed=71), random_prompt(700, seed=72)

    def hit(prompt, salt):
        r = e.generate([prompt], salts=[salt])
        n = r["num_cached_tokens"][0]
        assert r["outputs"][0] == reference.output(prompt, n), "the salt never changes the output"
        return n

    assert hit(p, None) == 0
    assert hit(p, "tenant-a") == 0, "a salted request does not hit unsalted chunks"
    assert hit(p, "tenant-a") == 640, "... but hits its own"
    assert hit(p, "tenant-b") == 0, "nor another tenant's"
    assert hit(p, None) == 640, "unsalted chunks are still there for unsalted requests"

    assert hit(q, "tenant-a") == 0
    assert hit(q, None) == 0, "an unsalted request does not hit salted chunks"
    assert hit(q, "tenant-a") == 640

    assert len(known(cache_name)) == 1, "only the unsalted namespace is registered"
