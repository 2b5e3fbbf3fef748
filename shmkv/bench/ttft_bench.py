"""Time to first token with and without shmkv, in separate vLLM engines.

Model: random-weight Llama, hidden 1024, 12 layers, 8 heads, 4 KV heads (a cold
3,000-token prefill takes seconds on a 2-core machine). Every engine runs with
VLLM_CPU_NUM_OF_RESERVED_CPU=1 and is warmed up with an unrelated request.
Each figure is the median over several distinct prompts:
  cold_s              no connector, first sight of the prompt
  apc_same_engine_s   no connector, vLLM's own prefix cache, same prompt again
  cold_with_shmkv_s   with shmkv, first sight (lookup miss + stores)
  warm_cross_s        with shmkv, a fresh engine process, the same prompt
  prefix_s            with shmkv, a prompt sharing the first 2,000 tokens
  disk_s              with shmkv, a fresh engine, the chunks only on disk
                      (spilled, then the shared tier emptied): promotion + load
"""

from __future__ import annotations

import os
import random
import shutil
import statistics

from shmkv import Store
from shmkv.bench import drop_cache
from shmkv.bench.ttft_options import bench_model, ttft_args
from shmkv.config import load_config
from shmkv.engines.engine import EngineProcess, EngineSpec
from shmkv.services.maintainer import Maintainer
from shmkv.tiers import open_tiers


def run(argv: list[str]) -> dict:
    a = ttft_args("shmkv bench ttft", "shmkv-bench-ttft", __doc__).parse_args(argv)
    spec, model = bench_model(a)
    rng = random.Random(1)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, spec.vocab_size) for _ in range(n)]

    n = a.prompt_tokens
    prompts = [prompt(n) for _ in range(a.prompts)]
    prefixed = [p[:2000] + prompt(n - 2000) for p in prompts]
    warm = [prompt(n) for _ in range(3)]
    name = f"shmkv-bench-ttft-{os.getpid()}"
    cfg = {"cache_name": name, "capacity": "2GiB"}
    logs = a.workdir
    model_name = f"llama-h{spec.hidden_size}-l{spec.num_hidden_layers}"
    out: dict = {"prompt_tokens": n, "prompts": a.prompts, "model": model_name}
    try:
        with EngineProcess(EngineSpec(model, shmkv=None, prefix_caching=True), f"{logs}/nocon.log") as e:
            e.generate([warm[0]], max_tokens=1)
            cold, apc, apc_hits, apc_out = [], [], [], []
            for p in prompts:
                cold.append(e.ttft(p)["wall_s"])
                r = e.ttft(p)
                apc.append(r["wall_s"])
                apc_hits.append(r["num_cached_tokens"][0])
                apc_out.append(e.generate([p], max_tokens=16)["outputs"][0])
        with EngineProcess(EngineSpec(model, shmkv=cfg), f"{logs}/shmkv-a.log") as e:
            e.generate([warm[1]], max_tokens=1)
            cold_shm = [e.ttft(p)["wall_s"] for p in prompts]
        with EngineProcess(EngineSpec(model, shmkv=cfg), f"{logs}/shmkv-b.log") as e:
            e.generate([warm[2]], max_tokens=1)
            cross, hits, outs_equal = [], [], True
            for p, ref in zip(prompts, apc_out):
                r = e.ttft(p)
                cross.append(r["wall_s"])
                hits.append(r["num_cached_tokens"][0])
                outs_equal &= e.generate([p], max_tokens=16)["outputs"][0] == ref
            pref = [e.ttft(q)["wall_s"] for q in prefixed]
        # disk: spill everything, empty the shared tier, ask a fresh engine
        disk_cfg = dict(cfg, disk_dir=os.path.join(a.workdir, "disk"))
        store = Store.attach(name)
        chain = open_tiers(load_config(dict(disk_cfg, disk_capacity=1 << 40), env={}), store)
        Maintainer(chain).spill_all()
        chain.close()
        store.clear()
        store.close()
        with EngineProcess(EngineSpec(model, shmkv=disk_cfg), f"{logs}/shmkv-disk.log") as e:
            e.generate([warm[0]], max_tokens=1)
            disk, disk_hits = [], []
            for p in prompts:
                r = e.ttft(p)
                disk.append(r["wall_s"])
                disk_hits.append(r["num_cached_tokens"][0])
    finally:
        drop_cache(name)
        shutil.rmtree(os.path.join(a.workdir, "disk"), ignore_errors=True)
    med = statistics.median
    out.update({
        "cold_s": med(cold), "apc_same_engine_s": med(apc), "cold_with_shmkv_s": med(cold_shm),
        "warm_cross_s": med(cross), "prefix_s": med(pref), "hit_tokens": min(hits),
        "apc_hit_tokens": min(apc_hits), "outputs_equal": bool(outs_equal),
        "disk_s": med(disk), "disk_hit_tokens": min(disk_hits), "disk_over_cold": med(disk) / med(cold),
        "warm_cross_over_apc": med(cross) / med(apc), "cold_shmkv_over_cold": med(cold_shm) / med(cold),
        "samples": {"cold": cold, "apc": apc, "cold_shmkv": cold_shm, "cross": cross, "prefix": pref,
                    "disk": disk},
    })
    return out


def report(r: dict) -> None:
    print(f"{r['model']}, {r['prompt_tokens']}-token prompts, median of {r['prompts']}:")
    print(f"  cold (no shmkv)            {r['cold_s'] * 1e3:8.0f} ms")
    print(f"  cold with shmkv            {r['cold_with_shmkv_s'] * 1e3:8.0f} ms  ({r['cold_shmkv_over_cold']:.3f}x)")
    print(f"  vLLM prefix cache, same engine {r['apc_same_engine_s'] * 1e3:4.0f} ms  (hit {r['apc_hit_tokens']})")
    print(f"  shmkv, another engine      {r['warm_cross_s'] * 1e3:8.0f} ms  ({r['warm_cross_over_apc']:.2f}x APC, "
          f"hit {r['hit_tokens']})")
    print(f"  shmkv, 2,000-token prefix  {r['prefix_s'] * 1e3:8.0f} ms")
    print(f"  shmkv, from disk           {r['disk_s'] * 1e3:8.0f} ms  ({r['disk_over_cold']:.2f}x cold, "
          f"hit {r['disk_hit_tokens']})")
    print(f"  outputs equal: {r['outputs_equal']}")
