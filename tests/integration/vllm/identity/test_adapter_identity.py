"""A LoRA adapter is keyed by what each worker read (#63 item 3,
adapters.py): the directory's digest follows its files, a read during which
the files moved matches nothing, each rank's held adapters are read from
vLLM's own adapter cache (an evicted one is gone), the board tells the
scheduler half what every rank holds, and a rank holding other tensors than
a request's keys name refuses its loads and stores nothing of it, for the
rest of the request. End to end: test_vllm_lora.py."""

from __future__ import annotations

import os
import types

import pytest
from worker_steps import loaded, run_vllm_step, step, stored, worker_side

from shmkv.integration.vllm import adapters
from shmkv.integration.vllm.weights import EngineWeights, WorkerWeights


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def _adapter(d, payload: bytes) -> str:
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "adapter_config.json"), "w") as f:
        f.write('{"r": 8}')
    tmp = os.path.join(d, ".new")
    with open(tmp, "wb") as f:
        f.write(payload)
    os.replace(tmp, os.path.join(d, "adapter_model.safetensors"))  # renamed in, as a trainer's save does
    return str(d)


def test_the_directory_digest_follows_its_files(tmp_path):
    d = _adapter(tmp_path / "a", b"\x01" * 4096)
    first = adapters.directory_digest(d)
    assert first and first == adapters.directory_digest(d) and adapters.usable(first)
    _adapter(d, b"\x02" * 4096)
    assert adapters.directory_digest(d) not in (None, first)
    assert adapters.directory_digest(str(tmp_path / "missing")) is None
    assert adapters.directory_digest("org/some-hub-adapter") is None


def test_a_read_during_which_the_files_moved_matches_nothing(tmp_path):
    d = _adapter(tmp_path / "a", b"\x01" * 4096)
    got, digest = adapters._digest_around(d, lambda: "tensors")
    assert got == "tensors" and digest == adapters.directory_digest(d)
    got, digest = adapters._digest_around(d, lambda: _adapter(d, b"\x03" * 4096))
    assert digest.startswith("unsettled:") and not adapters.usable(digest)
    assert digest != adapters.directory_digest(d)


class _Cache:
    """vLLM's LRUCacheLoRAModelManager as adapters.py reads it."""

    def __init__(self, model):
        self.model, self.held = model, {}

    def list_adapters(self):
        return dict(self.held)


def _fake_vllm(load):
    class WorkerLoRAManager:
        def __init__(self, model):
            self._adapter_manager = _Cache(model)

        def _load_adapter(self, lora_request):
            return load(lora_request)

    return types.SimpleNamespace(WorkerLoRAManager=WorkerLoRAManager)


def test_each_rank_holds_what_it_read_and_forgets_an_evicted_adapter(tmp_path, monkeypatch):
    monkeypatch.setattr(adapters, "_tracking", True)
    d = _adapter(tmp_path / "latest", b"\x01" * 4096)
    v1 = adapters.directory_digest(d)

    class LoRAModel:
        pass

    module = _fake_vllm(lambda req: LoRAModel())
    assert adapters.install_adapter_hook(module) and adapters.install_adapter_hook(module)  # idempotent
    model, other_model = object(), object()
    mgr = module.WorkerLoRAManager(model)
    req = types.SimpleNamespace(lora_name="A", lora_int_id=7, lora_path=d)
    mgr._adapter_manager.held[7] = mgr._load_adapter(req)
    assert adapters.held_adapters([model]) == {7: v1}
    _adapter(d, b"\x02" * 4096)  # rewritten in place: vLLM keeps the tensors it read
    assert adapters.held_adapters([model]) == {7: v1}
    del mgr._adapter_manager.held[7]  # evicted (vLLM's LRU)
    assert adapters.held_adapters([model]) == {}
    mgr._adapter_manager.held[7] = mgr._load_adapter(req)  # read again: the key moves
    v2 = adapters.directory_digest(d)
    assert adapters.held_adapters([model]) == {7: v2} != {7: v1}
    other = module.WorkerLoRAManager(other_model)  # another engine of this process, another adapter under id 7
    other._adapter_manager.held[7] = other._load_adapter(
        types.SimpleNamespace(lora_name="B", lora_int_id=7, lora_path=_adapter(tmp_path / "b", b"\x09" * 64)))
    assert adapters.held_adapters([other_model]) == {7: adapters.directory_digest(str(tmp_path / "b"))}
    assert adapters.held_adapters([model]) == {7: v2}


def test_the_boards_say_what_every_rank_holds(monkeypatch):
    monkeypatch.setattr(WorkerWeights, "_wrap", lambda self, m: None)
    ranks = [WorkerWeights("engine-lora", r, []) for r in range(2)]
    engine = EngineWeights("engine-lora", 2, files=None)
    engine.refresh()
    assert engine.adapter(1) is None, "no rank holds it"
    ranks[0].set_adapters({1: "aa"})
    engine.refresh()
    assert engine.adapter(1) is None, "rank 1 does not hold it yet"
    ranks[1].set_adapters({1: "aa", 2: "bb"})
    engine.refresh()
    assert engine.adapter(1) == "aa" and engine.adapter(2) is None
    ranks[1].set_adapters({1: "cc"})
    engine.refresh()
    assert engine.adapter(1) is None, "the ranks differ"


def test_a_rank_holding_other_tensors_refuses_loads_and_stores_nothing(small_store):
    store = small_store
    writer, _ = worker_side(store, 3)
    run_vllm_step(writer, step(stores=[stored("w", b"k" * 16, 2)]), finished={"w"})
    writer.shutdown()
    assert store.get(b"k" * 16) is not None
    side, _ = worker_side(store, 1)
    held = {1: "v1"}
    side.adapters_held = lambda: dict(held)
    first = step(loads=[loaded("reader", b"k" * 16, 5)],
                 stores=[stored("same", b"s" * 16, 1), stored("other", b"o" * 16, 2)])
    first.adapters = {"reader": (1, "v1"), "same": (1, "v1"), "other": (2, "v1")}  # nothing held under id 2
    assert run_vllm_step(side, first)[1] == set(), "the reader's adapter is the one its keys name"
    held[1] = "v2"  # vLLM evicted id 1 and read it again from changed files
    mixed = step(loads=[loaded("reader2", b"k" * 16, 6)], stores=[stored("same", b"t" * 16, 4)])
    mixed.adapters = {"reader2": (1, "v1"), "same": (1, "v1")}
    assert run_vllm_step(side, mixed)[1] == {6}, "the load keyed by v1 is refused: vLLM recomputes its block"
    held[1] = "v1"  # even back to v1: the request's KV mixes both, nothing more of it is stored
    later = step(stores=[stored("same", b"u" * 16, 7)])
    later.adapters = {"same": (1, "v1")}
    run_vllm_step(side, later, finished={"same", "other", "reader", "reader2"})
    side.shutdown()
    assert store.get(b"s" * 16) is not None
    assert [k for k in (b"o" * 16, b"t" * 16, b"u" * 16) if store.get(k) is not None] == []
    assert side.worker.counters["adapter_mismatch"] == 3  # other, reader2, same
