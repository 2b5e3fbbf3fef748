"""KV events of the shared tier without an engine: what a router reads of a
chunk. One BlockStored per KV-cache group, each naming the blocks that group
holds of the chunk (all of them for full attention, the window's for a
sliding group, the state's block for a linear-attention group once its state
entry is stored), with vLLM's group index, spec kind, window, extra keys
(the cache salt on the first block) and session; the removal names the same
blocks per group."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from shmkv import Store
from shmkv.integration.vllm.kv_events import EventGroup, SharedTierEvents
from shmkv.integration.vllm.planner import Planner, RequestPlan
from shmkv.keys import Namespace

BS = 128
GROUPS = [EventGroup("mamba"), EventGroup("full_attention"), EventGroup("sliding_window", 160)]


def hashes(req, a: int, b: int) -> list:
    """vLLM's external form of the request's block hashes [a, b)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return [maybe_convert_block_hash(h) for h in req.block_hashes[a:b]]


def request(n: int) -> SimpleNamespace:
    return SimpleNamespace(block_hashes=[bytes([i]) * 32 for i in range(n // BS)], all_token_ids=list(range(n)),
                           lora_request=None, cache_salt="salt", mm_features=[], prompt_embeds=None,
                           session_id="s1")


def announce(events: SharedTierEvents, p: Planner, req, units) -> None:
    """What the scheduler half announces: each unit with the blocks each group holds of it."""
    events.stores_planned(req, [(u, p.group_blocks(u)) for u in units])


def test_each_group_announces_the_blocks_it_holds(cache_name):
    ns = Namespace(model_id="m", dtype="bfloat16", num_layers=3, num_kv_heads=2, head_size=64, chunk_size=256,
                   block_size=BS, attention_layout="cpu:LBHNC")
    p = Planner([ns], BS, windows=(0, 0, 160), states=(True, False, False))
    tokens = np.arange(600)
    plan = RequestPlan("r", 600, p.units(tokens))
    req = request(600)
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        events = SharedTierEvents(store, BS, GROUPS)
        first, state = plan.units[0], plan.units[1].state_unit()
        announce(events, p, req, [first, state])
        assert events.take_events() == [], "nothing is announced before it is in the segment"
        store.put(first.keys[0], b"x" * 64)
        stored = events.take_events()
        assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == \
            [(1, "full_attention", None), (2, "sliding_window", 160)]
        full, window = stored
        assert full.block_hashes == hashes(req, 0, 2) and full.parent_block_hash is None
        assert window.block_hashes == hashes(req, 0, 2), "tokens 97..255 reach into both blocks"
        assert full.token_ids == list(range(256)) and full.block_size == BS
        assert full.extra_keys == [("salt",), None], "vLLM's cache salt keys the first block only"
        assert full.session_id == "s1" and full.medium == "CPU" and full.ownership == "shmkv"
        store.put(state.keys[0], b"s" * 64)
        (st,) = events.take_events()
        assert (st.group_idx, st.kv_cache_spec_kind, st.block_hashes) == (0, "mamba", hashes(req, 3, 4))
        assert st.parent_block_hash == hashes(req, 2, 3)[0] and st.token_ids == list(range(384, 512))
        store.clear()
        removed = events.take_events()
        assert sorted((e.group_idx, tuple(e.block_hashes)) for e in removed) == \
            [(0, tuple(hashes(req, 3, 4))), (1, tuple(hashes(req, 0, 2))), (2, tuple(hashes(req, 0, 2)))]


def test_event_groups_name_vllms_spec_kinds():
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, SlidingWindowSpec

    from shmkv.integration.vllm.kv_events import event_groups_of

    attn = dict(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s) for s in (
        MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.bfloat16,), mamba_cache_mode="align"),
        FullAttentionSpec(**attn), SlidingWindowSpec(sliding_window=160, **attn))])
    assert event_groups_of(config) == GROUPS
    assert event_groups_of(None) == [EventGroup("full_attention")]
