"""Chunks of an engine whose drafter (EAGLE, MTP) read tokens past a chunk's
end: keyed with those tokens, chained without them, never made where the
prompt lacks them; the planner never stores or loads such a chunk."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv.chunking import Chunker
from shmkv.integration.vllm.planner import Planner
from shmkv.keys import Namespace, lookahead_key
from shmkv.tiers import TierChain

CHUNK, BS = 256, 128
ROOT = Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                 chunk_size=CHUNK, block_size=BS).root_key()


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(3, 4000, n)


def test_a_chunk_is_keyed_with_the_tokens_after_it_and_chains_without_them():
    t = tokens(700)
    plain = Chunker([ROOT], CHUNK, BS).units(t)
    ahead = Chunker([ROOT], CHUNK, BS, lookahead=1).units(t)
    assert [(u.start, u.end) for u in ahead] == [(u.start, u.end) for u in plain] == [(0, 256), (256, 512),
                                                                                        (512, 640)]
    for p, a in zip(plain, ahead):
        assert a.chain == p.keys, "the chain (what later units hash from) is the exact one"
        assert a.keys == (lookahead_key(p.keys[0], t[a.end:a.end + 1]),)
        assert a.keys != p.keys


def test_the_token_after_a_chunk_changes_its_key_and_nothing_before_it():
    t = tokens(700)
    u = t.copy()
    u[256] = (t[256] + 1) % 4000  # the first token of the second chunk
    a = Chunker([ROOT], CHUNK, BS, lookahead=1).units(t)
    b = Chunker([ROOT], CHUNK, BS, lookahead=1).units(u)
    assert a[0].chain == b[0].chain, "the first chunk's tokens are equal"
    assert a[0].keys != b[0].keys, "its drafter KV read another token"
    assert all(x.keys != y.keys for x, y in zip(a[1:], b[1:]))


@pytest.mark.parametrize("lookahead", [1, 3])
def test_a_unit_whose_lookahead_is_not_in_the_prompt_is_not_made(lookahead):
    c = Chunker([ROOT], CHUNK, BS, lookahead=lookahead)
    assert [(u.start, u.end) for u in c.units(tokens(512))] == [(0, 256)], \
        "the second chunk ends the prompt: its drafter KV read a sampled token"
    assert [(u.start, u.end) for u in c.units(tokens(512 + lookahead))] == [(0, 256), (256, 512)]
    assert [(u.start, u.end) for u in c.units(tokens(640 + lookahead - 1))] == [(0, 256), (256, 512)], \
        "the 128-token piece lacks one lookahead token"
    assert [(u.start, u.end) for u in c.units(tokens(640 + lookahead))][-1] == (512, 640)
    assert [u.end for u in c.piece_candidates(tokens(640), 512, (ROOT,))] == ([640] if lookahead == 0 else [])


def test_lookahead_keys_never_equal_plain_ones():
    t = tokens(600)
    plain = {k for u in Chunker([ROOT], CHUNK, BS).units(t) for k in u.keys}
    for n in (1, 2):
        ahead = {k for u in Chunker([ROOT], CHUNK, BS, lookahead=n).units(t) for k in u.keys}
        assert not plain & ahead
    one = [u.keys for u in Chunker([ROOT], CHUNK, BS, lookahead=1).units(t)]
    two = [u.keys for u in Chunker([ROOT], CHUNK, BS, lookahead=2).units(t)]
    assert all(a != b for a, b in zip(one, two))


def test_a_planner_with_lookahead_hits_only_where_the_next_token_matches(small_store):
    chain = TierChain(small_store)
    planner = Planner([ROOT], BS, chunk_size=CHUNK, lookahead=1)
    p = tokens(1000)
    for u in planner.units(p):
        small_store.put(u.keys[0], b"x" * 64)
    q = p.copy()
    q[512] = (p[512] + 1) % 4000
    hit, units, _ = planner.lookup(chain, q, planner.units(q))
    assert hit == 256, "chunk 2 read token 512 as stored; this prompt has another one there"
    assert [u.end for u in units] == [256]
    hit, _, _ = planner.lookup(chain, p, planner.units(p))
    assert hit == 896, "3 chunks and the 128-token piece (the next piece lacks its lookahead token)"
