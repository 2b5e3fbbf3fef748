"""The connector's worker half driven the way vLLM's model runner drives it,
without vLLM (its CUDA build cannot be installed on every GPU host): in one
process, register_kv_caches, then per step bind (metadata), start_load,
wait_for_layer_load for every layer in order, wait_for_save, get_finished
until delayed frees are reported; a second process sharing the segment loads
the chunks into its own cache, and the KV bytes it loaded equal those the
first stored. On "cuda" this is the GPU path (runs with `pytest -m gpu`)."""

from __future__ import annotations

import json

import pytest
from helpers import cuda_missing

from shmkv import Store

LAYERS, BLOCKS, BS, HEADS, CONTENT = 4, 24, 16, 2, 128  # vLLM's view: [blocks, heads, block tokens, content]
CHUNK_BLOCKS = 4  # 64-token chunks
SRC = [[2, 3, 7, 8], [11, 12, 13, 1]]  # A's blocks of each chunk (any order, as vLLM allocates)
DST = [[20, 5, 6, 9], [0, 4, 15, 16]]  # where B's scheduler put them


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    cuda_missing() is not None, reason=cuda_missing() or "")])]

STEP = """
    import json, sys, time, types
    import torch
    from shmkv import Store
    from shmkv.config import load_config
    from shmkv.integration.vllm.engine_inputs import KVGroup
    from shmkv.transfer import GroupWindow, LoadItem, StoreItem
    from shmkv.integration.vllm.worker import WorkerSide

    role, name, device = sys.argv[1], sys.argv[2], sys.argv[3]
    L, NB, BS, H, C, SRC, DST, NS = {consts}
    names = [f"model.layers.{{i}}.self_attn.attn" for i in range(L)]

    def cache(seed):
        g = torch.Generator().manual_seed(seed)
        return {{n: torch.randn(NB, H, BS, C, generator=g).to(torch.bfloat16).to(device) for n in names}}

    store = Store.attach(name)
    side = WorkerSide(load_config({{"cache_name": name}}, env={{}}), store, [KVGroup(tuple(names))], 0, BS)
    caches = cache(1) if role == "store" else {{n: torch.zeros(NB, H, BS, C, dtype=torch.bfloat16, device=device)
                                                for n in names}}
    side.register_kv_caches(caches)
    assert side.worker is not None, side.off_reason
    keys = [bytes([7, i]) * 8 for i in range(len(SRC))]
    if role == "store":
        meta = types.SimpleNamespace(loads=[], failed_blocks=set(), summaries={{}}, stores=[
            StoreItem("r", (k,), len(b) * BS, (GroupWindow(0, len(b), tuple(b)),), namespaces=(bytes(NS),))
            for k, b in zip(keys, SRC)])
    else:
        meta = types.SimpleNamespace(stores=[], failed_blocks=set(), summaries={{}}, loads=[
            LoadItem("q", (k,), (GroupWindow(0, len(b), tuple(b)),)) for k, b in zip(keys, DST)])
    # one step, in vLLM's order
    side.bind(meta)
    side.start_load(meta)
    for n in names:  # the forward pass: each attention layer waits for its own loads
        side.wait_layer(n)
    side.wait_for_save(meta)
    errors = side.load_errors()
    finished, steps = set(), 0
    deadline = time.monotonic() + 120
    # delayed frees: EngineCore keeps stepping until the stored request is reported
    while role == "store" and "r" not in finished and time.monotonic() < deadline:
        done, _ = side.get_finished({{"r"}} if steps == 0 else set())
        finished |= done or set()
        steps += 1
        time.sleep(0.001)
    if role == "load":
        assert side.get_finished({{"q"}}) == (None, None), "a request that stored nothing is never reported"
    out = {{"errors": sorted(errors), "steps": steps, "finished": sorted(finished)}}
    if role == "load":
        ref = cache(1)
        out["equal"] = all(torch.equal(caches[n][d].view(torch.uint8).cpu(), ref[n][s].view(torch.uint8).cpu())
                           for n in names for sb, db in zip(SRC, DST) for s, d in zip(sb, db))
        out["untouched"] = all(not caches[n][i].any() for n in names for i in range(NB)
                               if i not in {{d for b in DST for d in b}})
    side.shutdown()
    store.close()
    print(json.dumps(out))
"""


def run_role(role: str, name: str, device: str) -> dict:
    import os
    import subprocess
    import sys
    import textwrap

    from helpers import REPO

    consts = repr((LAYERS, BLOCKS, BS, HEADS, CONTENT, SRC, DST, list(b"H" * 16)))
    code = textwrap.dedent(STEP.format(consts=consts))
    env = dict(os.environ, PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""))
    r = subprocess.run([sys.executable, "-c", code, role, name, device], capture_output=True, text=True,
                       timeout=300, env=env, cwd=REPO)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", DEVICES)
def test_two_processes_store_then_load_like_vllm(cache_name, device):
    store = Store.create(cache_name, 64 << 20)
    try:
        a = run_role("store", cache_name, device)
        assert a["errors"] == []
        assert a["finished"] == ["r"], "a stored request is reported finished once its copies are done"
        st = store.stats()
        assert st["puts"] == len(SRC) and st["put_tokens"] == len(SRC) * CHUNK_BLOCKS * BS
        b = run_role("load", cache_name, device)
        assert b["errors"] == [], "every promised block was filled"
        assert b["equal"], "the KV bytes loaded equal those stored"
        assert b["untouched"], "no block outside the load was written"
        assert store.stats()["leases_held"] == 0
    finally:
        store.close()
