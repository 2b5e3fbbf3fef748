"""The namespace knows the weights, not only their path: shmkv's tier
outlives the engine (vLLM's own prefix cache does not), so new weights
written under the same path (a new checkpoint, an RL update) must never meet
KV computed with the old ones; the same files elsewhere (another host's
copy, another mtime) must still share."""

from __future__ import annotations

import os
import shutil

import numpy as np

from shmkv.integration.vllm.engine_inputs import weights_identity


def weights(directory, seed: int, size: int = 3 << 20) -> str:
    os.makedirs(directory, exist_ok=True)
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write("{}")
    return str(directory)


def test_new_weights_under_the_same_path_are_another_identity(tmp_path):
    d = weights(tmp_path / "m", seed=1)
    before = weights_identity(d)
    st = os.stat(os.path.join(d, "model.safetensors"))
    weights(d, seed=2)  # same size, same name
    os.utime(os.path.join(d, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns))  # even the mtime kept
    assert before.startswith("files:") and weights_identity(d) != before


def test_an_update_of_a_small_part_of_the_weights_is_another_identity(tmp_path):
    d = weights(tmp_path / "m", seed=1)
    before = weights_identity(d)
    path = os.path.join(d, "model.safetensors")
    with open(path, "r+b") as f:  # an RL step nudges every tensor: here, every 64 KiB of the file
        data = bytearray(f.read())
        for off in range(0, len(data), 64 << 10):
            data[off + 100] ^= 1
        f.seek(0)
        f.write(data)
    assert weights_identity(d) != before


def test_a_copy_elsewhere_is_the_same_identity(tmp_path):
    d = weights(tmp_path / "m", seed=3)
    copy = shutil.copytree(d, tmp_path / "copy", copy_function=shutil.copyfile)  # new mtimes
    assert weights_identity(str(copy)) == weights_identity(d)


def test_a_hub_model_is_named_by_its_commit(tmp_path):
    assert weights_identity("org/model", commit="0123abcd") == "hub:0123abcd"
    assert weights_identity(str(tmp_path / "nothing-here")) == ""


def test_the_native_tier_namespace_knows_the_weights_too(tmp_path):
    from types import SimpleNamespace

    from shmkv.integration.vllm.native_tier import namespace_root

    d = weights(tmp_path / "m", seed=5)
    cfg = SimpleNamespace(
        model=SimpleNamespace(name=d, dtype="bfloat16"), kv_cache_layout="LBHNC", canonical_layout=False,
        replicated_layout=False, cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=16), groups=[],
        worker_kv_bytes_per_block=4096, parallel=SimpleNamespace(is_parallelism_agnostic=True))
    before, fields = namespace_root(cfg, 1 << 16)
    assert fields["weights"].startswith("files:")
    weights(d, seed=6)
    assert namespace_root(cfg, 1 << 16)[0] != before
