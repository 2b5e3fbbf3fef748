"""Two LoRA adapters on one base model, in two engines: a request with adapter
A never loads adapter B's chunks (nor the base model's), each adapter hits
its own chunks in the other engine with the output of a run without shmkv,
and adapter A's weights replaced under the same name miss."""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS, random_prompt

from shmkv.bench.models import write_lora

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=21)
LORA_KW = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def test_adapters_never_share_chunks(cache_name, start_engine, tmp_path):
    a_dir = write_lora(str(tmp_path / "A"), seed=1)
    b_dir = write_lora(str(tmp_path / "B"), seed=2)
    A, B = ("A", 1, a_dir), ("B", 2, b_dir)
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}

    ref = start_engine("lora-ref", shmkv=None, prefix_caching=True, llm_kwargs=LORA_KW)

    def reference(lora, split: int) -> list[int]:
        ref.reset_prefix_cache()
        if split:
            ref.generate([P[:split + 1]], max_tokens=1, loras=[lora])
        r = ref.generate([P], max_tokens=E2E_TOKENS, loras=[lora])
        assert r["num_cached_tokens"][0] == split
        return r["outputs"][0]

    e1 = start_engine("lora-1", shmkv=cfg, llm_kwargs=LORA_KW)
    r = e1.generate([P], loras=[A])
    assert r["num_cached_tokens"] == [0]
    assert r["outputs"][0] == reference(A, 0)
    r = e1.generate([P], loras=[B])
    assert r["num_cached_tokens"] == [0], "adapter B must not load adapter A's chunks"
    out_b = r["outputs"][0]
    assert out_b != reference(A, 0), "the adapters really differ"
    r = e1.generate([P], loras=[None])
    assert r["num_cached_tokens"] == [0], "the base model must not load an adapter's chunks"

    e2 = start_engine("lora-2", shmkv=cfg, llm_kwargs=LORA_KW)
    split = 896  # 3 chunks of 256 and a 128-token piece: the split vLLM's own prefix cache would use
    for lora in (A, B):
        r = e2.generate([P], loras=[lora])
        assert r["num_cached_tokens"][0] == split, lora[0]
        assert r["outputs"][0] == reference(lora, split), lora[0]

    write_lora(a_dir, seed=3)  # adapter A replaced under the same name and path
    r = e2.generate([P], loras=[("A", 3, a_dir)])
    assert r["num_cached_tokens"] == [0], "a replaced adapter must not hit the old one's chunks"
