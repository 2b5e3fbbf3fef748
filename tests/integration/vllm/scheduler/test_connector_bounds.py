"""The scheduler half's per-namespace state stays bounded whatever the number
of tenants (cache salts) and adapters: the most recent planners are cached.
A connector reset removes nothing (scheduler.reset_cache)."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import logging
from types import SimpleNamespace

import torch

import shmkv.integration.vllm.scheduler as sched_mod
from shmkv import Store


def test_planners_and_roots_are_bounded(cache_name, tmp_path, monkeypatch, caplog):
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from shmkv.engines.models import write_llama
    from shmkv.integration.vllm.connector import ShmKVConnector

    monkeypatch.setattr(sched_mod, "MAX_PLANNERS", 4)
    mc = ModelConfig(model=write_llama(str(tmp_path / "model")), skip_tokenizer_init=True, dtype="bfloat16",
                     max_model_len=4096)
    vc = VllmConfig(model_config=mc, kv_transfer_config=KVTransferConfig(
        kv_connector="ShmKVConnector", kv_connector_module_path="shmkv.integration.vllm", kv_role="kv_both",
        kv_connector_extra_config={"cache_name": cache_name, "capacity": "64MiB", "maintainer": False}))
    bs = vc.cache_config.block_size
    kv_cache_config = SimpleNamespace(kv_cache_groups=[SimpleNamespace(
        layer_names=[f"model.layers.{i}.self_attn.attn" for i in range(2)],
        kv_cache_spec=FullAttentionSpec(block_size=bs, num_kv_heads=2, head_size=64, dtype=torch.bfloat16))])
    shmkv_log = logging.getLogger("shmkv")  # the connector sets up its own handler on it: restored below
    saved = shmkv_log.handlers[:], shmkv_log.propagate, shmkv_log.level
    conn = ShmKVConnector(vc, KVConnectorRole.SCHEDULER, kv_cache_config)
    side = conn._sched
    shmkv_log.addHandler(caplog.handler)
    try:
        roots = [side._planner(f"tenant-{i}").roots[0] for i in range(20)]
        assert len(side._planners) == 4
        with Store.attach(cache_name) as store:
            for i in (0, 19):  # an old tenant's chunk and a recent one's
                store.put(bytes([i]) * 16, b"x" * 4096, namespace=roots[i])
            assert side.reset_cache() is True
            assert store.contains([bytes([0]) * 16, bytes([19]) * 16]) == [True, True], "a reset removes nothing"
        assert [r.levelname for r in caplog.records if "POST /clear" in r.getMessage()] == ["INFO"]
    finally:
        conn.shutdown()
        shmkv_log.handlers[:], shmkv_log.propagate = saved[0], saved[1]
        shmkv_log.setLevel(saved[2])
