"""Speculative decoding with the connector on: ngram (no drafter KV),
draft_model (the target as its own drafter: its own KV layers), draft_model
with a drafter of another head size (32 drafting for 64, the target being
the drafter with widened heads, so proposals are accepted when the KV is
right; as Llama-3.2-1B drafting Llama-3.1-8B, vLLM puts both in one KV-cache
group of two shapes, copied per shape), EAGLE (a head drafting for a 1-layer
target, whose KV of a position read the next token) and EAGLE-3 (a random head beside an 8-layer target: the path, not
the drafting; it has almost nothing accepted). A second engine hits what the first stored; its greedy output and
the drafter's proposals and acceptances equal those of an engine without
shmkv that recomputed from the same split; the KV it loads (the drafter's
layers included) equals what was stored, byte for byte. With the drafter's
layers left unloaded (a test-only switch) the drafter accepts less: these
checks would catch a connector that loads the target's KV alone. An engine
with a KV drafter never shares chunks with one without it."""

from __future__ import annotations

import re

import pytest
from helpers import check_loaded_bytes_equal_stored, random_prompt

from shmkv.engines.models import TinyLlama, write_eagle, write_eagle3, write_llama, write_llama_wide_heads
from shmkv.testing import SKIP_LOAD_LAYERS

pytestmark = pytest.mark.slow

P = random_prompt(1500, seed=43)
TOKENS = 32  # enough decode steps for drafts
HIT = 1408  # 5 chunks and a 128-token piece: whole blocks below the prompt's last token
SPEC_COUNTERS = ("vllm:spec_decode_num_drafts", "vllm:spec_decode_num_draft_tokens",
                 "vllm:spec_decode_num_accepted_tokens")


DRAFTER_LAYERS = {"draft_model": r"^draft_model\.", "draft_model_small_head": r"^draft_model\.",
                  "eagle": r"layers\.1\."}  # vLLM's names of them
EAGLE3_TARGET_LAYERS = 8  # vLLM's fewest for EAGLE-3's auxiliary hidden states


@pytest.fixture(scope="module")
def small_head_dirs(tmp_path_factory) -> tuple[str, str]:
    """(a target of head size 64, a drafter of head size 32 computing the
    same function): the drafter has its proposals accepted when its KV is right."""
    drafter = write_llama(str(tmp_path_factory.mktemp("drafter-head32")),
                          TinyLlama(hidden_size=128, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=256))
    return write_llama_wide_heads(str(tmp_path_factory.mktemp("target-head64")), drafter, factor=2), drafter


@pytest.fixture(scope="module")
def eagle_dirs(tmp_path_factory) -> tuple[str, str]:
    """(a 1-layer target, an EAGLE head drafting for it)."""
    target = write_llama(str(tmp_path_factory.mktemp("eagle-target")), TinyLlama(num_hidden_layers=1))
    return target, write_eagle(str(tmp_path_factory.mktemp("eagle-head")), target)


@pytest.fixture(scope="module")
def eagle3_dirs(tmp_path_factory) -> tuple[str, str]:
    """(an 8-layer target, a random EAGLE-3 head for it)."""
    target = write_llama(str(tmp_path_factory.mktemp("eagle3-target")),
                         TinyLlama(num_hidden_layers=EAGLE3_TARGET_LAYERS))
    return target, write_eagle3(str(tmp_path_factory.mktemp("eagle3-head")), target)


def speculative_config(method: str, model_dir: str, eagle_dir: str) -> dict:
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                "prompt_lookup_min": 1}
    if method in ("draft_model", "draft_model_small_head"):
        return {"method": "draft_model", "model": eagle_dir or model_dir, "num_speculative_tokens": 3}
    return {"method": method, "model": eagle_dir, "num_speculative_tokens": 3}


def spec_counts(engine) -> dict[str, float]:
    m = engine.metrics()
    return {k: m.get(k, 0) for k in SPEC_COUNTERS}


def generate_counted(engine, prompt: list[int]) -> tuple[dict, dict[str, float]]:
    before = spec_counts(engine)
    r = engine.generate([prompt], max_tokens=TOKENS)
    after = spec_counts(engine)
    return r, {k: after[k] - before[k] for k in SPEC_COUNTERS}


def recomputed_from(engine, prompt: list[int], split: int) -> tuple[dict, dict[str, float]]:
    """The engine's own prefix cache holding `split` tokens of `prompt` (cached
    from the prompt's first split + 1 tokens, so even an EAGLE drafter's KV of
    the last cached position read the same next token), then the prompt."""
    engine.reset_prefix_cache()
    engine.generate([prompt[:split + 1]], max_tokens=1)
    r, counts = generate_counted(engine, prompt)
    assert r["num_cached_tokens"] == [split]
    return r, counts


# V1 too (conftest) for the drafters whose KV V1 handles its own way
@pytest.mark.parametrize("method", ["ngram", "draft_model",
                                    pytest.param("draft_model_small_head", marks=pytest.mark.v1),
                                    pytest.param("eagle", marks=pytest.mark.v1), "eagle3"])
def test_a_second_engine_hits_with_the_drafters_kv(method, cache_name, start_engine, model_dir, eagle_dirs,
                                                    eagle3_dirs, small_head_dirs, tmp_path):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    eagle_dir = ""
    if method in ("eagle", "eagle3", "draft_model_small_head"):
        model_dir, eagle_dir = {"eagle": eagle_dirs, "eagle3": eagle3_dirs,
                                "draft_model_small_head": small_head_dirs}[method]
    spec = {"speculative_config": speculative_config(method, model_dir, eagle_dir), "disable_log_stats": False}
    engine = {"model_dir": model_dir, "llm_kwargs": spec}

    a = start_engine(f"spec-{method}-a", shmkv=cfg, **engine)
    assert a.generate([P], max_tokens=TOKENS)["num_cached_tokens"] == [0]
    log_a = open(a.log_path).read()
    assert "connector off" not in log_a
    layers = int(re.search(r"registered (\d+) KV layers", log_a).group(1))
    assert layers == {"ngram": 2, "draft_model": 4, "draft_model_small_head": 4, "eagle": 2,
                      "eagle3": EAGLE3_TARGET_LAYERS + 1}[method], "the drafter's layers are copied too"
    if method == "draft_model_small_head":
        assert "copied per shape (sections 0:2x128x128/bfloat16/2;2x128x64/bfloat16/2)" in log_a

    b = start_engine(f"spec-{method}-b", shmkv=cfg, **engine)
    r, counts = generate_counted(b, P)
    assert r["num_cached_tokens"] == [HIT]
    assert check_loaded_bytes_equal_stored(digests) >= 5

    # vLLM's own EAGLE hits drop their last block; the reference keeps it (its KV is exact here)
    ref_spec = {**spec, "speculative_config": {**spec["speculative_config"], "disable_eagle_block_drop": True}} \
        if method in ("eagle", "eagle3") else spec
    ref = start_engine(f"spec-{method}-ref", model_dir=model_dir, shmkv=None, prefix_caching=True,
                       llm_kwargs=ref_spec)
    r_ref, counts_ref = recomputed_from(ref, P, HIT)
    assert r["outputs"] == r_ref["outputs"]
    assert counts["vllm:spec_decode_num_draft_tokens"] > 0
    assert counts == counts_ref, "the drafter proposed and had accepted the same after a hit as after recompute"
    if method in ("ngram", "eagle3"):
        return  # ngram adds no KV; a random EAGLE-3 head has (almost) nothing accepted either way
    accepted, drafted = counts["vllm:spec_decode_num_accepted_tokens"], counts["vllm:spec_decode_num_draft_tokens"]
    if method == "draft_model_small_head":  # bfloat16's rounding of the widened q scale flips a few proposals
        assert accepted >= 0.8 * drafted, "this drafter has most proposals accepted when its KV is right"
    else:
        assert accepted == drafted, "these drafters have every proposal accepted when their KV is right"

    blind = start_engine(f"spec-{method}-blind", shmkv=cfg,
                         env={SKIP_LOAD_LAYERS: DRAFTER_LAYERS[method]}, **engine)
    r_blind, counts_blind = generate_counted(blind, P)
    assert f"{SKIP_LOAD_LAYERS}={DRAFTER_LAYERS[method]!r}: loads leave" in open(blind.log_path).read()
    assert r_blind["num_cached_tokens"] == [HIT]
    assert counts_blind["vllm:spec_decode_num_accepted_tokens"] < accepted, \
        "a drafter without its KV drafts worse: the checks above would catch it"

    if method == "eagle":  # an engine without the drafter: other payloads, other keys
        plain = start_engine(f"spec-{method}-plain", model_dir=model_dir, shmkv=cfg)
        assert plain.generate([P])["num_cached_tokens"] == [0]
