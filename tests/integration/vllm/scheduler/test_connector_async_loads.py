"""Loads of an engine with several KV-cache groups (hybrids) without vLLM's
engine. vLLM stops such an engine on a block-level load failure (it cannot
map a block id to a request across groups), so there shmkv loads
asynchronously: each request is reported once in finished_recving when its
copies have run, and one that failed (a chunk evicted since the lookup, a
load that could not be planned, a worker that could not register its caches)
also in failed_recving, so vLLM recomputes it; never as block ids."""

# ruff: noqa: E402  (vLLM's imports follow the skip where vLLM is not installed)
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'shmkv[vllm]')")

from types import SimpleNamespace

import torch

from shmkv import Store
from shmkv.config import load_config
from shmkv.integration.vllm.engine_inputs import KVGroup
from shmkv.integration.vllm.metadata import ShmKVMetadata
from shmkv.integration.vllm.worker import WorkerSide
from shmkv.transfer.items import GroupWindow, LoadItem, StoreItem

BS = 16
GROUPS = [KVGroup(("a.0", "a.1")), KVGroup(("w.0",), window=32)]


def caches(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randint(-100, 100, (8, 2, BS, 16), generator=g).to(torch.bfloat16)
            for n in ("a.0", "a.1", "w.0")}


def item(cls, req: str, key: bytes, blocks: tuple[int, ...], window: tuple[int, ...]):
    groups = (GroupWindow(0, len(blocks), blocks), GroupWindow(0, len(window), window))
    return cls(req, (key,), len(blocks) * BS, groups) if cls is StoreItem else cls(req, (key,), groups)


def side(store: Store, kv: dict[str, torch.Tensor], cache_name: str) -> WorkerSide:
    s = WorkerSide(load_config({"cache_name": cache_name}), store, GROUPS, 0, BS)
    s.register_kv_caches(kv)
    assert s.worker is not None, s.off_reason
    return s


def finish(s: WorkerSide) -> tuple[set[str], set[str]]:
    """What vLLM hears after the step (the connector's get_transfer_results)."""
    s.worker.wait_loads()  # every copy has run
    _, recving = s.get_finished(set())
    return set(recving or ()), s.take_failed_recving()


def test_an_async_load_is_reported_once_in_finished_recving(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        src, dst = caches(1), caches(2)
        a = side(store, src, cache_name)
        a.worker.store([item(StoreItem, "r", b"k" * 16, (3, 4), (4,))])
        b = side(store, dst, cache_name)
        meta = ShmKVMetadata(loads=[item(LoadItem, "q", b"k" * 16, (6, 7), (7,))], async_loads={"q"})
        b.bind(meta)
        b.start_load(meta)
        assert b._loading is None, "the forward never waits for an asynchronous load"
        b.wait_for_save(meta)
        assert finish(b) == ({"q"}, set())
        assert b.get_finished(set()) == (None, None), "reported once"
        assert b.load_errors() == set()
        for n in ("a.0", "a.1"):
            assert torch.equal(dst[n][6:8], src[n][3:5])
        assert torch.equal(dst["w.0"][7], src["w.0"][4])


def test_a_failed_async_load_is_a_failed_request_not_block_ids(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        b = side(store, caches(2), cache_name)
        meta = ShmKVMetadata(loads=[item(LoadItem, "q", b"gone" * 4, (6, 7), (7,))], async_loads={"q"},
                             failed_loads={"p"})
        b.bind(meta)
        b.start_load(meta)
        b.wait_for_save(meta)
        done, failed = finish(b)
        assert done == {"q", "p"} and failed == {"q", "p"}
        assert b.load_errors() == set(), "block ids of a multi-group engine would stop vLLM"
        assert b.worker.counters["load_missing_units"] == 1


def test_a_worker_that_is_off_fails_its_async_loads(cache_name):
    with Store.create(cache_name, 8 << 20, alignment=64) as store:
        s = WorkerSide(load_config({"cache_name": cache_name}), store, GROUPS, 0, BS)
        s.register_kv_caches({"a.0": torch.zeros(2, 4, BS, 2, 8), "a.1": torch.zeros(2, 4, BS, 2, 8),
                              "w.0": torch.zeros(2, 4, BS, 2, 8)})  # 5-D: not a vLLM 0.32 view
        assert s.worker is None
        meta = ShmKVMetadata(loads=[item(LoadItem, "q", b"k" * 16, (6,), ())], async_loads={"q"})
        s.bind(meta)
        s.start_load(meta)
        s.wait_for_save(meta)
        assert s.get_finished(set()) == (None, {"q"}) and s.take_failed_recving() == {"q"}
        assert s.load_errors() == set()


def test_the_connector_reports_failures_in_both_sets(cache_name):
    """vLLM's contract: a failed receive is also a finished one."""
    from shmkv.integration.vllm.connector import ShmKVConnector

    conn = ShmKVConnector.__new__(ShmKVConnector)
    conn._work = SimpleNamespace(get_finished=lambda ids: (None, {"q", "p"}), take_failed_recving=lambda: {"p"})
    conn._sched = None
    r = conn.get_transfer_results(set())
    assert r.finished_recving == {"q", "p"} and r.failed_recving == {"p"} and r.finished_sending == set()
