"""shmkv with vLLM's Model Runner V2 and CUDA graphs on a real GPU (vLLM's
Python behind scripts/gpu_v2/shim, see its docstring): the cases of #50's
item 3, each a comparison of greedy tokens against the same engine without
shmkv at the same split point (vLLM's own prefix cache caching the same
tokens first, as tests/support/helpers.py Reference does: the split point alone can
flip a greedy token).

  short       a 100-token prompt, nothing to hit
  full_hit    a 513-token prompt whose 512 tokens engine A stored: engine B
              loads them and computes one token (a uniform-decode batch: a
              FULL CUDA graph step)
  mixed       32 prompts sharing prefixes of 0-3 chunks, in one batch
  preempt     a KV cache too small for the batch: vLLM preempts while stores
              are in flight (engine A), then engine B serves the same set
  cross       engine B's hits of what engine A stored (every case above)

Engine A runs the cases on an empty cache, engine B after it; the reference
runs each prompt at the split point the engine had (its hit tokens).
    python v2_cases.py --out DIR [--cudagraph FULL_AND_PIECEWISE|FULL]

Before any GPU step it checks what it runs on (preflight.json: vLLM from the
bundle, the shim's ops, the CUDA platform module, the Triton attention
backend, V2's runner, shmkv); without a CUDA GPU it stops there, exit 3.
Writes DIR/results.json: per case, tokens equal or not.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time

E2E_TOKENS = 16


def preflight() -> dict:
    out: dict = {"python": sys.version.split()[0]}
    import torch

    out["torch"], out["cuda_build"] = torch.__version__, torch.version.cuda
    import vllm

    out["vllm"], out["vllm_path"] = vllm.__version__, os.path.dirname(vllm.__file__)
    out["shim_ops"] = sorted(n for n in ("silu_and_mul", "get_cuda_view_from_cpu_tensor")
                             if hasattr(torch.ops._C, n))
    import vllm.platforms.cuda  # noqa: F401  (imports vllm._C_stable_libtorch: the shim's stub)
    import vllm.v1.attention.backends.triton_attn  # noqa: F401
    import vllm.v1.worker.gpu.model_runner  # noqa: F401

    import shmkv
    import shmkv.integration.vllm  # noqa: F401

    out["shmkv"] = shmkv.__file__
    try:
        import shmkv._C_cuda  # noqa: F401

        out["shmkv_cuda"] = True
    except ImportError as e:
        out["shmkv_cuda"] = f"not importable: {e}"
    out["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return out


def prompts(seed: int = 7) -> dict[str, list[tuple[list[int], int]]]:
    """Per case, (prompt, the tokens engine B is expected to hit)."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(10, 4000) for _ in range(n)]

    bases = [toks(768) for _ in range(4)]
    mixed = []
    for i in range(32):
        shared = (i % 4) * 256
        mixed.append((bases[i % 4][:shared] + toks(rng.randrange(20, 300)), shared))
    return {"short": [(toks(100), 0)], "full_hit": [(toks(513), 512)], "mixed": mixed,
            "preempt": [(toks(900), 768) for _ in range(6)]}


def engine_main(spec: dict) -> dict:
    """One engine (its own process): run each case's prompts, return tokens."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    ktc = None
    if spec["shmkv"]:
        ktc = KVTransferConfig(kv_connector="ShmKVConnector", kv_connector_module_path="shmkv.integration.vllm",
                               kv_role="kv_both", kv_connector_extra_config=spec["shmkv"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096, block_size=16,
              enable_prefix_caching=spec["prefix_caching"], gpu_memory_utilization=0.25, seed=0,
              max_num_batched_tokens=spec.get("batched", 2048), num_gpu_blocks_override=spec.get("blocks"),
              compilation_config={"mode": 0, "cudagraph_mode": spec["cudagraph"], "custom_ops": ["none"]},
              kernel_config={"ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"]}},
              attention_config={"backend": "TRITON_ATTN"}, kv_transfer_config=ktc)
    sp = SamplingParams(max_tokens=E2E_TOKENS, temperature=0.0, ignore_eos=True, detokenize=False)
    out: dict = {}
    for case, items in spec["cases"].items():
        if spec.get("reference"):  # one prompt at a time, its split cached by vLLM's own prefix cache first
            got = []
            for p, split in items:
                llm.reset_prefix_cache()
                if split:
                    llm.generate([TokensPrompt(prompt_token_ids=p[:split + 1])], SamplingParams(max_tokens=1))
                r = llm.generate([TokensPrompt(prompt_token_ids=p)], sp)[0]
                got.append({"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens})
        else:
            rs = llm.generate([TokensPrompt(prompt_token_ids=p) for p, _ in items], sp)
            got = [{"tokens": list(r.outputs[0].token_ids), "cached": r.num_cached_tokens} for r in rs]
        out[case] = got
    return out


def run_engine(spec: dict, log: str) -> dict:
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(spec, f)
    t0 = time.time()
    with open(log, "w") as lf:
        r = subprocess.run([sys.executable, __file__, "--engine", f.name], stdout=subprocess.PIPE, stderr=lf,
                           text=True, timeout=900)
    if r.returncode != 0:
        return {"error": f"exit {r.returncode} (log {os.path.basename(log)})", "seconds": round(time.time() - t0, 1)}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["seconds"] = round(time.time() - t0, 1)
    return res


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu-v2-out")
    ap.add_argument("--cudagraph", default="FULL_AND_PIECEWISE")
    ap.add_argument("--engine", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.engine:
        with open(a.engine) as f:
            print(json.dumps(engine_main(json.load(f))))
        return 0
    os.makedirs(a.out, exist_ok=True)
    pre = preflight()
    with open(os.path.join(a.out, "preflight.json"), "w") as f:
        json.dump(pre, f, indent=2)
    if not pre["gpu"]:
        print("v2_cases.py: no CUDA GPU here; stopped after the preflight", file=sys.stderr)
        return 3
    from shmkv.engines.models import write_llama

    model = write_llama(os.path.join(a.out, "model"))
    cases = prompts()
    cache = {"cache_name": f"shmkv-v2-{os.getpid()}", "capacity": "2GiB"}
    base = {"model": model, "cudagraph": a.cudagraph}
    # engine A stores (in a KV cache of 200 blocks: the preemption set cannot fit), engine B hits
    runs = {label: run_engine({**base, "shmkv": cache, "prefix_caching": False, "cases": cases, "blocks": 200},
                              os.path.join(a.out, f"engine-{label}.log")) for label in ("a", "b")}
    # the reference: the same engine without shmkv, each prompt at the split the engine had
    splits = {f"{label}/{case}": [(p, got["cached"]) for (p, _), got in zip(cases[case], res[case])]
              for label, res in runs.items() if "error" not in res for case in cases}
    ref = run_engine({**base, "shmkv": None, "prefix_caching": True, "reference": True, "cases": splits},
                     os.path.join(a.out, "reference.log"))
    results: dict = {"cudagraph": a.cudagraph, "preflight": pre,
                     "seconds": {"a": runs["a"].get("seconds"), "b": runs["b"].get("seconds"),
                                 "reference": ref.get("seconds")}}
    for case in cases:
        row: dict = {}
        for label, res in runs.items():
            if "error" in res or "error" in ref:
                row[f"engine_{label}"] = res.get("error") or ref.get("error")
                continue
            got, exp = res[case], ref[f"{label}/{case}"]
            row[f"engine_{label}"] = {"equal": sum(g["tokens"] == w["tokens"] for g, w in zip(got, exp)),
                                      "of": len(exp), "hit_tokens": sum(g["cached"] for g in got)}
        results[case] = row
    ok = all(isinstance(r, dict) and r["equal"] == r["of"] for row in results.values() if isinstance(row, dict)
             for r in row.values() if isinstance(r, dict) and "equal" in r)
    results["all_equal"] = ok
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print(json.dumps({k: v for k, v in results.items() if k != "preflight"}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
