#!/usr/bin/env python3
"""The main job: two separate vLLM engine processes share one shmkv cache.

Writes a random-weight Llama (config.json + safetensors; nothing downloaded),
starts engine 1 with the shmkv connector, sends it a ~3,000-token prompt,
starts engine 2 (a separate process), sends it the same prompt, and prints
each time to first token, the tokens served from the cache and whether the
greedy outputs are identical.

    python3 scripts/demo.py            # medium model (cold prefill takes seconds)
    python3 scripts/demo.py --small    # tiny model, faster start
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from shmkv import Store  # noqa: E402
from shmkv.engines.engine import EngineProcess, EngineSpec  # noqa: E402
from shmkv.engines.models import TEST_MODEL, TIMING_MODEL, write_llama  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--small", action="store_true", help="use the tiny test model")
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "shmkv-demo"))
    ap.add_argument("--keep", action="store_true", help="keep the shared segment afterwards")
    args = ap.parse_args()

    spec = TEST_MODEL if args.small else TIMING_MODEL
    os.makedirs(args.workdir, exist_ok=True)
    model = write_llama(os.path.join(args.workdir, "model-small" if args.small else "model"), spec)
    name = f"shmkv-demo-{os.getpid()}"
    cfg = {"cache_name": name, "capacity": "1GiB"}
    rng = random.Random(0)
    prompt = [rng.randrange(3, spec.vocab_size) for _ in range(args.prompt_tokens)]
    warmup = [rng.randrange(3, spec.vocab_size) for _ in range(args.prompt_tokens)]
    print(f"model: Llama hidden {spec.hidden_size}, {spec.num_hidden_layers} layers, random weights, in {model}")
    print(f"shared cache: /dev/shm/{name}; engine logs in {args.workdir}")

    rows = []
    outputs = []
    try:
        for i in (1, 2):
            t0 = time.perf_counter()
            e = EngineProcess(EngineSpec(model, shmkv=cfg), os.path.join(args.workdir, f"engine{i}.log"))
            print(f"engine {i}: started (pid {e.pid}) in {time.perf_counter() - t0:.0f} s", flush=True)
            try:
                if i == 1:
                    e.generate([warmup], max_tokens=1)  # first-request costs, unrelated prompt
                else:
                    e.generate([warmup[:-1]], max_tokens=1)
                r = e.ttft(prompt)
                rows.append((i, r["wall_s"], r["num_cached_tokens"][0]))
                outputs.append(e.generate([prompt], max_tokens=16)["outputs"][0])
            finally:
                e.close()  # engine 2 starts after engine 1 has exited: the cache outlives it
        print()
        print(f"{'engine':>6} | {'TTFT':>9} | tokens from shmkv (of {len(prompt)})")
        for i, ttft, hit in rows:
            print(f"{i:>6} | {ttft * 1e3:7.0f} ms | {hit}")
        same = outputs[0] == outputs[1]
        print(f"\ngreedy outputs identical: {same}")
        print(f"  engine 1: {outputs[0]}\n  engine 2: {outputs[1]}")
        st = Store.attach(name).stats()
        print(f"\ncache: {st['ready_entries']} chunks, {st['bytes_used'] / 2**20:.1f} MiB used, "
              f"{st['hits']} hits / {st['lookups']} lookups")
        return 0 if same and rows[1][2] > 0 else 1
    finally:
        if not args.keep:
            Store.unlink(name)


if __name__ == "__main__":
    sys.exit(main())
