"""MLA once per host: a DeepSeek-V2-shaped model (one latent KV that every
TP rank holds whole) at tensor parallel 2 stores one chunk set, not one per
rank; every rank of a second TP=2 engine loads it byte for byte, with the output of the
first engine. (Another TP size is another namespace: its all-reduces sum in
another order, so its latent KV differs in the last bits.)

Run with every MLA backend vLLM runs on this CPU (AMX_MLA where it has AMX
tiles, CPU_MLA everywhere: tests/support/vllm_host.py), each at the block
size vLLM chose for it, read from the engine: CPU_MLA takes 16-token blocks
only, AMX_MLA multiples of 32 (128 by default)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from helpers import random_prompt, read_digests
from vllm_host import mla_backends

from shmkv.engines.engine import TP2_ON_TWO_CORES

pytestmark = pytest.mark.slow

CHUNK = 256


def prompt_and_hit(block_size: int) -> tuple[list[int], int]:
    """2 chunks, a piece of whole blocks (up to 5, shorter than a chunk), and
    8 tokens more: the tokens a second engine loads are the chunks and the piece."""
    piece = max(1, min(5, (CHUNK - 1) // block_size)) * block_size
    return random_prompt(2 * CHUNK + piece + 8, seed=47), 2 * CHUNK + piece


def shm_entries(cache: str) -> int:
    out = subprocess.run([sys.executable, "-m", "shmkv.stats", "--cache", cache, "--json"], capture_output=True,
                         text=True, check=True, timeout=60).stdout
    return json.loads(out)["shm"]["entries"]


@pytest.mark.parametrize("mla_backend", mla_backends())
def test_one_chunk_set_per_host_loaded_by_every_rank(cache_name, start_engine, mla_dir, tmp_path, mla_backend):
    digests = str(tmp_path / "digests.txt")
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    tp2 = {"env": TP2_ON_TWO_CORES,
           "llm_kwargs": {"tensor_parallel_size": 2, "attention_config": {"backend": mla_backend}}}

    a = start_engine(f"mla-a-{mla_backend}", model_dir=mla_dir, shmkv=cfg, **tp2)
    assert a.attention_backends == [mla_backend], "the engine runs the backend asked for"
    assert a.block_size < CHUNK
    prompt, hit = prompt_and_hit(a.block_size)
    r_a = a.generate([prompt])
    assert r_a["num_cached_tokens"] == [0]
    a.close()
    log_a = open(a.log_path).read()
    assert "TP rank 1 only loads" in log_a
    assert shm_entries(cache_name) == 3, "2 chunks and the piece, once (not once per rank)"

    b = start_engine(f"mla-b-{mla_backend}", model_dir=mla_dir, shmkv=cfg, **tp2)
    r_b = b.generate([prompt])
    assert r_b["num_cached_tokens"] == [hit]
    assert r_b["outputs"] == r_a["outputs"]
    rows = read_digests(digests)
    stored = {r[1]: r[3] for r in rows if r[0] == "store"}
    loads = [r for r in rows if r[0] == "load"]
    assert len(stored) == 3
    assert Counter(r[1] for r in loads) == Counter({k: 2 for k in stored}), "each chunk loaded by both ranks"
    assert all(r[3] == "0" and r[4] == r[5] and r[6] == stored[r[1]] for r in loads), "byte-equal on every rank"
    assert shm_entries(cache_name) == 3
