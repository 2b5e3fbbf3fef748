"""An engine restarted on new weights under the same model path (a new
checkpoint, weights written out after an RL step) hits nothing that the old
weights computed: the namespace holds the weights' identity, not only their
path (shmkv's tier outlives the engine, vLLM's own prefix cache does not)."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv.engines.models import TEST_MODEL, TinyLlama, write_llama

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=12)


def test_an_engine_on_new_weights_under_the_same_path_hits_nothing_of_the_old(cache_name, start_engine, tmp_path):
    path = write_llama(str(tmp_path / "model"), TEST_MODEL)
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    old = start_engine("weights-old", model_dir=path, shmkv=cfg)
    assert old.generate([P])["num_cached_tokens"] == [0]
    assert old.generate([P])["num_cached_tokens"] == [2944], "the same weights hit (through shmkv: no prefix cache)"
    write_llama(path, TinyLlama(seed=1))  # new weights, same path, same shapes
    new = start_engine("weights-new", model_dir=path, shmkv=cfg)
    r = new.generate([P])
    assert r["num_cached_tokens"] == [0], "no chunk of the old weights is loaded into the new ones"
    assert new.generate([P])["num_cached_tokens"] == [2944], "the new weights' own chunks hit"
