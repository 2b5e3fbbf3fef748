"""The transfer engine's bookkeeping, driven through its CPU backend with
copies held in flight (deferred streams: a copy runs only when something
waits for it), which is where a GPU's asynchronous copies would be:

  * delayed frees: exactly the requests with store items are reported in
    finished_sending, each once, after their copies (never one that stored
    nothing: vLLM asserts on it and EngineCore dies);
  * preemption: a preempted request's pending store reads its blocks before
    vLLM reuses them;
  * wait_for_save never waits for a load's copies (the leases go back once
    they have run);
  * a store whose copy fails is given back only once its copies have run;
  * a forward that cannot wait layer by layer waits for every layer up front.
"""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import torch
from helpers import REPO
from kv_reference import make_cache
from worker_steps import BLOCKS, BS, LAYERS, NAMES, loaded, run_vllm_step, step, stored, worker_side

from shmkv import Store
from shmkv.config import load_config
from shmkv.integration.vllm.engine_inputs import KVGroup
from shmkv.integration.vllm.worker import WorkerSide
from shmkv.transfer import GroupWindow, StoreItem, TransferEngine
from shmkv.transfer.layout import KVLayout


def run_speculative_step(side: WorkerSide, meta, finished=()) -> set[str] | None:
    """vLLM's order for one step with speculative decoding
    (defer_kv_connector_finalize): get_finished before wait_for_save."""
    side.bind(meta)
    side.handle_preemptions(meta)
    side.start_load(meta)
    for name in NAMES:
        side.wait_layer(name)
    sending, _ = side.get_finished(set(finished))
    side.wait_for_save(meta)
    return sending


def test_with_speculative_decoding_a_request_is_not_reported_before_its_stores_are_issued(store):
    """get_finished runs before wait_for_save: a request vLLM names finished
    in the very step whose metadata carries its stores keeps its blocks until
    those stores have been issued and have run."""
    side, caches = worker_side(store, 1)
    meta = step(stores=[stored("r", b"k1" * 8, 3, 5)])
    assert run_speculative_step(side, meta, finished={"r"}) is None, "r's stores were not even issued"
    assert side.worker.pending_requests() == {"r"}
    assert run_speculative_step(side, step()) is None, "r's copy has not run"
    side.worker.wait_stores()
    assert run_speculative_step(side, step()) == {"r"}
    assert run_speculative_step(side, step()) is None, "each request is reported once"
    assert store.get(b"k1" * 8) is not None
    side.shutdown()


def test_a_rank_that_does_not_store_reports_its_delayed_requests_at_once(store):
    """MLA: rank 0 stores the latent KV every rank holds; rank 1 stores
    nothing but must still report the delayed request (vLLM frees it once
    every rank has)."""
    caches = dict(zip(NAMES, make_cache("cpu", LAYERS, BLOCKS, BS, 1, 8, torch.bfloat16, seed=3)))
    side = WorkerSide(load_config({"cache_name": store.name}, env={}), store, [KVGroup(tuple(NAMES))], 1, BS,
                      stores=False, deferred=True)
    side.register_kv_caches(caches)
    assert run_speculative_step(side, step(stores=[stored("r", b"k1" * 8, 3, 5)]), finished={"r"}) == {"r"}
    assert side.worker.pending_requests() == set()
    assert store.get(b"k1" * 8) is None, "rank 1 stored nothing"
    side.shutdown()


def test_the_transfer_engine_imports_without_vllm():
    code = ("import sys; sys.modules['vllm'] = None\n"
            "import shmkv.transfer, shmkv.transfer.engine, shmkv.transfer.streams\n"
            "assert not any(m == 'vllm' or m.startswith('vllm.') for m in sys.modules if sys.modules[m])\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_only_requests_with_store_items_are_reported_each_once_after_their_copies(store):
    """Finding 1: a prompt under one block, a full hit or a kv_consumer engine
    stores nothing, so vLLM freed its blocks at once: reporting it kills EngineCore."""
    side, _ = worker_side(store, 1)
    store.put(b"old" * 5 + b"!", bytes(side.worker.layout.payload_bytes(BS)))
    meta = step(stores=[stored("r", b"k1" * 8, 3, 5), stored("x", b"old" * 5 + b"!", 6)])
    sending, _ = run_vllm_step(side, meta)
    assert sending is None, "nothing finished yet"
    assert side.worker.pending_requests() == {"r"}, "x was already cached: nothing to copy"
    # r and x finished; "short" (a prompt under one block) and "hit" (a full hit) stored nothing
    sending, _ = side.get_finished({"r", "x", "short", "hit"})
    assert sending == {"x"}, "x was delayed and has nothing in flight; r's copy has not run: its blocks stay"
    side.worker.wait_stores()  # the copies run (on a GPU: their events complete)
    sending, _ = side.get_finished(set())
    assert sending == {"r"}
    assert store.get(b"k1" * 8) is not None
    for _ in range(3):
        assert side.get_finished(set()) == (None, None), "each request is reported once"
    side.shutdown()


def test_an_already_cached_store_is_still_reported(store):
    """The scheduler delayed x (its store item was shipped): the worker must
    report it even though the chunk existed and nothing was copied."""
    side, _ = worker_side(store, 1)
    key = b"old" * 5 + b"!"
    store.put(key, bytes(side.worker.layout.payload_bytes(BS)))
    run_vllm_step(side, step(stores=[stored("x", key, 6)]))
    assert side.worker.pending_requests() == set()
    assert side.get_finished({"x"}) == ({"x"}, None)
    side.shutdown()


def test_a_preempted_requests_store_reads_its_blocks_before_they_are_reused(store):
    """Finding 3: vLLM frees a preempted request's blocks at once and its next
    forward may overwrite them; the pending store must have read them first."""
    side, caches = worker_side(store, 1)
    before = [caches[n][[3, 5]].clone() for n in NAMES]
    run_vllm_step(side, step(stores=[stored("r", b"k1" * 8, 3, 5)]))
    assert side.worker.pending_requests() == {"r"}, "the store is still in flight"
    side.bind(step(preempted={"r"}))
    side.handle_preemptions(step(preempted={"r"}))
    for n in NAMES:  # the next forward reuses blocks 3 and 5 for another request
        caches[n][[3, 5]] = 7
    side.worker.wait_stores()
    assert side.worker.counters["reused_block_store_waits"] == 1
    other, dst = worker_side(store, 2)
    failed, _ = other.worker.load([loaded("q", b"k1" * 8, 8, 9)])
    assert failed == set()
    for n, b in zip(NAMES, before):
        assert torch.equal(dst[n][[8, 9]].view(torch.uint8), b.view(torch.uint8)), "the chunk holds the old KV"
    other.shutdown()
    side.shutdown()


def test_wait_for_save_knows_how_the_steps_loads_ended_before_vllm_does(store):
    """A load's failure can show only once its copies ran (a failed copy, a
    lease reclaimed meanwhile), and vLLM must hear of it in the step that
    read the blocks. wait_for_save comes after the forward was issued: it
    waits there for the step's load copies (once), gives the leases back and
    knows the outcome; finding 7's stall (a wait before the forward) is not
    back: start_load returns with the copies still queued."""
    a, _ = worker_side(store, 1)
    a.worker.store([stored("r", b"k1" * 8, 3, 5)])
    b, _ = worker_side(store, 2)
    meta = step(loads=[loaded("q", b"k1" * 8, 8, 9)])
    b.bind(meta)
    b.start_load(meta)  # the forward does not wait here (a GPU's compute stream would)
    assert store.stats()["leases_held"] == 1, "start_load returned with the load's copies still queued"
    b.wait_for_save(meta)
    assert store.stats()["leases_held"] == 0, "the copies ran and the lease went back"
    assert b.worker.counters["load_outcome_waits"] == 1 and b.worker.counters["loaded_tokens"] == 2 * BS
    assert b.load_errors() == set()
    b.wait_for_save(step())  # a step without loads: nothing to wait for
    assert b.worker.counters["load_outcome_waits"] == 1
    b.shutdown()
    a.shutdown()


def test_a_store_whose_copy_fails_is_given_back_only_after_its_copies_ran(cache_name):
    """Finding 11: a two-group store whose second group fails to issue while
    the first group's copy is queued: aborting at once would free an extent
    that copy is about to write."""
    store = Store.create(cache_name, 16 << 20, alignment=256)
    try:
        caches = [make_cache("cpu", 1, BLOCKS, BS, 2, 8, torch.bfloat16, seed=s) for s in (1, 2)]
        layouts = [KVLayout("cpu", c, [f"g{g}.layer"], block_size=BS) for g, c in enumerate(caches)]
        eng = TransferEngine(store, layouts, 0, deferred=True)
        item = StoreItem("r", (b"k1" * 8,), BS, (GroupWindow(0, 1, (3,)), GroupWindow(0, 1, (BLOCKS + 4,))))
        eng.submit_store([item])
        [job] = eng._stores
        assert job.failed and job.reservation.is_open, "the first group's copy is queued: the room stays reserved"
        eng.wait_stores()
        assert not job.reservation.is_open and eng.counters["store_errors"] == 1
        assert store.get(b"k1" * 8) is None and eng.tallies["r"].not_stored == 1
        eng.shutdown()
    finally:
        store.close()


def test_a_forward_that_cannot_wait_per_layer_waits_for_every_layer_first(store):
    """Finding 2: a FULL CUDA graph replays no Python, so wait_for_layer_load
    never runs; start_load_kv makes the compute wait for all loads instead."""
    a, src = worker_side(store, 1)
    a.worker.store([stored("r", b"k1" * 8, 3, 5)])
    b, dst = worker_side(store, 2)
    meta = step(loads=[loaded("q", b"k1" * 8, 8, 9)])
    b.bind(meta)
    b.start_load(meta, whole_forward=True)
    for n in NAMES:  # what the graph reads, with no wait_for_layer_load in between
        assert torch.equal(dst[n][[8, 9]].view(torch.uint8), src[n][[3, 5]].view(torch.uint8))
    b.wait_for_save(meta)
    assert b.load_errors() == set() and store.stats()["leases_held"] == 0
    b.shutdown()
    a.shutdown()


def test_the_connector_decides_from_vllms_forward_context():
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import ForwardContext

    from shmkv.integration.vllm import ShmKVConnector
    from shmkv.integration.vllm.connector import _no_layer_hooks

    def ctx(mode, attn_metadata=None):
        return ForwardContext(no_compile_layers={}, attn_metadata={} if attn_metadata is None else attn_metadata,
                              slot_mapping={}, cudagraph_runtime_mode=mode)

    assert _no_layer_hooks(ctx(CUDAGraphMode.FULL), {}), "V1 replays a FULL graph in its forward context"
    assert not _no_layer_hooks(ctx(CUDAGraphMode.PIECEWISE), {})
    assert not _no_layer_hooks(ctx(CUDAGraphMode.NONE), {})
    outside = ForwardContext(no_compile_layers={}, attn_metadata=None, slot_mapping={})
    assert _no_layer_hooks(outside, {"attn_metadata": {"l0": object()}}), "V2's FULL branch: outside any forward"
    assert _no_layer_hooks(outside, {}), "no forward context: nothing will wait layer by layer"
    assert _no_layer_hooks(None, {})
    assert ShmKVConnector.requires_piecewise_for_cudagraph({}) is False, "decode batches keep their full graphs"


def test_context_parallelism_is_refused_naming_the_setting():

    from shmkv.integration.vllm.connector import context_parallel_refusal

    assert context_parallel_refusal(SimpleNamespace(decode_context_parallel_size=1,
                                                    prefill_context_parallel_size=1)) is None
    why = context_parallel_refusal(SimpleNamespace(decode_context_parallel_size=2, prefill_context_parallel_size=1))
    assert why.startswith("decode_context_parallel_size=2:") and "decode_context_parallel_size=1" in why
    why = context_parallel_refusal(SimpleNamespace(decode_context_parallel_size=1, prefill_context_parallel_size=4))
    assert why.startswith("prefill_context_parallel_size=4:")


def test_a_copy_that_fails_on_the_cpu_thread_is_carried_by_the_next_event():
    from shmkv.transfer.streams import CpuStream

    s = CpuStream("test")  # a real thread
    ran = []
    s.run(lambda _: ran.append(1))
    s.run(lambda _: (_ for _ in ()).throw(ValueError("boom")))
    first = s.record()
    s.run(lambda _: ran.append(2))
    second = s.record()
    second.synchronize()
    assert first.query() and isinstance(first.error, ValueError) and second.error is None
    assert ran == [1, 2], "a failed copy does not stop the stream"
    s.close()


def test_a_steps_loads_are_one_copy_call_per_layer_whatever_the_number_of_units(store):
    """Finding 6: every (unit, layer) was one Python call (with its own index
    upload and allocation on a GPU); now each group of a step is prepared once
    and each layer is one call for all its units."""
    a, src = worker_side(store, 1)
    keys = [bytes([9, i]) * 8 for i in range(3)]
    a.worker.store([stored("r", k, b) for k, b in zip(keys, (3, 5, 6))])
    b, dst = worker_side(store, 2)
    lay = b.worker.layouts[0]
    prepared, calls = [], []
    real = lay.copier.batch

    def counting_batch(entries, stream=None):
        batch = real(entries, stream)
        prepared.append(len(entries))
        inner = batch.copy_layer
        batch.copy_layer = lambda layer, s=None: (calls.append(layer), inner(layer, s))[1]
        return batch

    lay.copier.batch = counting_batch
    failed, _ = b.worker.load([loaded("q", k, d) for k, d in zip(keys, (8, 9, 10))])
    assert failed == set()
    assert prepared == [3], "one batch of the three units"
    assert calls == list(range(LAYERS)), "one call per layer"
    for n in NAMES:
        assert torch.equal(dst[n][[8, 9, 10]].view(torch.uint8), src[n][[3, 5, 6]].view(torch.uint8))
    b.shutdown()
    a.shutdown()
