"""What the lossy (fp8) form costs in output: divergence against exact KV.

Engine A (exact) computes and stores N prompts. The controller makes the
fp8 form of every chunk, keeping the exact ones (`keep_exact`). Engine B
(exact) then hits the exact chunks and engine C (`lossy_form: fp8`) the fp8
form, both at the same split point, both greedy with the top-5 logprobs of
every output token. A split point alone can flip a greedy token, so the
figures of B against A (exact KV, another split) are given beside those of
C against B (fp8 against exact KV, the same split):

  kv_relative_rms_error_mean/max  of the fp8 form, per chunk (the controller's)
  chunks_held_gain                exact bytes / fp8 bytes of the same chunks
  identical_outputs               fraction of prompts whose outputs are equal
  token_agreement                 fraction of output positions with the same token
  first_divergence_mean           first differing position (max_tokens if none)
  first_token_logprob_diff_max    |logprob difference| over the top-5 tokens both
                                  list at the first output position (the one
                                  computed straight from the loaded KV)
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


def run(argv: list[str]) -> dict:
    ap = ttft_args("shmkv bench lossy", "shmkv-bench-lossy", __doc__)
    ap.add_argument("--max-tokens", type=int, default=32, help="greedy output tokens per prompt")
    a = ap.parse_args(argv)
    spec, model = bench_model(a)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(a.prompt_tokens)] for _ in range(a.prompts)]
    name = f"shmkv-bench-lossy-{os.getpid()}"
    cfg = {"cache_name": name, "capacity": "2GiB"}

    def outputs(label: str, shmkv: dict) -> dict:
        with EngineProcess(EngineSpec(model, shmkv=shmkv), os.path.join(a.workdir, f"{label}.log")) as e:
            return e.generate(prompts, max_tokens=a.max_tokens, logprobs=5)

    try:
        cold = outputs("a", cfg)
        with Store.attach(name) as store:
            ctl = Controller(load_config(cfg, env={}), store, None)
            status, _, body = ctl.handle("POST", "/compress", json.dumps({"form": "fp8", "keep_exact": True}).encode())
            made = json.loads(body)
            if status != 200:
                raise RuntimeError(f"POST /compress: {status} {made}")
            exact = outputs("b", cfg)
            lossy = outputs("c", {**cfg, "lossy_form": "fp8"})
    finally:
        drop_cache(name)
    return {
        "model": f"llama-h{spec.hidden_size}-l{spec.num_hidden_layers}", "prompt_tokens": a.prompt_tokens,
        "prompts": a.prompts, "max_tokens": a.max_tokens, "fp8_chunks": made["compressed_chunks"],
        "kv_relative_rms_error_mean": made["relative_rms_error_mean"],
        "kv_relative_rms_error_max": made["relative_rms_error_max"],
        "chunks_held_gain": made["bytes_before"] / max(1, made["bytes_after"]),
        "hit_tokens": {"exact": min(exact["num_cached_tokens"]), "fp8": min(lossy["num_cached_tokens"])},
        "fp8_vs_exact_same_split": _compare(exact, lossy, a.max_tokens),
        "exact_vs_exact_other_split": _compare(cold, exact, a.max_tokens),
    }


def _compare(x: dict, y: dict, max_tokens: int) -> dict:
    pairs = list(zip(x["outputs"], y["outputs"]))
    agree = [sum(p == q for p, q in zip(a, b)) / max_tokens for a, b in pairs]
    first = [next((i for i, (p, q) in enumerate(zip(a, b)) if p != q), max_tokens) for a, b in pairs]
    diffs = []
    for lx, ly in zip(x["logprobs"], y["logprobs"]):
        both = set(lx[0]) & set(ly[0])
        diffs += [abs(lx[0][t] - ly[0][t]) for t in both]
    return {"identical_outputs": sum(a == b for a, b in pairs) / len(pairs),
            "token_agreement": statistics.mean(agree), "first_divergence_mean": statistics.mean(first),
            "first_token_logprob_diff_max": max(diffs, default=0.0)}


def report(r: dict) -> None:
    print(f"{r['model']}, {r['prompts']} prompts of {r['prompt_tokens']} tokens, {r['max_tokens']} greedy tokens; "
          f"{r['fp8_chunks']} chunks in fp8 ({r['chunks_held_gain']:.2f}x the chunks held, KV relative RMS error "
          f"{r['kv_relative_rms_error_mean']:.4f} mean, {r['kv_relative_rms_error_max']:.4f} max)")
    for label, key in (("fp8 vs exact KV, same split ", "fp8_vs_exact_same_split"),
                       ("exact KV, another split    ", "exact_vs_exact_other_split")):
        c = r[key]
        print(f"  {label} identical outputs {c['identical_outputs']:.0%}, tokens agreeing "
              f"{c['token_agreement']:.0%}, first divergence at {c['first_divergence_mean']:.1f}, first-token "
              f"logprob diff up to {c['first_token_logprob_diff_max']:.3f}")
