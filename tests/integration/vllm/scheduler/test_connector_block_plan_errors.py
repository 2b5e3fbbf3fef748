"""Finding C of the GPU path's round three: when the scheduler half cannot
read which blocks vLLM gave out again this step, its safety net treats every
pending store as reading a reused block (the workers order the compute after
all of them), counts it and logs it; it must never raise out of
build_connector_meta (vLLM's schedule() would raise and EngineCore die)."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

from types import SimpleNamespace

from helpers import attention, connectors, engine_config, kv_cache_config

from shmkv.integration.vllm.planner import ALL_BLOCKS


def test_a_step_whose_new_blocks_cannot_be_read_orders_every_pending_store(cache_name, model_dir):
    vc = engine_config(model_dir, cache_name)
    cfg = kv_cache_config({"model.layers.0.self_attn.attn": attention(2, 64),
                           "model.layers.1.self_attn.attn": attention(2, 64)})
    sched, worker = connectors(vc, cfg)
    try:
        side = sched._sched

        def unreadable(so):  # a SchedulerOutput of a vLLM whose fields moved
            raise AttributeError("'CachedRequestData' object has no attribute 'new_block_ids'")

        side._blocks_given_out = unreadable
        so = SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={}, finished_req_ids=set(),
                             preempted_req_ids=set(),
                             scheduled_cached_reqs=SimpleNamespace(req_ids=[], new_block_ids=[],
                                                                   resumed_req_ids=set(), num_computed_tokens=[]))
        meta = sched.build_connector_meta(so)
        assert meta.reused_blocks == {ALL_BLOCKS} and meta.prewritten_blocks == {ALL_BLOCKS}
        assert side.counters["block_plan_errors"] == 1
    finally:
        worker.shutdown()
        sched.shutdown()
