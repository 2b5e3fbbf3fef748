"""The connector loads by its name alone (the `vllm.general_plugins` entry
point registers it), and vLLM's reset_prefix_cache(reset_connector=True)
removes nothing from shmkv (other engines share it; clearing is the
operator's act: POST /clear)."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv.engines.models import TinyLlama, write_llama

pytestmark = pytest.mark.slow

P = random_prompt(700, seed=31)


def test_plugin_name_and_reset_cache(cache_name, start_engine, tmp_path):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    a = start_engine("plugin-a", shmkv=cfg, module_path=None)  # kv_connector="ShmKVConnector" only
    assert a.generate([P])["num_cached_tokens"] == [0]
    other = write_llama(str(tmp_path / "other-model"), TinyLlama(seed=7))
    b = start_engine("plugin-b", shmkv=cfg, module_path=None, model_dir=other)
    assert b.generate([P])["num_cached_tokens"] == [0], "another model: another namespace"
    a.reset_prefix_cache()
    assert a.generate([P])["num_cached_tokens"] == [640], "shmkv still has it"
    assert a.reset_prefix_cache(connector=True) is True
    assert a.generate([P])["num_cached_tokens"] == [640], "a connector reset removes nothing shared"
    b.reset_prefix_cache(connector=True)
    assert b.generate([P])["num_cached_tokens"] == [640], "the other engine's chunks stay too"
