"""The connector's scheduler-side planning, without vLLM: units, lookups with
tail pieces, load windows and store plans against a real store."""

from __future__ import annotations

import numpy as np
import pytest

from shmkv import Store
from shmkv.integration.vllm.planner import GroupWindow, Planner, RequestPlan
from shmkv.keys import Namespace
from shmkv.tiers import TierChain

BS, CHUNK = 128, 256


def ns(rank: int = 0, tp: int = 1, salt: str | None = None) -> Namespace:
    return Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                     chunk_size=CHUNK, tp_size=tp, tp_rank=rank, block_size=BS, attention_layout="cpu:LBHNC",
                     cache_salt=salt)


@pytest.fixture
def store(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as s:
        yield s


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n)


def put_units(store, units) -> None:
    for u in units:
        for k in u.keys:
            store.put(k, b"x" * 64)


def test_units_are_full_chunks_then_a_block_aligned_piece():
    p = Planner([ns()], BS)
    units = p.units(tokens(3000))
    assert [(u.start, u.end) for u in units] == [(i * 256, (i + 1) * 256) for i in range(11)] + [(2816, 2944)]
    assert len({u.keys for u in units}) == 12
    assert [(u.start, u.end) for u in Planner([ns()], BS, store_tail=False).units(tokens(3000))][-1] == (2560, 2816)
    assert Planner([ns()], BS).units(tokens(100)) == [], "no whole block: nothing to store"


def test_lookup_hits_full_chunks_and_the_tail_piece(store):
    p = Planner([ns()], BS)
    t = tokens(3000)
    put_units(store, p.units(t))
    hit, units, _ = p.lookup(TierChain(store), t, p.units(t))
    assert hit == 2944 and units[-1].end == 2944


def test_lookup_never_returns_the_whole_prompt(store):
    p = Planner([ns()], BS)
    t = tokens(2944)  # 11 chunks + 1 block: everything cacheable
    put_units(store, p.units(t))
    hit, _, _ = p.lookup(TierChain(store), t, p.units(t))
    assert hit == 2816, "one block is left for vLLM to compute"


def test_longer_prompt_reuses_the_stored_tail_piece(store):
    p = Planner([ns()], BS)
    first = tokens(3000)
    put_units(store, p.units(first))
    longer = np.concatenate([first, tokens(500, seed=1)])
    hit, units, _ = p.lookup(TierChain(store), longer, p.units(longer))
    assert hit == 2944, "the piece stored for the shorter prompt extends the hit"
    plan = RequestPlan("r", len(longer), p.units(longer), hit_tokens=hit, hit_units=units,
                       block_ids=[list(range(100, 130))])
    items = p.load_items(plan)
    assert [i.keys for i in items][-1] == units[-1].keys
    assert items[-1].groups == (GroupWindow(0, 1, (122,)),)


def test_shared_prefix_hits_exactly_the_shared_full_chunks(store):
    p = Planner([ns()], BS)
    a = tokens(3000)
    put_units(store, p.units(a))
    b = np.concatenate([a[:2000], tokens(1000, seed=7)])
    hit, _, _ = p.lookup(TierChain(store), b, p.units(b))
    assert hit == 7 * 256


def test_load_window_starts_after_vllms_own_hit(store):
    p = Planner([ns()], BS)
    t = tokens(3000)
    units = p.units(t)
    put_units(store, units)
    hit, found, _ = p.lookup(TierChain(store), t, units)
    plan = RequestPlan("r", 3000, units, local_tokens=384, hit_tokens=hit - 384, hit_units=found,
                       block_ids=[list(range(1000, 1024))])
    items = p.load_items(plan)
    assert items[0].groups == (GroupWindow(1, 2, (1003,)),)
    assert sum(len(i.block_ids) for i in items) == (2944 - 384) // BS


def test_store_plan_follows_chunked_prefill_and_skips_hits():
    p = Planner([ns()], BS)
    t = tokens(3000)
    plan = RequestPlan("r", 3000, p.units(t), block_ids=[list(range(100, 124))])
    assert [(i.tokens, i.groups) for i in p.store_items(plan, 600)] == [
        (256, (GroupWindow(0, 2, (100, 101)),)), (256, (GroupWindow(0, 2, (102, 103)),))]
    assert p.store_items(plan, 600) == [], "each unit is planned once"
    rest = p.store_items(plan, 3000)
    assert len(rest) == 10 and rest[-1].tokens == 128 and rest[-1].groups == (GroupWindow(0, 1, (122,)),)
    hit_plan = RequestPlan("h", 3000, p.units(t), hit_tokens=2944, block_ids=[list(range(100, 124))])
    assert p.store_items(hit_plan, 3000) == [], "loaded units are not stored again"


def test_store_plan_waits_for_blocks_to_exist():
    p = Planner([ns()], BS)
    plan = RequestPlan("r", 3000, p.units(tokens(3000)), block_ids=[[1, 2, 3]])
    assert len(p.store_items(plan, 3000)) == 1


def test_tensor_parallel_ranks_have_their_own_keys_and_all_must_hit(store):
    p = Planner([ns(0, 2), ns(1, 2)], BS)
    t = tokens(1024)
    units = p.units(t)
    assert all(u.keys[0] != u.keys[1] for u in units)
    for u in units:
        store.put(u.keys[0], b"r0" * 32)
    assert p.lookup(TierChain(store), t, units)[0] == 0, "rank 1 has nothing"
    for u in units[:2]:
        store.put(u.keys[1], b"r1" * 32)
    assert p.lookup(TierChain(store), t, units)[0] == 512


def test_salted_requests_do_not_share(store):
    plain, salted = Planner([ns()], BS), Planner([ns(salt="tenant-a")], BS)
    t = tokens(1024)
    put_units(store, plain.units(t))
    assert salted.lookup(TierChain(store), t, salted.units(t))[0] == 0
    put_units(store, salted.units(t))
    other = Planner([ns(salt="tenant-b")], BS)
    assert other.lookup(TierChain(store), t, other.units(t))[0] == 0


def test_lookup_continues_into_the_disk_tier(store, tmp_path):
    from shmkv.tiers.disk.tier import DiskTier

    disk = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 30)
    p = Planner([ns()], BS)
    t = tokens(3000)
    units = p.units(t)
    for u in units[:3]:
        store.put(u.keys[0], b"m" * 64)
    for u in units[3:8]:
        disk.write(u.keys[0], b"n" * 16, b"d" * 64)
    hit, found, on_disk = p.lookup(TierChain(store, [disk]), t, units)
    assert hit == 8 * 256 and [u.start for u in on_disk] == [768, 1024, 1280, 1536, 1792]
    assert p.lookup(TierChain(store), t, units)[0] == 768, "without the disk tier the prefix ends in memory"
    disk.write(units[-1].keys[0], b"n" * 16, b"d" * 64)  # the tail piece alone does not extend it
    assert p.lookup(TierChain(store, [disk]), t, units)[0] == 8 * 256
