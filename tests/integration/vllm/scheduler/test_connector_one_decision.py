"""One decision per engine, obeyed by both halves. A worker that cannot
serve the engine (here the test switch SHMKV_TEST_WORKER_OFF; in the field a group
only the workers see, caches that cannot be registered) still answers vLLM's
protocol exactly: every delayed request is reported finished at once, every
load fails. Its start report (vLLM's handshake, before the first request)
turns the scheduler half off: no lookups, no stores, no delayed frees, one
WARNING, the connector_on gauge at 0 and the engine registry (shmkv stats)
saying why. Workers that can serve name their per-shape payload sections in
the namespace."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

import copy
import logging
from types import SimpleNamespace

import torch
from helpers import attention, connectors, engine_config, kv_cache_config, request

from shmkv import engine_registry
from shmkv.integration.vllm.metadata import ShmKVMetadata, ShmKVWorkerReport
from shmkv.testing import WORKER_OFF
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

BS = 16


@pytest.fixture(autouse=True)
def shmkv_log(caplog):
    """The records of the shmkv loggers (the connector sets up a handler of its own on them, which would
    outlive the test: handlers, propagation and level are restored after every test here)."""
    log = logging.getLogger("shmkv")
    saved = log.handlers[:], log.propagate, log.level
    log.addHandler(caplog.handler)
    log.propagate = False
    yield caplog
    log.handlers[:] = saved[0]
    log.propagate = saved[1]
    log.setLevel(saved[2])


def test_an_off_worker_answers_vllms_protocol_and_its_report_turns_the_engine_off(cache_name, tmp_path,
                                                                                   shmkv_log, monkeypatch):
    from shmkv.engines.models import write_llama

    monkeypatch.setenv(WORKER_OFF, "a worker-only reason")
    vc = engine_config(write_llama(str(tmp_path / "model")), cache_name)
    cfg = kv_cache_config({"model.layers.0.self_attn.attn": attention(2, 64),
                           "model.layers.1.self_attn.attn": attention(2, 64)})
    sched, worker = connectors(vc, cfg)
    assert sched.get_num_new_matched_tokens(request(), 0) == (0, False), "no chunk yet"

    # Before the scheduler half hears of it, a worker that is off still answers exactly:
    # the delayed request is finished at once, the synchronous load's blocks fail,
    # the asynchronous load is reported received and failed.
    unit = (GroupWindow(0, 1, (3,)),)
    meta = ShmKVMetadata(stores=[StoreItem("r", (b"k" * 16,), BS, unit)],
                         loads=[LoadItem("s", (b"k" * 16,), (GroupWindow(0, 1, (5,)),)),
                                LoadItem("a", (b"j" * 16,), (GroupWindow(0, 1, (6,)),))], async_loads={"a"})
    worker.register_kv_caches({n: torch.zeros(8, 2, BS, 128, dtype=torch.bfloat16)
                               for n in cfg.kv_cache_groups[0].layer_names})
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    results = worker.get_transfer_results({"r"})
    assert results.finished_sending == {"r"}, "a delayed free is never held by an off worker"
    assert results.failed_recving == {"a"} and "a" in results.finished_recving
    assert worker.get_block_ids_with_load_errors() == {5}
    worker.clear_connector_metadata()

    report = worker.get_handshake_metadata()
    assert isinstance(report, ShmKVWorkerReport) and "a worker-only reason" in report.off_reason
    sched.set_xfer_handshake_metadata({0: report})
    off = [r for r in shmkv_log.records if "connector off for this engine" in r.getMessage()]
    assert [r.levelname for r in off] == ["WARNING"], "once, from the scheduler half, which decided for the engine"
    assert f"TP rank 0's worker cannot serve it: {WORKER_OFF}: a worker-only reason" in \
        off[0].getMessage()
    assert sched.get_num_new_matched_tokens(request(), 0) == (0, False)
    assert not sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], num_scheduled_tokens={})).stores
    assert sched.request_finished(request(), [1, 2]) == (False, None), "an off engine never delays a free"
    assert sched.get_kv_connector_stats().data["gauges"] == {"connector_on": 0}
    assert sched.get_kv_connector_stats() is None, "the gauge is sent when it changes"
    summary = engine_registry.summary(cache_name)
    assert (summary["on"], summary["off"]) == (0, 1)
    assert f"{WORKER_OFF}: a worker-only reason" in summary["last_off"]["reason"]
    for c in (worker, sched):
        c.shutdown()


def test_a_rank_that_does_not_report_turns_the_engine_off(cache_name, tmp_path, shmkv_log):
    from shmkv.engines.models import write_llama

    vc = engine_config(write_llama(str(tmp_path / "model")), cache_name)
    vc.parallel_config.tensor_parallel_size = 2
    sched, worker = connectors(vc, kv_cache_config({"model.layers.0.self_attn.attn": attention(1, 64)}))
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata(), 1: None})
    assert sched._sched is None
    assert any("TP rank 1's worker cannot serve it: it gave no start report" in r.getMessage()
               for r in shmkv_log.records if r.levelname == "WARNING")
    for c in (worker, sched):
        c.shutdown()


def test_workers_that_serve_name_their_shape_sections_in_the_namespace(cache_name, tmp_path):
    """A drafter of head size 32 beside a target of 64, in one group: the
    scheduler half sees only the first layer's spec, the workers see both;
    from their reports the namespace names both shapes."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config

    from shmkv.engines.models import write_llama

    vc = engine_config(write_llama(str(tmp_path / "model")), cache_name)
    shapes = {"model.layers.0.self_attn.attn": (2, 64), "model.layers.1.self_attn.attn": (2, 64),
              "draft_model.model.layers.0.self_attn.attn": (2, 32)}
    workers_cfg = kv_cache_config({n: attention(h, d) for n, (h, d) in shapes.items()})
    sched, worker = connectors(vc, workers_cfg, generate_scheduler_kv_cache_config([copy.deepcopy(workers_cfg)]))
    worker.register_kv_caches({n: torch.zeros(8, h, BS, 2 * d, dtype=torch.bfloat16) for n, (h, d) in shapes.items()})
    before = sched._sched._base_ns[0].root_key()
    sched.set_xfer_handshake_metadata({0: worker.get_handshake_metadata()})
    ns = sched._sched._base_ns[0]
    assert dict(ns.extra)["kv_sections"] == "0:2x16x128/bfloat16/2;2x16x64/bfloat16/1"
    assert ns.root_key() != before, "an engine cut otherwise never shares keys with this one"
    assert sched.get_kv_connector_stats().data["gauges"] == {"connector_on": 1}
    assert engine_registry.summary(cache_name)["on"] == 1
    for c in (worker, sched):
        c.shutdown()
