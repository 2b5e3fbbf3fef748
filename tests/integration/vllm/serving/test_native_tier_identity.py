"""The native tier's keys name what the engine computes with (#63 item 3's
second half, native_identity.py): the resolved model configuration (a
config override moves the root), the weights as the workers loaded them
(their boards), and the weights in memory (a worker call that writes them:
MISS and nothing stored while it runs, a new generation after, the starting
root when the weights are back). vLLM's OffloadingConnector refuses the CPU
backend, so no engine runs it here: checked with vLLM's own config objects
and its TieringOffloadingManager (tests/support/helpers.NativeEngine)."""

from __future__ import annotations

import types

import pytest
import torch
from helpers import NativeEngine

from shmkv.integration.vllm import loaded_weights, native_identity
from shmkv.integration.vllm.loaded_weights import uses_native_tier
from shmkv.integration.vllm.native_identity import VLLM_CONFIG_ATTR, install_config_hook
from shmkv.integration.vllm.weights import WorkerWeights, board_id

pytestmark = pytest.mark.slow

TIER = {"type": "shmkv"}


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def native_config(model_dir: str, cache: str, engine: str = "native-a", **model_kw):
    from vllm.config import KVTransferConfig, ModelConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, **model_kw)
    ktc = KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both", engine_id=engine,
                           kv_connector_extra_config={"secondary_tiers": [dict(TIER, cache_name=cache)]})
    return VllmConfig(model_config=mc, kv_transfer_config=ktc)


def test_which_engines_use_the_native_tier():
    from vllm.config import KVTransferConfig

    def ktc(**kw):
        return KVTransferConfig(kv_role="kv_both", **kw)

    assert uses_native_tier(ktc(kv_connector="OffloadingConnector",
                                kv_connector_extra_config={"secondary_tiers": [TIER]}))
    assert not uses_native_tier(ktc(kv_connector="OffloadingConnector",
                                    kv_connector_extra_config={"secondary_tiers": [{"type": "fs"}]}))
    assert uses_native_tier(ktc(kv_connector="MultiConnector", kv_connector_extra_config={"connectors": [
        {"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"secondary_tiers": [TIER]}}]}))
    assert not uses_native_tier(ktc(kv_connector="ShmKVConnector")) and not uses_native_tier(None)


def test_the_plugin_hooks_vllms_offloading_config_so_it_carries_the_engine_config():
    import vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector as oc
    from vllm.plugins import load_general_plugins

    load_general_plugins()
    assert getattr(oc.build_offloading_config, "__wrapped__", None) is not None, "shmkv's plugin hooked it"
    from shmkv.bench.native_tier import offloading_config

    built = offloading_config({"cache": "c", "engine": "e"})
    fake = types.SimpleNamespace(build_offloading_config=lambda vc, kcc: built)
    assert install_config_hook(fake) and install_config_hook(fake)  # idempotent
    vc = object()
    assert getattr(fake.build_offloading_config(vc, None), VLLM_CONFIG_ATTR) is vc


def test_a_config_override_moves_the_root(model_dir, cache_name):
    plain, again = native_config(model_dir, cache_name), native_config(model_dir, cache_name, engine="native-b")
    yarn = native_config(model_dir, cache_name, engine="native-c", hf_overrides={"rope_theta": 1_000_000.0})
    roots = []
    for vc in (plain, again, yarn):
        e = NativeEngine(cache_name, vc.kv_transfer_config.engine_id, vllm_config=vc, model=model_dir)
        try:
            roots.append(e.tier.root)
            assert e.tier.fields["weights"].startswith("files:"), "no worker board: the files name the weights"
        finally:
            e.close()
    assert roots[0] == roots[1] != roots[2]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = torch.nn.Parameter(torch.arange(64, dtype=torch.float32).reshape(8, 8))

    def load_weights(self, weights):
        return set()


def test_weights_changed_in_memory_move_the_root_and_back(model_dir, cache_name):
    vc = native_config(model_dir, cache_name, engine="native-mem")
    from vllm.config import set_current_vllm_config

    model = _Model()
    with set_current_vllm_config(vc):  # a worker of this engine: shmkv's hooks around vLLM's post-load step
        loaded_weights.note_loaded(model)
        loaded_weights.after_processing(model)
    watch = native_identity._watches.pop((board_id(vc), 0))
    assert watch.models == [model] and watch.settle_after_calls
    e = NativeEngine(cache_name, "native-mem", vllm_config=vc, model=model_dir)
    try:
        start = e.tier.root
        assert e.tier.fields["weights"].startswith("tensors:"), "the workers' digest as loaded names the weights"
        keys = e.keys(4)
        e.store(keys)
        assert e.tier.counters["stored"] == 4

        def update(value):  # what a weight-transfer backend or a user's collective_rpc does in the worker
            watch.mark_dirty("test")  # loaded_weights' worker-call hook, before the call runs
            assert e.tier._current_root() is None
            assert e.tier.lookup(keys[0], e.ctx).name == "MISS", "nothing is served while the weights change"
            with torch.no_grad():
                model.w.fill_(value)
            watch.publish()  # ... and after it returned (settle_after_calls)

        update(7.0)
        new = e.tier._current_root()
        assert new is not None and new != start and "weights_gen" in e.tier.fields
        assert e.tier.lookup(keys[0], e.ctx).name == "MISS", "the old weights' chunks are not these weights'"
        update(0.0)
        with torch.no_grad():
            model.w.copy_(torch.arange(64, dtype=torch.float32).reshape(8, 8))
        watch.publish()
        assert e.tier._current_root() == start, "the starting weights again: the starting root"
        assert e.tier.lookup(keys[0], e.ctx).name == "HIT"
        assert e.tier.counters["weights_unknown"] >= 2
    finally:
        e.close()


def test_the_worker_call_hook_settles_a_native_watch_once_the_call_returned(model_dir):
    vc = native_config(model_dir, "unused", engine="native-hook")
    model = _Model()
    watch = WorkerWeights(board_id(vc), 0, [model], settle_after_calls=True)
    before = watch.fingerprint
    loaded_weights._around_call("execute_model", lambda: None)
    assert not watch.dirty and watch.fingerprint == before, "a read-only call leaves it alone"

    def write():
        assert watch.dirty, "marked before the call ran"
        with torch.no_grad():
            model.w.add_(1)

    loaded_weights._around_call(write, write)
    assert not watch.dirty and watch.fingerprint != before, "fingerprinted again as soon as it returned"
