"""Everything that makes KV differ is in the key: a difference in token ids,
cache salt, LoRA adapter, a multimodal item's identifier or offset, or a
prompt embedding changes the key of the first chunk it affects and of every
chunk after it, and of nothing before it. Requests without such inputs keep
the keys they always had."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from shmkv.chunking import Chunker
from shmkv.integration.vllm.engine_inputs import prompt_tokens, request_extras
from shmkv.keys import ExtraInputs, MultiModalItem, Namespace, chunk_keys, piece_key

CHUNK, BLOCK, N = 32, 16, 32 * 6 + 16  # six chunks and a tail piece
BASE = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, chunk_size=CHUNK,
                 block_size=BLOCK)


def keys_of(tokens, ns=BASE, extras=None) -> list[bytes]:
    return [u.keys[0] for u in Chunker([ns.root_key()], ns.chunk_size, BLOCK).units(np.asarray(tokens), extras)]


def assert_changes_from(a: list[bytes], b: list[bytes], unit: int) -> None:
    assert a[:unit] == b[:unit], "chunks before the difference keep their keys"
    assert all(x != y for x, y in zip(a[unit:], b[unit:])), "every chunk from the difference on changes"


def test_requests_without_extra_inputs_keep_their_keys():
    toks = list(range(N))
    plain = [k for _, _, k in chunk_keys(BASE, toks)]
    assert [k for _, _, k in chunk_keys(BASE, toks, extras=ExtraInputs())] == plain
    assert keys_of(toks, extras=ExtraInputs())[:6] == plain == keys_of(toks)[:6]


@settings(max_examples=200, deadline=None)
@given(tokens=st.lists(st.integers(0, 50_000), min_size=N, max_size=N),
       what=st.sampled_from(["token", "salt", "lora", "mm_id", "mm_offset", "embeds"]),
       where=st.integers(0, N - 1), data=st.data())
def test_any_difference_changes_every_key_from_the_first_affected_chunk(tokens, what, where, data):
    mm_a = (MultiModalItem("img-a", where, 8),)
    base_extras = ExtraInputs(mm=mm_a) if what.startswith("mm") else None
    embeds = np.random.default_rng(0).standard_normal((N, 8)).astype(np.float32)
    if what == "embeds":
        base_extras = ExtraInputs(embeds=embeds)
    a = keys_of(tokens, extras=base_extras)
    unit = min(where // CHUNK, 6)
    if what == "token":
        t2 = list(tokens)
        t2[where] = (t2[where] + data.draw(st.integers(1, 1000))) % 50_001
        b = keys_of(t2)
    elif what == "salt":
        b, unit = keys_of(tokens, ns=BASE.with_salt(data.draw(st.text(min_size=1, max_size=8)))), 0
    elif what == "lora":
        lora = (("lora_name", "adapter"), ("lora_digest", data.draw(st.text(min_size=1, max_size=8))))
        b, unit = keys_of(tokens, ns=Namespace(**{**BASE.__dict__, "extra": lora})), 0
    elif what == "mm_id":
        b = keys_of(tokens, extras=ExtraInputs(mm=(MultiModalItem("img-b", where, 8),)))
    elif what == "mm_offset":
        shift = data.draw(st.integers(1, 7))
        b = keys_of(tokens, extras=ExtraInputs(mm=(MultiModalItem("img-a", where - shift, 8 + shift),)))
        unit = min((where - shift) // CHUNK, 6) if where - shift >= 0 else 0
    else:
        e2 = embeds.copy()
        e2[where, data.draw(st.integers(0, 7))] += 1.0
        b = keys_of(tokens, extras=ExtraInputs(embeds=e2))
    assert_changes_from(a, b, unit)


def test_a_piece_with_extra_inputs_is_not_a_plain_piece_or_chunk():
    toks = np.arange(CHUNK)
    root = BASE.root_key()
    with_extra = piece_key(root, toks[:BLOCK], ExtraInputs(mm=(MultiModalItem("x", 0, 4),)).for_range(0, BLOCK))
    assert with_extra != piece_key(root, toks[:BLOCK])
    assert with_extra not in {k for _, _, k in chunk_keys(root, toks, CHUNK)}


def test_an_item_spanning_two_chunks_is_in_both():
    ex = ExtraInputs(mm=(MultiModalItem("img", CHUNK - 4, 8),))
    assert b"img" in ex.for_range(0, CHUNK) and b"img" in ex.for_range(CHUNK, 2 * CHUNK)
    assert ex.for_range(2 * CHUNK, 3 * CHUNK) == b""
    assert b'"img",-4' in ex.for_range(CHUNK, 2 * CHUNK), "offset relative to the chunk, as vLLM's block hash"


# ------------------------------------------------- from vLLM's Request fields --
def fake_request(**kw):
    base = dict(num_prompt_tokens=64, prompt_token_ids=list(range(64)), prompt_is_token_ids=None,
                all_token_ids=list(range(64)), mm_features=[], prompt_embeds=None, lora_request=None)
    base.update(kw)
    return SimpleNamespace(**base)


def test_request_extras_from_multimodal_features_and_embeddings():
    feat = SimpleNamespace(identifier="abc123", mm_position=SimpleNamespace(offset=10, length=20))
    ex = request_extras(fake_request(mm_features=[feat]))
    assert ex.mm == (MultiModalItem("abc123", 10, 20),)
    assert request_extras(fake_request()) is None
    emb = torch.randn(64, 16, dtype=torch.bfloat16)
    req = fake_request(prompt_token_ids=None, prompt_embeds=emb, all_token_ids=[0] * 64)
    ex = request_extras(req)
    assert ex.embeds.shape == (64, 32)
    assert prompt_tokens(req).tolist() == [0] * 64
    emb2 = emb.clone()
    emb2[40, 3] += 1
    ex2 = request_extras(fake_request(prompt_token_ids=None, prompt_embeds=emb2, all_token_ids=[0] * 64))
    assert ex.for_range(0, 32) == ex2.for_range(0, 32) and ex.for_range(32, 64) != ex2.for_range(32, 64)


@pytest.mark.parametrize("mask", [[True] * 32 + [False] * 32])
def test_mixed_prompts_hash_which_positions_are_embeddings(mask):
    emb = torch.zeros(64, 8)
    a = request_extras(fake_request(prompt_embeds=emb, prompt_is_token_ids=mask))
    b = request_extras(fake_request(prompt_embeds=emb, prompt_is_token_ids=[not m for m in mask]))
    assert a.for_range(0, 32) != b.for_range(0, 32)
