"""Prompts given as embeddings (vLLM's enable_prompt_embeds): their token ids
are all placeholders, so the embeddings themselves must key the chunks.
Equal embeddings hit in another engine; embeddings that differ from some row
on hit only the chunks before it."""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS

from shmkv.engines.models import TEST_MODEL

pytestmark = pytest.mark.slow

KW = {"enable_prompt_embeds": True}
E1 = {"seed": 5, "n": 700, "hidden": TEST_MODEL.hidden_size}
E2 = {**E1, "change_from": 600, "change_seed": 6}  # differs inside the third chunk (512..768)


def test_equal_embeddings_hit_and_different_ones_do_not(cache_name, start_engine):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}
    ref = start_engine("embeds-ref", shmkv=None, llm_kwargs=KW)
    cold = ref.generate_embeds([E1, E2])
    a = start_engine("embeds-a", shmkv=cfg, llm_kwargs=KW)
    r = a.generate_embeds([E1])
    assert r["num_cached_tokens"] == [0] and r["outputs"][0] == cold["outputs"][0]

    b = start_engine("embeds-b", shmkv=cfg, llm_kwargs=KW)
    r = b.generate_embeds([E1])
    assert r["num_cached_tokens"] == [640], "2 chunks of 256 and a 128-token piece, from engine a"
    assert len(r["outputs"][0]) == E2E_TOKENS
    r = b.generate_embeds([E2])
    assert r["num_cached_tokens"] == [512], "equal placeholder ids, different embeddings from row 600 on"
    assert r["outputs"][0] == cold["outputs"][1]
