"""A registered worker half driven in vLLM's call order without vLLM: its
CPU copies run only when waited for (deferred streams), which is where a
GPU's asynchronous copies would be. Shared by the worker-half tests."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.config import load_config
from shmkv.integration.vllm.engine_inputs import KVGroup
from shmkv.integration.vllm.worker import WorkerSide
from shmkv.transfer import GroupWindow, LoadItem, StoreItem

BS, LAYERS, BLOCKS = 16, 2, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def stored(req: str, key: bytes, *block_ids: int) -> StoreItem:
    return StoreItem(req, (key,), len(block_ids) * BS, (GroupWindow(0, len(block_ids), block_ids),))


def loaded(req: str, key: bytes, *block_ids: int) -> LoadItem:
    return LoadItem(req, (key,), (GroupWindow(0, len(block_ids), block_ids),))


def step(stores=(), loads=(), preempted=()) -> SimpleNamespace:
    """One step's metadata, as the scheduler half ships it."""
    return SimpleNamespace(stores=list(stores), loads=list(loads), preempted=set(preempted), summaries={},
                           failed_blocks=set())


def worker_side(store: Store, seed: int) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    """A registered worker half whose CPU copies run only when waited for."""
    caches = dict(zip(NAMES, make_cache("cpu", LAYERS, BLOCKS, BS, 2, 8, torch.bfloat16, seed=seed)))
    side = WorkerSide(load_config({"cache_name": store.name}, env={}), store, [KVGroup(tuple(NAMES))], 0, BS,
                      deferred=True)
    side.register_kv_caches(caches)
    assert side.worker is not None, side.off_reason
    return side, caches


def run_vllm_step(side: WorkerSide, meta, finished=()) -> tuple[set[str] | None, set[int]]:
    """vLLM's order for one step (no speculative decoding)."""
    side.bind(meta)
    side.handle_preemptions(meta)
    side.start_load(meta)
    for name in NAMES:
        side.wait_layer(name)
    side.wait_for_save(meta)
    sending, _ = side.get_finished(set(finished))
    return sending, side.load_errors()


