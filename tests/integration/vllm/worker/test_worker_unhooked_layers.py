"""Finding B of the GPU path's round three: vLLM calls wait_for_layer_load
from its attention ops alone. A KV-cache layer read by another op (DeepSeek-
V3.2's indexer cache, read by sparse_attn_indexer before that layer's
attention) would read a partly loaded cache on a piecewise or eager step:
such layers make a step with synchronous loads wait for every layer before
the forward. Shown on the device-like stream model, and the classification
of layers on vLLM's own classes."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import torch
from device_model import DeviceModel
from kv_reference import make_cache
from worker_steps import BLOCKS, BS, loaded, step, stored

from shmkv.config import load_config
from shmkv.integration.vllm.connector import layers_read_without_hooks
from shmkv.integration.vllm.engine_inputs import KVGroup
from shmkv.integration.vllm.worker import WorkerSide

ATTN, INDEXER = "model.layers.0.self_attn.attn", "model.layers.0.self_attn.indexer.k_cache"


def worker(store, dev: DeviceModel, seed: int) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    caches = dict(zip([ATTN, INDEXER], make_cache("cpu", 2, BLOCKS, BS, 2, 8, torch.bfloat16, seed=seed)))
    for n, t in caches.items():
        dev.name_tensor(t, n)
    side = WorkerSide(load_config({"cache_name": store.name}, env={}), store, [KVGroup((ATTN, INDEXER))], 0, BS,
                      backend=dev)
    side.register_kv_caches(caches)
    assert side.worker is not None, side.off_reason
    return side, caches


def forward(side: WorkerSide, dev: DeviceModel, caches, blocks: list[int]) -> None:
    """Layer 0 as DeepSeek-V3.2 runs it: the indexer op reads its cache (no
    hook), then the attention op waits for its layer and reads its cache."""
    dev.compute("sparse_attn_indexer", touches=[(caches[INDEXER], blocks, "r")])
    side.wait_layer(ATTN)
    dev.compute("attention", touches=[(caches[ATTN], blocks, "r")])


@pytest.mark.parametrize("rule", [True, False])
@pytest.mark.parametrize("seed", range(4))
def test_a_layer_read_without_the_hook_is_loaded_before_the_forward(cache_name, seed, rule):
    from shmkv import Store

    store = Store.create(cache_name, 16 << 20, alignment=256)
    try:
        writer, _ = worker(store, DeviceModel(seed=seed), seed + 10)
        writer.worker.store([stored("w", b"k" * 16, 3, 4)])
        dev = DeviceModel(seed=seed, query_progress=0.0)
        side, caches = worker(store, dev, seed)
        if rule:
            side.set_read_without_hooks([INDEXER])
        meta = step(loads=[loaded("q", b"k" * 16, 8, 9)])
        side.bind(meta)
        side.start_load(meta)
        forward(side, dev, caches, [8, 9])
        side.wait_for_save(meta)
        if rule:
            assert dev.violations == [] and side.worker.counters["whole_forward_loads"] == 1
        else:
            assert any("sparse_attn_indexer" in v.later and "load" in v.earlier for v in dev.violations), \
                "without the rule the indexer reads blocks before their load (the finding)"
        side.shutdown()
        writer.shutdown()
    finally:
        store.close()


def test_vllms_attention_ops_are_hooked_and_an_indexer_cache_is_not():
    from vllm.model_executor.layers.attention.attention import Attention
    from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    ctx = {"l0.attn": object.__new__(Attention), "l0.mla": object.__new__(MLAAttention),
           INDEXER: object.__new__(DeepseekV32IndexerCache), "l1.mamba": object.__new__(DeepseekV32IndexerCache)}
    names = [*ctx, "not.in.context"]
    assert layers_read_without_hooks(ctx, names, {"l1.mamba"}) == [INDEXER]
