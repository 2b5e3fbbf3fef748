"""The disk tier end to end: a shared tier too small for the prompts spills
to disk, later requests hit from disk with outputs identical to runs without
the connector, and the disk tier survives every process exiting and the
segment disappearing (as after a reboot)."""

from __future__ import annotations

import os

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow


def test_hits_from_disk_and_after_a_restart(cache_name, start_engine, reference, tmp_path):
    disk_dir = str(tmp_path / "disk")
    cfg = {"cache_name": cache_name, "capacity": "4MiB", "disk_dir": disk_dir, "spill_ahead": 0.9,
           "low_watermark": 0.3}
    prompts = [random_prompt(2600, seed=s) for s in (61, 62, 63)]  # ~2.5 MiB of KV each
    e = start_engine("disk", shmkv=cfg)
    for p in prompts:
        assert e.generate([p])["num_cached_tokens"] == [0]
    store = Store.attach(cache_name)
    assert store.stats()["spills"] >= 10, store.stats()

    r = e.generate([prompts[0]])  # long evicted from memory
    hit = r["num_cached_tokens"][0]
    assert hit == 2560, "10 chunks; the 40-token tail is computed"
    assert r["outputs"][0] == reference.output(prompts[0], hit)
    st = store.stats()
    assert st["disk_hits"] > 0 and st["disk_damaged"] == 0
    store.close()
    e.close()

    # every process gone, the segment too: only the disk tier remains
    assert Store.unlink(cache_name)
    assert any(n.endswith(".kv") for n in os.listdir(os.path.join(disk_dir, cache_name)))
    e2 = start_engine("disk-after-restart", shmkv=cfg, llm_kwargs={"disable_log_stats": False})
    r = e2.generate([prompts[1]])
    assert r["num_cached_tokens"] == [2560]
    assert r["outputs"][0] == reference.output(prompts[1], 2560)
    # vLLM's own metric says where the hit came from
    assert e2.metrics().get("vllm:prompt_tokens_cached_by_source{source=disk}") == 2560
    with Store.attach(cache_name) as s:
        assert s.stats()["disk_hit_tokens"] == 2560
