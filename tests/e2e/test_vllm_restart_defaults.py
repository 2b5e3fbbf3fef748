"""With default settings (kv_connector_extra_config={}), engines that do not
overlap in time share the cache: engine 1 stores and exits, engine 2 starts
afterwards and hits. Engine 1 shuts down with no error in its log (the
connector used to shadow vLLM's own `_role` attribute and fail there)."""

from __future__ import annotations

import re

import pytest
from helpers import random_prompt

from shmkv import Store
from shmkv.config import default_capacity

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=11)
ERROR_LINE = re.compile(r"Traceback|AttributeError| ERROR |\bError\b.*shutdown", re.IGNORECASE)


def test_default_settings_survive_a_restart(cache_name, start_engine, reference):
    env = {"SHMKV_CACHE_NAME": cache_name}  # the test's own segment; every other setting is the default
    a = start_engine("defaults-a", shmkv={}, env=env)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]
    a.close()
    log = open(a.log_path, errors="replace").read()
    bad = [line for line in log.splitlines() if ERROR_LINE.search(line)]
    assert not bad, "errors in engine 1's log:\n" + "\n".join(bad[:20])
    assert "exists with other settings" not in log
    assert "worker connector shut down" in log and "scheduler connector shut down" in log, "shutdown ran to its end"

    b = start_engine("defaults-b", shmkv={}, env=env)
    r = b.generate([P])
    assert r["num_cached_tokens"][0] == 2944, "11 chunks and the 128-token tail piece, from engine 1"
    assert r["outputs"][0] == reference.output(P, 2944)
    st = Store.attach(cache_name, populate=False).stats()
    assert st["capacity_bytes"] == default_capacity() and st["segment_resets"] == 0
