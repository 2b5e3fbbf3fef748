"""An engine whose model configuration differs from another's in what shapes
K and V, on the same weight files, hits nothing of the other's chunks (#63):
config.json's rope_theta edited between two engines of one directory (a
rolling restart after an edit), and vLLM's documented YaRN override given as
hf_overrides. Each engine's own chunks still hit. (Before the configuration
was in the namespace, both loaded the first engine's 2,944 tokens.)"""

from __future__ import annotations

import json
import os

import pytest
from helpers import random_prompt

from shmkv.engines.models import TEST_MODEL, write_llama

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=13)
HIT = 2944
YARN = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096,
                            "rope_theta": 10000.0}}


def test_a_config_that_shapes_kv_never_shares_keys_with_another(cache_name, start_engine, tmp_path):
    path = write_llama(str(tmp_path / "model"), TEST_MODEL)
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    first = start_engine("config-first", model_dir=path, shmkv=cfg)
    assert first.generate([P])["num_cached_tokens"] == [0]
    assert first.generate([P])["num_cached_tokens"] == [HIT], "the same configuration hits (through shmkv)"
    first.close()

    yarn = start_engine("config-yarn", model_dir=path, shmkv=cfg, llm_kwargs={"hf_overrides": YARN})
    assert yarn.generate([P])["num_cached_tokens"] == [0], "YaRN rope scaling: none of the first engine's KV"
    assert yarn.generate([P])["num_cached_tokens"] == [HIT], "its own chunks hit"
    yarn.close()

    config_json = os.path.join(path, "config.json")
    with open(config_json) as f:
        config = json.load(f)
    config["rope_theta"] = config.get("rope_theta", 10000.0) * 100
    with open(config_json, "w") as f:
        json.dump(config, f)
    edited = start_engine("config-edited", model_dir=path, shmkv=cfg)
    assert edited.generate([P])["num_cached_tokens"] == [0], "rope_theta edited, weights untouched: a miss"
    assert edited.generate([P])["num_cached_tokens"] == [HIT]
