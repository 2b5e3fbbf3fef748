"""A step's load copies are issued a few layers ahead of the forward, not all
before start_load_kv returns (#50 E-G: on a GPU each layer's issue is a
launch, a stream switch and an event, and the forward's first launch waited
for all of them). Driven through deferred CPU streams (a copy runs only when
something waits for it), on a ten-layer cache:

  * submit_load returns with the first load_issue_ahead layers issued;
  * waiting for a layer issues the layers just after it and finds its own
    bytes in place; the whole walk loads every layer exactly;
  * a job nobody waits for layer by layer (an asynchronous load) is issued
    whole by being polled, and by the hooks of the forward it runs beside;
  * no copy is issued from a hook while vLLM captures a CUDA graph;
  * a synchronous load completes, and its outcome is known, without waiting
    for an asynchronous one submitted before it (their layers interleave on
    the stream: one done no longer says the other is).
"""

from __future__ import annotations

import pytest
import torch
from kv_reference import make_cache

from shmkv import Store
from shmkv.transfer import GroupWindow, LoadItem, StoreItem, TransferEngine
from shmkv.transfer.engine import LOAD_ISSUE_AHEAD
from shmkv.transfer.layout import KVLayout

BS, LAYERS, BLOCKS = 16, 10, 16
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]


def engine(store: Store, seed: int, **kw) -> tuple[TransferEngine, list[torch.Tensor]]:
    caches = make_cache("cpu", LAYERS, BLOCKS, BS, 2, 8, torch.bfloat16, seed=seed)
    return TransferEngine(store, KVLayout("cpu", caches, NAMES), 0, deferred=True, **kw), caches


def load_item(req: str, key: bytes, *blocks: int) -> LoadItem:
    return LoadItem(req, (key,), (GroupWindow(0, len(blocks), blocks),))


def raw(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def stored(store: Store, key: bytes, *blocks: int) -> list[torch.Tensor]:
    """Store `blocks` of a fresh cache under `key`; that cache."""
    src, caches = engine(store, 1)
    src.store([StoreItem("s", (key,), len(blocks) * BS, (GroupWindow(0, len(blocks), blocks),))])
    src.shutdown()
    return caches


def counting(eng: TransferEngine, ran: list) -> None:
    """Record (job, layer) of each layer copy as it runs; jobs numbered by submit order."""
    lay = eng.layouts[0]
    real = lay.copier.batch
    made = []

    def batch(entries, stream=None):
        b = real(entries, stream)
        inner, job = b.copy_layer, len(made)
        made.append(b)
        b.copy_layer = lambda layer, s=None: (ran.append((job, layer)), inner(layer, s))[1]
        return b

    lay.copier.batch = batch


def test_the_default_issues_fewer_layers_than_a_deep_model_has():
    assert 0 < LOAD_ISSUE_AHEAD < 32, "a Llama-8B's 32 layers are not all issued before the forward starts"


def test_start_load_returns_with_the_first_layers_issued(store):
    src = stored(store, b"k" * 16, 3, 5)
    eng, dst = engine(store, 2)
    job = eng.submit_load([load_item("q", b"k" * 16, 8, 9)])
    assert len(job.events) == LOAD_ISSUE_AHEAD, "the first layers' copies and events, no more"
    job.synchronize()
    assert len(job.events) == LAYERS, "waiting for the whole job issues the rest"
    assert [raw(d[[8, 9]]) for d in dst] == [raw(s[[3, 5]]) for s in src]
    eng.shutdown()


@pytest.mark.parametrize("ahead", [LOAD_ISSUE_AHEAD, 0, 1])
def test_each_layer_wait_issues_the_layers_after_it_and_finds_its_own_in_place(store, ahead):
    src = stored(store, b"k" * 16, 3, 5)
    eng, dst = engine(store, 2, load_issue_ahead=ahead)
    job = eng.submit_load([load_item("q", b"k" * 16, 8, 9)])
    assert len(job.events) == min(ahead, LAYERS)
    for p, name in enumerate(NAMES):
        job.wait_layer(name)
        assert len(job.events) == min(LAYERS, p + 1 + ahead), f"issued through layer {p} + {ahead}"
        assert raw(dst[p][[8, 9]]) == raw(src[p][[3, 5]]), f"layer {p} is in place once waited for"
    [(done, failed)] = eng.poll_loads()
    assert done is job and failed == set() and job.loaded == {"q": 2 * BS}
    assert store.stats()["leases_held"] == 0
    eng.shutdown()


def test_a_job_nobody_waits_for_is_issued_whole_by_being_polled(store):
    src = stored(store, b"k" * 16, 3, 5)
    eng, dst = engine(store, 2)
    job = eng.submit_load([load_item("q", b"k" * 16, 8, 9)])
    assert eng.poll_loads() == [], "its copies have not run (deferred)"
    assert len(job.events) == LAYERS, "polling issued every layer"
    eng.wait_loads()
    assert [j for j, _ in eng.poll_loads()] == [job]
    assert [raw(d[[8, 9]]) for d in dst] == [raw(s[[3, 5]]) for s in src]
    assert store.stats()["leases_held"] == 0
    eng.shutdown()


def test_the_forwards_hooks_issue_an_asynchronous_load_too(store):
    stored(store, b"k" * 16, 3, 5)
    eng, _ = engine(store, 2)
    job = eng.submit_load([load_item("later", b"k" * 16, 8, 9)])
    eng.issue_loads_through(NAMES[2])  # the forward's hook of layer 2, no synchronous load to wait for
    assert len(job.events) == min(LAYERS, 3 + LOAD_ISSUE_AHEAD)
    eng.issue_loads_through(NAMES[-1])
    assert len(job.events) == LAYERS
    eng.issue_loads_through("not.a.layer")  # a hook of a layer shmkv does not load: nothing
    eng.shutdown()


def test_a_synchronous_load_completes_without_waiting_for_an_asynchronous_one_before_it(store):
    """Their copies interleave on the load stream (the waiting job's layers
    first at each hook): the synchronous job's outcome is known once its own
    copies ran, in the step that read it."""
    src_a = stored(store, b"a" * 16, 1, 2)
    src_b = stored(store, b"b" * 16, 6, 7)
    eng, dst = engine(store, 2)
    ran: list = []
    counting(eng, ran)
    later = eng.submit_load([load_item("later", b"a" * 16, 8, 9)])
    now = eng.submit_load([load_item("now", b"b" * 16, 10, 11)])
    for name in NAMES:
        now.wait_layer(name)
    assert len(later.events) == LAYERS, "the hooks issued the asynchronous job along"
    now.synchronize()
    assert [j for j, _ in eng.poll_loads()] == [now], "done, though the job before it is not"
    assert now.failed == set() and later.loaded == {}
    assert [raw(d[[10, 11]]) for d in dst] == [raw(s[[6, 7]]) for s in src_b]
    eng.wait_loads()
    assert [j for j, _ in eng.poll_loads()] == [later]
    assert [raw(d[[8, 9]]) for d in dst] == [raw(s[[1, 2]]) for s in src_a]
    # the stream's order: each job's first layers at submit, then per hook the waiting job's layer first
    assert ran[:2 * LOAD_ISSUE_AHEAD] == [(0, p) for p in range(LOAD_ISSUE_AHEAD)] + \
        [(1, p) for p in range(LOAD_ISSUE_AHEAD)]
    assert ran[2 * LOAD_ISSUE_AHEAD:] == [(j, p) for p in range(LOAD_ISSUE_AHEAD, LAYERS) for j in (1, 0)]
    eng.shutdown()


def test_a_negative_issue_ahead_is_refused_naming_it(store):
    with pytest.raises(ValueError, match="load_issue_ahead must be 0 or more, not -1"):
        engine(store, 2, load_issue_ahead=-1)


def test_a_job_nobody_waits_for_layer_by_layer_records_one_event(store):
    """An asynchronous load (or one a FULL CUDA graph waits for whole): no
    event per layer, one after the last."""
    src = stored(store, b"k" * 16, 3, 5)
    eng, dst = engine(store, 2)
    job = eng.submit_load([load_item("later", b"k" * 16, 8, 9)], layerwise=False)
    job.issue_all()
    assert len(job.events) == LAYERS and [ev is not None for ev in job.events] == [False] * (LAYERS - 1) + [True]
    job.wait_layer(NAMES[0])  # nothing to wait for per layer: the whole job is waited for
    assert [raw(d[[8, 9]]) for d in dst] == [raw(s[[3, 5]]) for s in src]
    assert [j for j, _ in eng.poll_loads()] == [job] and job.failed == set()
    eng.shutdown()


def test_a_copy_that_fails_fails_its_own_job_not_the_one_issued_beside_it(store):
    """Two jobs' layers interleave on the stream, the asynchronous one with no
    event per layer: its failed copy is its own (recomputed), never carried
    by the next event on the stream (the synchronous job's)."""
    stored(store, b"a" * 16, 1, 2)
    src_b = stored(store, b"b" * 16, 6, 7)
    eng, dst = engine(store, 2)
    later = eng.submit_load([load_item("later", b"a" * 16, 8, 9)], layerwise=False)
    now = eng.submit_load([load_item("now", b"b" * 16, 10, 11)])
    real = eng._load_layer

    def failing(job, group, layer, stream):
        if job is later and layer == LOAD_ISSUE_AHEAD + 1:
            raise RuntimeError("injected: a copy of the asynchronous load failed")
        real(job, group, layer, stream)

    eng._load_layer = failing
    for name in NAMES:
        now.wait_layer(name)
    eng.wait_loads()
    done = dict(eng.poll_loads())
    assert done[now] == set() and now.loaded == {"now": 2 * BS}
    assert [raw(d[[10, 11]]) for d in dst] == [raw(s[[6, 7]]) for s in src_b]
    assert done[later] == {8, 9} and later.loaded == {"later": 0}
    assert eng.counters["load_errors"] == 1 and store.stats()["leases_held"] == 0
    eng.shutdown()


def test_no_copy_is_issued_from_a_hook_while_a_cuda_graph_is_captured(store):
    """vLLM captures its CUDA graphs by running the forward, hooks included:
    an asynchronous load still in flight then is not advanced from there
    (its copies would land in no graph, or break the capture); polling
    issues them after."""
    stored(store, b"k" * 16, 3, 5)
    eng, _ = engine(store, 2)
    job = eng.submit_load([load_item("later", b"k" * 16, 8, 9)], layerwise=False)
    eng.backend.capturing = lambda: True
    eng.issue_loads_through(NAMES[-1])
    assert len(job.events) == LOAD_ISSUE_AHEAD
    eng.backend.capturing = lambda: False
    eng.issue_loads_through(NAMES[-1])
    assert len(job.events) == LAYERS
    eng.shutdown()
