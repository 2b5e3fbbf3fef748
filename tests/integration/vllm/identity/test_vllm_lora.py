"""Two LoRA adapters on one base model, in two engines: a request with adapter
A never loads adapter B's chunks (nor the base model's), and each adapter
hits its own chunks in the other engine with the output of a run without
shmkv. Then adapter A's directory is rewritten in place (#63 item 3): the
engines keep serving the tensors they read under its id, and their chunks
keep that adapter's key (another engine holding it hits them); an engine
reading the new files (a new id) misses them; a request that makes vLLM
read the files again (load_inplace) is keyed by the new files, and so is
the id from then on. (A rank found holding other tensors than a request's
keys name: test_adapter_identity.py.)"""

from __future__ import annotations

import pytest
from helpers import E2E_TOKENS, random_prompt

from shmkv.bench.greedy import first_difference
from shmkv.engines.models import write_lora

pytestmark = pytest.mark.slow

P = random_prompt(1000, seed=21)
P2 = random_prompt(1000, seed=22)
P3 = random_prompt(1000, seed=23)
LORA_KW = {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2}


def test_adapters_never_share_chunks(cache_name, start_engine, tmp_path):
    a_dir = write_lora(str(tmp_path / "A"), seed=1)
    b_dir = write_lora(str(tmp_path / "B"), seed=2)
    A, B = ("A", 1, a_dir), ("B", 2, b_dir)
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}

    ref = start_engine("lora-ref", shmkv=None, prefix_caching=True, llm_kwargs=LORA_KW)

    def truth(lora, split: int, prompt=P) -> dict:
        ref.reset_prefix_cache()
        if split:
            ref.generate([prompt[:split + 1]], max_tokens=1, loras=[lora])
        r = ref.generate([prompt], max_tokens=E2E_TOKENS, loras=[lora], logprobs=3)
        assert r["num_cached_tokens"][0] == split
        return r

    def reference(lora, split: int, prompt=P) -> list[int]:
        return truth(lora, split, prompt)["outputs"][0]

    def agrees(got: list[int], lora, split: int, prompt=P) -> str | None:
        """`got` is the reference's greedy continuation at `split`, up to a near tie (the chunks
        loaded were computed in another batch shape than the reference's prefix)."""
        t = truth(lora, split, prompt)
        d = first_difference(got, t["outputs"][0], t["logprobs"][0])
        return None if d is None or d.tie else d.why

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
        assert agrees(r["outputs"][0], lora, split) is None, lora[0]

    v1_p2 = {split: truth(A, split, P2) for split in (0, 896)}
    write_lora(a_dir, seed=3)  # adapter A rewritten in place: same name, path and id
    # every engine keeps the tensors it read under id 1 (the reference too: it reads id 1 no more)
    r = e2.generate([P2], loras=[A])
    assert r["num_cached_tokens"] == [0] and r["outputs"][0] == v1_p2[0]["outputs"][0]
    r = e1.generate([P2], loras=[A])
    assert r["num_cached_tokens"] == [896], "e1 holds adapter A as first read: e2's chunks are its chunks"
    d = first_difference(r["outputs"][0], v1_p2[896]["outputs"][0], v1_p2[896]["logprobs"][0])
    assert d is None or d.tie, d
    A2 = ("A", 3, a_dir)  # the new files, under a new id
    r = e2.generate([P2], loras=[A2])
    assert r["num_cached_tokens"] == [0], "the chunks computed with the old tensors are not the new files'"
    v2_p2 = reference(A2, 0, P2)
    assert r["outputs"][0] == v2_p2 != v1_p2[0]["outputs"][0]
    # a request that makes vLLM read id 1 again (load_inplace) is keyed by the files as they are now:
    # e2's chunks of the new files (id 3) are its chunks, and from then on e1's key for id 1 is theirs
    r = e1.generate([P2], loras=[("A", 1, a_dir, True)])
    assert r["num_cached_tokens"] == [896]
    assert (why := agrees(r["outputs"][0], A2, 896, P2)) is None, why
    e2.generate([P3], loras=[A2])
    r = e1.generate([P3], loras=[A])
    assert r["num_cached_tokens"] == [896]
    assert (why := agrees(r["outputs"][0], A2, 896, P3)) is None, why
