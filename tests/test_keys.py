"""Prefix-chained chunk keys: determinism, prefix sharing, namespace coverage."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
import xxhash
from helpers import REPO
from hypothesis import given, settings
from hypothesis import strategies as st

from shmkv.errors import ConfigError
from shmkv.keys import Namespace, chain_key, chunk_keys, piece_key

NS = Namespace(model_id="llama-test", dtype="bfloat16", num_layers=2, num_kv_heads=2,
               head_size=64, block_size=128, attention_layout="cpu:LBHNC", isa="vec")
TOKENS = list(range(1000, 1000 + 1000))


def test_definition_k0_and_chain():
    keys = chunk_keys(NS, TOKENS)
    k0 = xxhash.xxh3_128_digest(NS.encode())
    assert NS.root_key() == k0
    k1 = xxhash.xxh3_128_digest(k0 + np.asarray(TOKENS[:256], "<u4").tobytes())
    assert keys[0] == (0, 256, k1)
    assert keys[1][2] == chain_key(k1, TOKENS[256:512])
    assert [(s, e) for s, e, _ in keys] == [(0, 256), (256, 512), (512, 768)], "full chunks only"
    assert all(len(k) == 16 for _, _, k in keys)


def test_shared_prefix_shares_keys_and_divergence_changes_all_later():
    other = TOKENS[:600] + [7] * 400
    a, b = chunk_keys(NS, TOKENS), chunk_keys(NS, other)
    assert a[:2] == b[:2]
    assert a[2][2] != b[2][2]
    changed_first = [99] + TOKENS[1:]
    assert all(x[2] != y[2] for x, y in zip(a, chunk_keys(NS, changed_first)))


def test_every_namespace_field_changes_the_root():
    roots = {NS.root_key()}
    changes = dict(model_id="other", dtype="float16", num_layers=3, num_kv_heads=4, head_size=128,
                   chunk_size=512, mla=True, tp_size=2, tp_rank=1, payload="tokens",
                   attention_layout="cuda:NHD", block_size=256, isa="amx", format_version=2,
                   cache_salt="tenant-a", extra=(("k", "v"),))
    for name, value in changes.items():
        if name == "tp_rank":
            ns = dataclasses.replace(NS, tp_size=2, tp_rank=1)
        else:
            ns = dataclasses.replace(NS, **{name: value})
        roots.add(ns.root_key())
    assert len(roots) == len(changes) + 1


def test_token_payload_namespace_ignores_block_size():
    a = dataclasses.replace(NS, payload="tokens", block_size=16)
    b = dataclasses.replace(NS, payload="tokens", block_size=128)
    assert a.root_key() == b.root_key(), "canonical payloads are shared across block sizes"


def test_salt_separates_tenants():
    assert NS.with_salt("a").root_key() != NS.with_salt("b").root_key() != NS.root_key()
    assert NS.with_salt(None) is NS


def test_namespace_encoding_is_unambiguous():
    tricky = dataclasses.replace(NS, model_id='x","dtype":"float16')
    assert json.loads(tricky.encode())["model_id"] == 'x","dtype":"float16'
    assert tricky.root_key() != dataclasses.replace(NS, model_id="x", dtype="float16").root_key()


def test_piece_key_differs_from_chunk_key():
    full = chunk_keys(NS, TOKENS)
    piece = piece_key(full[0][2], TOKENS[256:384])
    assert piece != full[1][2]
    assert piece == piece_key(full[0][2], np.asarray(TOKENS[256:384], dtype=np.int64))


def test_bad_inputs():
    with pytest.raises(ValueError, match="2\\^32"):
        chunk_keys(NS, [-1, 2, 3])
    with pytest.raises(ValueError, match="1-D"):
        chunk_keys(NS, [[1, 2]])
    with pytest.raises(ConfigError, match="tp_rank"):
        dataclasses.replace(NS, tp_size=2, tp_rank=2)
    with pytest.raises(ConfigError, match="multiple of block_size"):
        dataclasses.replace(NS, chunk_size=200)
    assert chunk_keys(NS, []) == []


def test_keys_identical_across_interpreters_and_hash_seeds():
    code = (
        "from shmkv.keys import Namespace, chunk_keys\n"
        "ns = Namespace(model_id='llama-test', dtype='bfloat16', num_layers=2, num_kv_heads=2,"
        " head_size=64, block_size=128, attention_layout='cpu:LBHNC', isa='vec', cache_salt='s')\n"
        "print(','.join(k.hex() for _, _, k in chunk_keys(ns, list(range(1000, 2000)))))\n"
    )
    outs = set()
    for seed in ("1", "12345"):
        env = dict(os.environ, PYTHONHASHSEED=seed, PYTHONPATH=REPO)
        outs.add(subprocess.check_output([sys.executable, "-c", code], env=env, text=True).strip())
    assert len(outs) == 1
    here = ",".join(k.hex() for _, _, k in chunk_keys(NS.with_salt("s"), TOKENS))
    assert outs == {here}


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=40) | st.none(), st.text(max_size=40) | st.none(),
       st.binary(min_size=1024, max_size=2048), st.binary(min_size=1024, max_size=2048))
def test_no_choice_of_tokens_or_salt_reaches_another_namespace(salt_a, salt_b, toks_a, toks_b):
    """The salt is inside the canonical JSON hashed into the root, so any two
    different salts (quotes, braces, unicode included) give different roots,
    and token ids only ever enter after the root."""
    toks_a = np.frombuffer(toks_a[:len(toks_a) // 4 * 4], "<u4")
    toks_b = np.frombuffer(toks_b[:len(toks_b) // 4 * 4], "<u4")
    a, b = NS.with_salt(salt_a), NS.with_salt(salt_b)
    assert json.loads(a.encode())["cache_salt"] == salt_a, "the encoding round-trips: it is injective"
    if salt_a != salt_b:
        assert a.encode() != b.encode() and a.root_key() != b.root_key()
        ka, kb = chunk_keys(a, toks_a), chunk_keys(b, toks_b)
        assert not {k for _, _, k in ka} & {k for _, _, k in kb}
