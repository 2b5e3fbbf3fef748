"""What POST /compress buys: chunks held per byte of the shared tier, and
the time to first token of a hit on compressed chunks.

Model: the timing model of `bench ttft` (random-weight Llama, hidden 1024,
12 layers; --small: the test model). Engine A computes and stores 2N
distinct prompts (its TTFT is the recompute figure: a cold prefill, with
stores); engine B, another process without vLLM's prefix cache, hits the
first N exactly, then the controller compresses the other N in place and B
hits those. Each figure is the median over the N prompts:

  chunks_held_gain       allocated bytes of the chunks raw / compressed (how
                         many more chunks the same segment holds)
  ttft_recompute_s       engine A, first sight of a prompt
  ttft_exact_hit_s       engine B, a hit on raw chunks
  ttft_compressed_hit_s  engine B, a hit on compressed chunks
  recompute_over_compressed_hit, compressed_over_exact_hit
"""

from __future__ import annotations

import json
import os
import random
import statistics

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.ttft_options import bench_model, ttft_args
from shmkv.config import load_config
from shmkv.engines.engine import EngineProcess, EngineSpec
from shmkv.services.controller import Controller
from shmkv.store import FLAG_COMPRESSED


def run(argv: list[str]) -> dict:
    a = ttft_args("shmkv bench compress", "shmkv-bench-compress", __doc__).parse_args(argv)
    spec, model = bench_model(a)
    rng = random.Random(7)

    def prompt() -> list[int]:
        return [rng.randrange(3, spec.vocab_size) for _ in range(a.prompt_tokens)]

    exact, packed = [prompt() for _ in range(a.prompts)], [prompt() for _ in range(a.prompts)]
    warm = [prompt() for _ in range(2)]
    name = f"shmkv-bench-compress-{os.getpid()}"
    cfg = {"cache_name": name, "capacity": "2GiB"}
    try:
        with EngineProcess(EngineSpec(model, shmkv=cfg), os.path.join(a.workdir, "a.log")) as e:
            e.generate([warm[0]], max_tokens=1)
            recompute = [e.ttft(p)["wall_s"] for p in exact + packed]
        store = Store.attach(name)
        try:
            ctl = Controller(load_config(cfg, env={}), store, None)
            with EngineProcess(EngineSpec(model, shmkv=cfg), os.path.join(a.workdir, "b.log")) as e:
                e.generate([warm[1]], max_tokens=1)
                exact_hit, hits = [], []
                for p in exact:
                    r = e.ttft(p)
                    exact_hit.append(r["wall_s"])
                    hits.append(r["num_cached_tokens"][0])
                raw_alloc = _alloc(store)
                replies = []
                for p in packed:
                    status, _, body = ctl.handle("POST", "/compress", json.dumps({"tokens": p}).encode())
                    replies.append(json.loads(body))
                    assert status == 200, replies[-1]
                packed_alloc = _alloc(store, compressed_only=True)
                compressed_hit, packed_hits = [], []
                for p in packed:
                    r = e.ttft(p)
                    compressed_hit.append(r["wall_s"])
                    packed_hits.append(r["num_cached_tokens"][0])
        finally:
            store.close()
    finally:
        drop_cache(name)
    raw_b = sum(raw_alloc[k] for k in packed_alloc)
    med = statistics.median
    return {
        "model": f"llama-h{spec.hidden_size}-l{spec.num_hidden_layers}", "prompt_tokens": a.prompt_tokens,
        "prompts": a.prompts, "compressed_chunks": sum(r["compressed_chunks"] for r in replies),
        "chunks_held_gain": raw_b / max(1, sum(packed_alloc.values())),
        "payload_ratio": sum(r["bytes_before"] for r in replies) / max(1, sum(r["bytes_after"] for r in replies)),
        "ttft_recompute_s": med(recompute), "ttft_exact_hit_s": med(exact_hit),
        "ttft_compressed_hit_s": med(compressed_hit),
        "recompute_over_compressed_hit": med(recompute) / med(compressed_hit),
        "compressed_over_exact_hit": med(compressed_hit) / med(exact_hit),
        "hit_tokens": min(hits), "compressed_hit_tokens": min(packed_hits),
        "samples": {"recompute": recompute, "exact_hit": exact_hit, "compressed_hit": compressed_hit},
    }


def _alloc(store: Store, *, compressed_only: bool = False) -> dict[bytes, int]:
    """key -> allocated bytes of the chunks held now (only the compressed ones)."""
    return {e["key"]: e["alloc_size"] for e in store.entries()
            if e["state"] == "ready" and (not compressed_only or e["flags"] & FLAG_COMPRESSED)}


def report(r: dict) -> None:
    print(f"{r['model']}, {r['prompt_tokens']}-token prompts, median of {r['prompts']}:")
    print(f"  compressed {r['compressed_chunks']} chunks: the shared tier holds {r['chunks_held_gain']:.2f}x the "
          f"chunks (payload ratio {r['payload_ratio']:.2f})")
    print(f"  recompute (cold prefill)   {r['ttft_recompute_s'] * 1e3:8.0f} ms")
    print(f"  hit, raw chunks            {r['ttft_exact_hit_s'] * 1e3:8.0f} ms  (hit {r['hit_tokens']})")
    print(f"  hit, compressed chunks     {r['ttft_compressed_hit_s'] * 1e3:8.0f} ms  "
          f"({r['compressed_over_exact_hit']:.2f}x raw hit, {r['recompute_over_compressed_hit']:.1f}x faster than "
          f"recompute; hit {r['compressed_hit_tokens']})")

