"""The namespace knows every byte of the weights, not only their path:
shmkv's tier outlives the engine (vLLM's own prefix cache does not), so new
weights written under the same path (a new checkpoint, a partial fine-tune or
a LoRA merge saved over the same files) must never meet KV computed with the
old ones; the same files elsewhere (another host's copy, another mtime) must
still share. Each file's digest is remembered by its content's stat, so a
restart reads nothing."""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from shmkv.integration.vllm.weights_files import DIGESTS_FILE, FilesIdentity, files_identity


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def weights(directory, seed: int, size: int = 3 << 20) -> str:
    os.makedirs(directory, exist_ok=True)
    data = np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()
    with open(os.path.join(directory, "model.safetensors"), "wb") as f:
        f.write(data)
    with open(os.path.join(directory, "config.json"), "w") as f:
        f.write("{}")
    return str(directory)


def negate_in_place(path: str, names: list[str]) -> None:
    """Negate these tensors inside a safetensors file (same size; mtime put back)."""
    st = os.stat(path)
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        for name in names:
            lo, hi = header[name]["data_offsets"]
            assert header[name]["dtype"] == "BF16"
            f.seek(8 + n + lo)
            raw = np.frombuffer(f.read(hi - lo), dtype=np.uint16) ^ np.uint16(0x8000)  # the sign bits
            f.seek(8 + n + lo)
            f.write(raw.tobytes())
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_one_tensor_changed_in_place_is_another_identity(tmp_path):
    # the issue's case: layer 0's q_proj and k_proj negated in model.safetensors (a sampled
    # identity of 16 x 4 KiB per file did not see it)
    from shmkv.engines.models import write_llama

    d = write_llama(str(tmp_path / "model"))
    before = files_identity(d)
    negate_in_place(os.path.join(d, "model.safetensors"),
                    ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
    after = files_identity(d)
    assert before.startswith("files:") and after != before
    negate_in_place(os.path.join(d, "model.safetensors"),
                    ["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"])
    assert files_identity(d) == before, "the same bytes again: the same identity"


def test_new_weights_under_the_same_path_are_another_identity(tmp_path):
    d = weights(tmp_path / "m", seed=1)
    before = files_identity(d)
    st = os.stat(os.path.join(d, "model.safetensors"))
    weights(d, seed=2)  # same size, same name
    os.utime(os.path.join(d, "model.safetensors"), ns=(st.st_atime_ns, st.st_mtime_ns))  # even the mtime kept
    assert before.startswith("files:") and files_identity(d) != before


def test_a_copy_elsewhere_is_the_same_identity(tmp_path):
    d = weights(tmp_path / "m", seed=3)
    copy = shutil.copytree(d, tmp_path / "copy", copy_function=shutil.copyfile)  # new mtimes
    assert files_identity(str(copy)) == files_identity(d)


def test_a_hub_model_is_named_by_its_commit_and_no_files_by_the_path(tmp_path):
    assert files_identity("org/model", commit="0123abcd") == "hub:0123abcd"
    assert files_identity(str(tmp_path / "nothing-here")) == "path:" + str(tmp_path / "nothing-here")


def test_a_digest_is_remembered_and_read_again_after_a_rewrite(tmp_path, monkeypatch):
    d = weights(tmp_path / "m", seed=4)
    first = files_identity(d)
    digests = os.path.join(os.environ["SHMKV_RUNTIME_DIR"], DIGESTS_FILE)
    assert oct(os.stat(digests).st_mode & 0o777) == "0o600"
    assert len(json.load(open(digests))) == 1
    reads = []
    real_open = open

    def counting_open(path, mode="r", *a, **k):
        if str(path).endswith(".safetensors"):
            reads.append(path)
        return real_open(path, mode, *a, **k)

    monkeypatch.setattr("builtins.open", counting_open)
    assert files_identity(d) == first
    assert reads == [os.path.join(d, "model.safetensors")], "opened for its stat only"
    weights(d, seed=5)  # rewritten: new ctime
    assert files_identity(d) != first
    assert len(json.load(real_open(digests))) == 2


def test_the_digest_runs_in_a_thread_and_an_unreadable_file_leaves_it_unknown(tmp_path):
    d = weights(tmp_path / "m", seed=6)
    ident = FilesIdentity(d)
    assert ident.wait(30) and ident.value == files_identity(d)
    bad = weights(tmp_path / "bad", seed=7)
    os.chmod(bad, 0o700)
    os.remove(os.path.join(bad, "model.safetensors"))
    os.mkdir(os.path.join(bad, "model.safetensors"))  # a weight "file" that cannot be read
    ident = FilesIdentity(bad)
    assert ident.wait(30) and ident.value is None


def test_the_native_tier_namespace_knows_the_weights_too(tmp_path):
    from types import SimpleNamespace

    from shmkv.integration.vllm.native_identity import NativeIdentity
    from shmkv.integration.vllm.native_tier import namespace_root

    d = weights(tmp_path / "m", seed=5)
    cfg = SimpleNamespace(
        model=SimpleNamespace(name=d, dtype="bfloat16"), kv_cache_layout="LBHNC", canonical_layout=False,
        replicated_layout=False, cache=SimpleNamespace(tokens_per_hash=16, blocks_per_chunk=16), groups=[],
        worker_kv_bytes_per_block=4096, parallel=SimpleNamespace(is_parallelism_agnostic=True))
    before, fields = namespace_root(cfg, 1 << 16, NativeIdentity(cfg).fields())  # no VllmConfig: the files
    assert fields["weights"].startswith("files:")
    weights(d, seed=6)
    assert namespace_root(cfg, 1 << 16, NativeIdentity(cfg).fields())[0] != before
