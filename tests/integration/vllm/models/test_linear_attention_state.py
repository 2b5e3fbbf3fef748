"""Linear-attention state (Mamba, gated delta net) without vLLM's engine:
which groups are restored (vLLM's align mode) and which turn the connector
off; the namespace names the state's kind, shapes and dtypes; a hit always
ends where a state is held (never attention KV without its state); the
states vLLM hands over are stored only at unit ends; a hit's state is loaded
into both blocks vLLM reads it from; and a state payload round-trips
through the worker byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from shmkv import Store
from shmkv.errors import InvalidArgumentError
from shmkv.integration.vllm.engine_inputs import KVGroup, groups_field, kv_groups_of
from shmkv.integration.vllm.planner import GroupWindow, Planner, RequestPlan
from shmkv.keys import Namespace, state_key
from shmkv.tiers import TierChain
from shmkv.transfer import TransferEngine
from shmkv.transfer.layout import KVLayout

BS, CHUNK = 128, 256
STATE, ATTN = 0, 1  # group order as vLLM makes it for Qwen3-Next (linear attention first)


def ns() -> Namespace:
    return Namespace(model_id="m", dtype="bfloat16", num_layers=4, num_kv_heads=4, head_size=128,
                     chunk_size=CHUNK, block_size=BS, attention_layout="cpu:LBHNC")


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n)


def _mamba(mode: str, shapes=((3, 768), (2, 128, 128)), dtypes=(torch.bfloat16, torch.float32)):
    from vllm.v1.kv_cache_interface import MambaSpec

    return MambaSpec(block_size=BS, shapes=shapes, dtypes=dtypes, mamba_type="gdn_attention",
                     mamba_cache_mode=mode)


def _config(*specs):
    return SimpleNamespace(kv_cache_groups=[SimpleNamespace(layer_names=[f"model.layers.{i}.x"], kv_cache_spec=s)
                                            for i, s in enumerate(specs)])


def _full():
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    return FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=128, dtype=torch.bfloat16)


# ------------------------------------------------------------ groups ---
def test_an_align_mode_state_group_is_restored_and_named_in_the_namespace():
    groups, off = kv_groups_of(_config(_mamba("align"), _full()), BS)
    assert off is None
    assert groups[0].state == "gdn_attention/3,768x2,128,128/bfloat16,float32" and not groups[1].state
    field = groups_field(groups)
    other, _ = kv_groups_of(_config(_mamba("align", dtypes=(torch.bfloat16, torch.bfloat16)), _full()), BS)
    assert field and field != groups_field(other), "a state of another dtype never shares chunks"
    assert groups_field([KVGroup(("a",), state="x")]) != (), "even a model of state layers alone is named"


@pytest.mark.parametrize("mode", ["none", "all"])
def test_a_state_vllm_does_not_keep_at_block_boundaries_turns_the_connector_off(mode):
    groups, off = kv_groups_of(_config(_mamba(mode), _full()), BS)
    assert groups == []
    assert f"mamba_cache_mode={mode}" in off and "linear-attention state (gdn_attention" in off
    assert "never loads attention KV without it" in off


# ------------------------------------------------------------ lookup ---
def _planner() -> Planner:
    return Planner([ns()], BS, windows=(0, 0), states=(True, False))


def test_a_hit_ends_at_the_last_unit_whose_state_is_held(cache_name):
    p = _planner()
    t = tokens(1500)
    units = p.units(t)  # 5 chunks, then the piece [1280, 1408)
    assert [u.end for u in units] == [256, 512, 768, 1024, 1280, 1408]
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        for u in units:
            store.put(u.keys[0], b"x" * 64)
        chain = TierChain(store)
        assert p.lookup(chain, t, units)[0] == 0, "attention KV without any state: no hit"
        store.put(units[2].state_unit().keys[0], b"s" * 64)
        hit, found, _ = p.lookup(chain, t, units)
        assert hit == 768
        assert [(u.start, u.end, u.state) for u in found] == [(0, 256, False), (256, 512, False),
                                                               (512, 768, False), (768, 768, True)]
        store.put(units[5].state_unit().keys[0], b"s" * 64)
        assert p.lookup(chain, t, units)[0] == 1408
        # a prompt that ends one token after the piece: vLLM computes one token, the piece's state still serves
        assert p.lookup(chain, t[:1409], p.units(t[:1409]))[0] == 1408
        # the state of a unit past vLLM's one-token rule is never used
        assert p.lookup(chain, t[:1408], p.units(t[:1408]))[0] == 768


def test_state_keys_are_not_chunk_keys():
    u = _planner().units(tokens(600))[0]
    s = u.state_unit()
    assert s.keys == (state_key(u.keys[0]),) and s.keys != u.keys and s.tokens == 0 and s.state


# ------------------------------------------------------- store / load ---
def _plan(p: Planner, n: int = 1500) -> RequestPlan:
    t = tokens(n)
    return RequestPlan("r", n, p.units(t), block_ids=[[0] * 10 + [7, 9], list(range(20, 32))], roots=(b"r" * 16,))


def test_only_the_states_at_unit_ends_of_every_state_group_are_stored():
    p = _planner()
    plan = _plan(p)
    items = p.store_state_items(plan, [(STATE, 7, 1408), (STATE, 5, 1152), (STATE, 0, 1280), (ATTN, 3, 1408)])
    assert len(items) == 1, "1152 ends no unit, block 0 is vLLM's null block, group 1 holds no state"
    it = items[0]
    assert it.keys == plan.units[5].state_unit().keys and it.tokens == 0
    assert it.groups == (GroupWindow(0, 1, (7,)), GroupWindow(0, 0, ()))
    plan.hit_tokens = 1408
    assert p.store_state_items(plan, [(STATE, 7, 1408)]) == [], "the state shmkv supplied is not stored again"


def test_the_attention_payload_of_a_unit_has_no_state_part():
    p = _planner()
    plan = _plan(p)
    items = p.store_items(plan, 1500)
    assert [it.groups[STATE] for it in items] == [GroupWindow(0, 0, ())] * 6
    assert items[-1].groups[ATTN] == GroupWindow(0, 1, (30,))


def test_a_hits_state_is_loaded_into_the_cached_block_and_the_running_one():
    p = _planner()
    plan = _plan(p)
    plan.hit_tokens, plan.scheduled_tokens = 1408, 92
    plan.hit_units = [*plan.units, plan.units[5].state_unit()]
    items = p.load_items(plan)
    state = [it for it in items if it.groups[ATTN].block_ids == ()]
    assert [it.groups[STATE].block_ids for it in state] == [(7,), (9,)], \
        "block 10 holds the state after 1,408 tokens (vLLM caches it), block 11 the running state"
    assert all(it.keys == plan.units[5].state_unit().keys for it in state)
    assert all(it.groups[STATE] == GroupWindow(0, 0, ()) for it in items if it not in state)
    plan.block_ids[STATE][11] = 0
    with pytest.raises(ValueError, match="no block 11"):
        p.load_items(plan)


# ------------------------------------------------------------ worker ---
def test_a_state_round_trips_through_the_worker(cache_name):
    """Two state layers (vLLM's int8 view of a page it shares with attention)
    beside an attention group: the state of one block comes back byte for byte
    in another engine's blocks, and the attention group is untouched."""
    pages = torch.zeros(16, 4096, dtype=torch.int8)

    def view(offset: int) -> torch.Tensor:
        return torch.as_strided(pages, (16, 1, 1, 1000), (4096, 1000, 1000, 1), offset)

    state = KVLayout("state", [view(0), view(1024)], ["l0", "l2"])
    attn_t = torch.zeros(16, 2, BS, 8, dtype=torch.bfloat16)
    attn = KVLayout("cpu", [attn_t], ["l1"])
    w = TransferEngine(Store.create(cache_name, 8 << 20, alignment=64), [state, attn], 0)
    src = torch.randint(-128, 127, (2, 1000), dtype=torch.int8)
    view(0)[3, 0, 0].copy_(src[0])
    view(1024)[3, 0, 0].copy_(src[1])
    key = state_key(b"k" * 16)
    from shmkv.transfer.items import LoadItem, StoreItem

    w.store([StoreItem("r", (key,), 0, (GroupWindow(0, 1, (3,)), GroupWindow(0, 0, ())))])
    assert w.counters["stored_units"] == 1
    assert w.cache.stats()["bytes_used"] >= 2000
    failed, loaded = w.load([LoadItem("q", (key,), (GroupWindow(0, 1, (9,)), GroupWindow(0, 0, ())))])
    assert failed == set() and loaded["q"][0] == 0, "a state holds no tokens"
    assert torch.equal(view(0)[9, 0, 0], src[0]) and torch.equal(view(1024)[9, 0, 0], src[1])
    assert not attn_t.any() and not pages[:, 1000:1024].any() and not pages[:, 2024:].any()
    w.shutdown()
    w.cache.close()


def test_a_state_layout_needs_each_blocks_state_contiguous():
    t = torch.zeros(16, 4, 8, dtype=torch.int8).transpose(1, 2)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        KVLayout("state", [t])
