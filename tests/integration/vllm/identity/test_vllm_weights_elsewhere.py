"""Weights that are not in the model directory are keyed by the tensors the
engine loaded (#63 item 1): engines whose `model` is one directory holding
only config.json and whose weights come from elsewhere (vLLM's sharded-state
loader with `model_weights`, as the runai streamer leaves `model` a directory
of configs) share keys only when their loaded tensors are equal. On b7fe4e6
the key named the directory's weight files (none: its path), so the engine
of other weights loaded the first engine's 2,944 tokens (128-token blocks) and computed on
them; now it loads nothing, and an engine of the same tensors from another
directory hits all of them."""

from __future__ import annotations

import os
import shutil

import pytest
from helpers import random_prompt

from shmkv.engines.models import TEST_MODEL, write_llama

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=29)


def hit(engine) -> int:
    """Every whole block of P below its last token (what vLLM asks a connector for), in the engine's block size."""
    return (len(P) - 1) // engine.block_size * engine.block_size


def sharded_state(hf_dir: str, out_dir: str) -> str:
    """The checkpoint in hf_dir as vLLM's sharded-state loader reads it for
    TP = 1: one file, vLLM's own parameter names (q, k, v and gate, up fused;
    the attention layers' scales)."""
    import torch
    from safetensors.torch import load_file, save_file

    hf = load_file(os.path.join(hf_dir, "model.safetensors"))
    out = {}
    for name, t in hf.items():
        if ".k_proj." in name or ".v_proj." in name or ".up_proj." in name:
            continue
        if ".q_proj." in name:
            out[name.replace("q_proj", "qkv_proj")] = torch.cat(
                [t, hf[name.replace("q_proj", "k_proj")], hf[name.replace("q_proj", "v_proj")]])
        elif ".gate_proj." in name:
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat([t, hf[name.replace("gate_proj", "up_proj")]])
        else:
            out[name] = t
    for layer in {n.split(".")[2] for n in hf if n.startswith("model.layers.")}:
        for scale in ("_k_scale", "_v_scale", "_q_scale", "_prob_scale"):  # vLLM's attention scales (no fp8: 1)
            out[f"model.layers.{layer}.self_attn.attn.{scale}"] = torch.tensor(1.0)
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in out.items()}, os.path.join(out_dir, "model-rank-0-part-0.safetensors"))
    return out_dir


def test_weights_from_elsewhere_share_keys_only_with_the_same_tensors(cache_name, start_engine, tmp_path):
    import dataclasses

    first = write_llama(str(tmp_path / "hf-first"), TEST_MODEL)
    other = write_llama(str(tmp_path / "hf-other"), dataclasses.replace(TEST_MODEL, seed=7))
    configs = tmp_path / "configs"
    configs.mkdir()
    shutil.copy(os.path.join(first, "config.json"), configs / "config.json")
    weights = {"first": sharded_state(first, str(tmp_path / "w-first")),
               "other": sharded_state(other, str(tmp_path / "w-other")),
               "first-copy": sharded_state(first, str(tmp_path / "w-first-copy"))}
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}

    def engine(label: str):
        return start_engine(f"elsewhere-{label}", model_dir=str(configs), shmkv=cfg,
                            llm_kwargs={"load_format": "sharded_state", "model_weights": weights[label]})

    a = engine("first")
    assert a.generate([P])["num_cached_tokens"] == [0]
    assert a.generate([P])["num_cached_tokens"] == [hit(a)], "its own chunks hit (through shmkv)"
    a.close()
    b = engine("other")
    assert b.generate([P])["num_cached_tokens"] == [0], "other tensors, the same directory: none of the first's KV"
    b.close()
    c = engine("first-copy")
    assert c.generate([P])["num_cached_tokens"] == [hit(c)], "the same tensors from another directory: all of it"
