"""Hybrid models without vLLM's engine: which KV-cache groups the connector
copies (full attention, sliding window) and which turn it off (Mamba state,
chunked local attention); what a sliding-window group stores and loads of a
unit (only the window, never vLLM's null block); and a two-group unit that
round-trips through the worker byte for byte."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.integration.vllm.engine_inputs import KVGroup, groups_field, kv_groups_of
from shmkv.integration.vllm.planner import GroupWindow, LoadItem, Planner, RequestPlan, StoreItem
from shmkv.keys import Namespace
from shmkv.tiers import TierChain
from shmkv.transfer import TransferEngine as KVWorker
from shmkv.transfer.layout import KVLayout

BS, CHUNK = 128, 256


def ns() -> Namespace:
    return Namespace(model_id="m", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64,
                     chunk_size=CHUNK, block_size=BS, attention_layout="cpu:LBHNC")


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 30000, n)


# ------------------------------------------------------------ groups ---
def _config(*specs):
    groups = [SimpleNamespace(layer_names=[f"model.layers.{i}.attn"], kv_cache_spec=s)
              for i, s in enumerate(specs)]
    return SimpleNamespace(kv_cache_groups=groups)


def _attn(cls, **kw):
    return cls(block_size=BS, num_kv_heads=2, head_size=64, dtype=torch.bfloat16, **kw)


def test_full_and_sliding_groups_are_copied():
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    groups, off = kv_groups_of(_config(_attn(SlidingWindowSpec, sliding_window=160), _attn(FullAttentionSpec)), BS)
    assert off is None
    assert groups == [KVGroup(("model.layers.0.attn",), 160), KVGroup(("model.layers.1.attn",), 0)]
    assert groups_field(groups) == (("kv_groups", "160:model.layers.0.attn;0:model.layers.1.attn"),)
    one, off = kv_groups_of(_config(_attn(FullAttentionSpec)), BS)
    assert off is None and groups_field(one) == (), "a plain model keeps its keys"


@pytest.mark.parametrize("kind", ["mamba", "chunked_local", "block_size"])
def test_state_shmkv_cannot_restore_turns_it_off_with_a_reason(kind):
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, MambaSpec

    other = {"mamba": MambaSpec(block_size=BS, shapes=((2, 3),), dtypes=(torch.bfloat16,)),
             "chunked_local": _attn(ChunkedLocalAttentionSpec, attention_chunk_size=512),
             "block_size": FullAttentionSpec(block_size=64, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)}[kind]
    groups, off = kv_groups_of(_config(_attn(FullAttentionSpec), other), BS)
    assert groups == []
    assert off.startswith("KV-cache group 1 ")
    assert ("linear-attention state (mamba2, layers" in off and "mamba_cache_mode=none" in off) if kind == "mamba" \
        else type(other).__name__ in off


# ----------------------------------------------------------- planner ---
def test_a_sliding_group_stores_only_the_units_last_window():
    p = Planner([ns()], BS, windows=(100, 160, 0))
    u = p.units(tokens(1000))[1]  # [256, 512)
    assert p.stored_blocks(u, 0) == (1, 1), "tokens 413..511 lie in the unit's second block"
    assert p.stored_blocks(u, 1) == (0, 2), "tokens 353..511 reach into its first block"
    assert p.stored_blocks(u, 2) == (0, 2)
    plan = RequestPlan("r", 1000, p.units(tokens(1000)),
                       block_ids=[list(range(10, 18)), list(range(20, 28)), list(range(30, 38))])
    first = p.store_items(plan, 1000)[1]
    assert first.tokens == 256
    assert first.groups == (GroupWindow(0, 1, (13,)), GroupWindow(0, 2, (22, 23)), GroupWindow(0, 2, (32, 33)))


def test_a_unit_whose_window_holds_vllms_null_block_is_not_stored():
    p = Planner([ns()], BS, windows=(100, 0))
    # vLLM's own prefix hit padded the sliding group's first blocks with its null block (0)
    plan = RequestPlan("r", 1000, p.units(tokens(1000)), block_ids=[[0, 0, 0, 14, 15, 16, 17], list(range(20, 27))])
    items = p.store_items(plan, 1000)
    assert [i.keys for i in items] == [u.keys for u in plan.units[1:]]
    assert plan.window_skipped == 1


def test_loads_fill_a_sliding_group_from_the_window_of_the_hit_on(cache_name):
    p = Planner([ns()], BS, windows=(160, 0))
    t = tokens(1000)
    units = p.units(t)
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        for u in units:
            store.put(u.keys[0], b"x" * 64)
        hit, found, _ = p.lookup(TierChain(store), t, units)
    assert hit == 896
    # vLLM pads the sliding group with null blocks below the window of token 896 (896 - 159 = 737: block 5)
    sliding = [0] * 5 + [15, 16, 17]
    plan = RequestPlan("r", 1000, units, hit_tokens=hit, hit_units=found, block_ids=[sliding, list(range(20, 28))])
    items = p.load_items(plan)
    assert [i.groups[0] for i in items] == [GroupWindow(2, 2, ()), GroupWindow(2, 2, ()),
                                            GroupWindow(1, 2, (15,)), GroupWindow(0, 1, (16,))]
    assert [i.groups[1].block_ids for i in items] == [(20, 21), (22, 23), (24, 25), (26,)]


@pytest.mark.parametrize("window, hit", [(160, 896), (100, 768)])
def test_a_hit_cut_inside_a_unit_keeps_it_only_if_its_window_covers_the_cut(cache_name, window, hit):
    p = Planner([ns()], BS, windows=(window, 0))
    t = tokens(1024)  # four whole chunks: vLLM's one-token rule cuts the last at 896
    units = p.units(t)
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        for u in units:
            store.put(u.keys[0], b"x" * 64)
        assert p.lookup(TierChain(store), t, units)[0] == hit


# ------------------------------------------------------------ worker ---
def test_two_groups_round_trip_through_the_worker(cache_name):
    """Like vLLM's hybrid allocator: the sliding and the full layer are views
    of one buffer, and each group has its own block ids in it."""
    src = make_cache("cpu", 1, 12, BS, 2, 8, torch.bfloat16, seed=1)[0]
    dst = make_cache("cpu", 1, 12, BS, 2, 8, torch.bfloat16, seed=2)[0]
    before = dst.clone()

    def layouts(t):
        return [KVLayout("cpu", [t], ["layer.0"]), KVLayout("cpu", [t], ["layer.1"])]

    with Store.create(cache_name, 8 << 20, alignment=256) as store:
        a = KVWorker(store, layouts(src), 0, layer_order=["layer.0", "layer.1"])
        b = KVWorker(store, layouts(dst), 0, layer_order=["layer.0", "layer.1"])
        key = b"hybrid-unit-0001"
        a.store([StoreItem("r", (key,), 2 * BS, (GroupWindow(0, 1, (5,)), GroupWindow(0, 2, (1, 2))))])
        assert a.counters["stored_units"] == 1
        assert len(store.get(key)) == 3 * src[0].numel() * src.element_size(), "one sliding block, two full ones"
        failed, done = b.load([LoadItem("q", (key,), (GroupWindow(0, 1, (9,)), GroupWindow(0, 2, (3, 4))))])
    assert failed == set() and done["q"][0] == 2 * BS
    u8 = lambda t: t.view(torch.uint8)  # noqa: E731
    assert torch.equal(u8(dst[9]), u8(src[5]))
    assert torch.equal(u8(dst[3]), u8(src[1])) and torch.equal(u8(dst[4]), u8(src[2]))
    untouched = [i for i in range(12) if i not in (3, 4, 9)]
    assert torch.equal(u8(dst[untouched]), u8(before[untouched]))


# --------------------------------------------------------- connector ---
def test_a_mamba_group_turns_the_connector_off_and_vllm_serves_as_usual(cache_name, tmp_path, caplog):
    """Both halves built as vLLM builds them for a model with a Mamba group:
    one WARNING naming the group, no segment, and neutral answers to every call."""
    import logging
    import os

    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec

    from shmkv.engines.models import write_llama
    from shmkv.integration.vllm.connector import ShmKVConnector, ShmKVMetadata

    mc = ModelConfig(model=write_llama(str(tmp_path / "model")), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=4096)
    vc = VllmConfig(model_config=mc, kv_transfer_config=KVTransferConfig(
        kv_connector="ShmKVConnector", kv_connector_module_path="shmkv.integration.vllm", kv_role="kv_both",
        kv_connector_extra_config={"cache_name": cache_name, "log_level": "info"}))
    bs = vc.cache_config.block_size
    kv_cache_config = SimpleNamespace(kv_cache_groups=[
        SimpleNamespace(layer_names=["model.layers.0.attn"], kv_cache_spec=FullAttentionSpec(
            block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)),
        SimpleNamespace(layer_names=["model.layers.1.mixer"], kv_cache_spec=MambaSpec(
            block_size=bs, shapes=((2, 3),), dtypes=(torch.bfloat16,)))])
    shmkv_log = logging.getLogger("shmkv")  # the connector logs through its own handler, not the root's
    saved = shmkv_log.propagate, shmkv_log.level
    shmkv_log.addHandler(caplog.handler)
    shmkv_log.propagate = False
    try:
        sched = ShmKVConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config)
        worker = ShmKVConnector(vc, KVConnectorRole.WORKER, kv_cache_config)
    finally:
        shmkv_log.removeHandler(caplog.handler)
        shmkv_log.propagate, shmkv_log.level = saved
    off = [r for r in caplog.records if "connector off for this engine" in r.getMessage()]
    assert [r.levelname for r in off] == ["WARNING"], "one line per engine (the scheduler's; the worker's is DEBUG)"
    assert "KV-cache group 1 holds linear-attention state (mamba2, layers model.layers.1.mixer" in off[0].getMessage()
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "no segment is created for an engine that is off"

    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(600)), num_prompt_tokens=600)
    assert sched.get_num_new_matched_tokens(request, 0) == (0, False)
    sched.update_state_after_alloc(request, None, 0)
    so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})
    meta = sched.build_connector_meta(so)
    assert isinstance(meta, ShmKVMetadata) and not meta.loads and not meta.stores
    assert sched.request_finished_all_groups(request, ([1, 2], [3])) == (False, None)
    assert sched.reset_cache() is None

    worker.register_kv_caches({"model.layers.0.attn": torch.zeros(4, 2, bs, 128, dtype=torch.bfloat16)})
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_layer_load("model.layers.0.attn")
    worker.wait_for_save()
    assert worker.get_finished({"r"}) == (None, None)
    assert worker.get_block_ids_with_load_errors() == set()
    for c in (worker, sched):
        c.shutdown()
