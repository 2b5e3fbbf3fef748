"""vLLM's GPU call orders, proven on the CPU: vLLM's real Scheduler, the real
connector (both roles) and a real segment, driven by a runner that follows
Model Runner V2's execute_model (through vLLM's own ActiveKVConnector) or
V1's, over the device-like stream model (tests/support/vllm_call_order.py). Every
case checks two things: every sampled token is the one a right KV cache
gives (the toy model knows it), and the device model found no access to a
KV block that is not ordered after the copies touching it.

Cases: a hit served on both runners; a fully hit prompt batched with
decodes (V2 and V1 replay a FULL CUDA graph: no per-layer hook); a chunk
evicted between the lookup and the load; preemption while stores are in
flight, with vLLM zeroing new blocks; an EAGLE-style drafter whose layer is
loaded with the target's and read by a FULL graph after the target's forward;
a sliding-window hybrid (groups overlaid on one block pool, asynchronous
loads); a request aborted while its asynchronous load still copies; a
Mamba/GDN hybrid in vLLM's align mode (boundary states stored from the
blocks vLLM hands over, loaded with the attention KV, the state pre-copy
before the forward), with preemption while its stores are in flight; an
engine of linear-attention state alone, refused; MLA at TP=2 (rank 0 stores
once for the host, both ranks load, their outputs combined as vLLM does); a
load copy that fails on the device, found only once the copies ran, is
recomputed in the step that read it. The cases whose loads succeed run with
vLLM's asynchronous scheduling too. Every case runs twice: with the load
copies issued LOAD_ISSUE_AHEAD layers ahead of the forward (the default; the
toy models' two layers are all issued by start_load_kv) and one layer at a
time, each as the forward's hook for it runs or when the job is polled (what
a deep model's later layers see).
"""

from __future__ import annotations

import pytest
from helpers import segment_stat
from vllm_call_order import Harness, continuation_ok

from shmkv.testing import SKIP_LOAD_LAYERS

RUNNERS = ["v2", "v1"]
# vLLM 0.32's default with a connector is asynchronous scheduling (step N+1 scheduled and run before
# step N's output is processed): the cases whose loads all succeed run both ways. A failed load's
# take-back under asynchronous scheduling is vLLM's own bookkeeping, which the harness does not mirror
SCHEDULED = ["v2", "v1", "v2+async", "v1+async"]
SEEDS = [0, 1, 2]


@pytest.fixture(autouse=True, params=["ahead", "layer_by_layer"])
def load_issue(request, monkeypatch):
    """How far ahead of the forward the load copies are issued."""
    if request.param == "layer_by_layer":
        monkeypatch.setattr("shmkv.transfer.engine.LOAD_ISSUE_AHEAD", 0)
    return request.param


def prompt(n: int, seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(1, 900) for _ in range(n)]


def harness(cache_name, model_dir, runner, seed, **kw) -> Harness:
    """`runner`: "v2" or "v1", "+async" for asynchronous scheduling."""
    name, _, mode = runner.partition("+")
    return Harness(cache_name, model_dir, name, seed=seed, async_scheduling=mode == "async", **kw)


def serve(cache_name, model_dir, runner, seed, prompts, max_tokens, after_step=None, **kw) -> Harness:
    h = harness(cache_name, model_dir, runner, seed, **kw)
    try:
        for req_id, p in prompts.items():
            h.add(req_id, p, max_tokens)
        h.run(after_step=after_step)
    finally:
        h.close()
    return h


def stored_tokens(cache_name: str) -> int:
    return segment_stat(cache_name, "put_tokens")


def preemption_watch():
    """(seen, after_step): seen["preempted_in_flight"] collects the requests
    vLLM preempted while their stores were still copying."""
    seen: dict[str, set] = {"preempted_in_flight": set(), "pending": set()}

    def watch(h, so):
        if so.preempted_req_ids:
            seen["preempted_in_flight"] |= set(so.preempted_req_ids) & seen["pending"]
        seen["pending"] = h.worker._work.worker.pending_requests()

    return seen, watch


def loaded(h: Harness) -> int:
    return h.worker._work.worker.counters["loaded_tokens"]


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_hit_is_served_right_on_both_runners(cache_name, model_dir, runner, seed):
    p = prompt(600, seed)
    a = serve(cache_name, model_dir, runner, seed, {"a": p}, 4)
    assert not continuation_ok(a, {"a": p}) and not a.device.violations
    assert stored_tokens(cache_name) >= 512
    b = serve(cache_name, model_dir, runner, seed + 10, {"b": p[:550] + prompt(20, 99)}, 4)
    assert loaded(b) >= 512, "engine B loaded both whole chunks"
    assert not continuation_ok(b, {"b": p[:550] + prompt(20, 99)})
    assert b.device.violations == []


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_full_hit_batched_with_decodes_replays_a_full_graph_right(cache_name, model_dir, runner, seed):
    """A prompt whose every chunk is cached leaves one token: batched with
    decodes it is a uniform-decode batch, which vLLM runs as a FULL CUDA
    graph (no wait_for_layer_load): the loads must be waited for before it."""
    p = prompt(512, seed)
    serve(cache_name, model_dir, runner, seed, {"a": p + [5]}, 2)
    h = harness(cache_name, model_dir, runner, seed)
    try:
        h.add("d", prompt(40, seed + 1), 30)  # decoding when the hit arrives
        full_steps = []

        def add_hit(h, so):
            if h.step == 3:
                h.add("hit", p + [7], 4)
            if so.scheduled_new_reqs and any(r.req_id == "hit" for r in so.scheduled_new_reqs):
                full_steps.append(h._uniform_decode(so))

        h.run(after_step=add_hit)
    finally:
        h.close()
    assert full_steps == [True], "the hit's first step was a uniform-decode (FULL graph) batch"
    assert loaded(h) == 512
    assert h.device.violations == [], h.device.violations[:3]
    assert not continuation_ok(h, {"hit": p + [7], "d": prompt(40, seed + 1)})


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_chunk_evicted_between_lookup_and_load_is_recomputed_in_that_step(cache_name, model_dir, runner, seed):
    """The second chunk goes between the scheduler's lookup and the worker's
    load (another engine evicted it): vLLM must learn it in the same step's
    output, before it samples from blocks nobody filled."""
    p = prompt(600, seed)
    serve(cache_name, model_dir, runner, seed, {"a": p}, 2)
    h = Harness(cache_name, model_dir, runner, seed=seed)
    evicted = []
    orig = h.worker.start_load_kv

    def start_load_kv(ctx, **kw):
        meta = h.worker._connector_metadata
        if meta is not None and meta.loads and not evicted:
            key = meta.loads[-1].keys[0]
            assert h.worker.store.delete(key)
            evicted.append(key)
        return orig(ctx, **kw)

    h.worker.start_load_kv = start_load_kv
    try:
        h.add("b", p[:560], 6)
        h.run()
    finally:
        h.close()
    assert evicted, "a load was planned and its last chunk evicted"
    assert not continuation_ok(h, {"b": p[:560]})
    assert h.device.violations == []


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_preemption_with_stores_in_flight_and_zeroing_keeps_every_chunk_right(cache_name, model_dir, runner,
                                                                             seed):
    """A KV cache too small for two requests: r1's prompt ends on a chunk
    boundary, its last chunk's store is issued, and at the next step r0
    needs a block: vLLM preempts r1 and gives r0 a block of that chunk,
    zeroing it first (as for Mamba or mixed-precision engines) - in V2
    before the connector's first call of the step. Whatever a store commits
    must be the KV it was asked for: a second engine loads every chunk of
    r1's prompt and samples right."""
    r0, r1 = prompt(60, seed + 1), prompt(512, seed + 2)
    seen, watch = preemption_watch()

    a = serve(cache_name, model_dir, runner, seed, {"r0": r0, "r1": r1}, 60, after_step=watch, num_blocks=37,
              max_num_batched_tokens=128, zeroing=True, query_progress=0.05)
    assert seen["preempted_in_flight"] == {"r1"}, "r1 was preempted while its store was in flight"
    assert not continuation_ok(a, {"r0": r0, "r1": r1})
    assert a.device.violations == [], a.device.violations[:3]
    b = serve(cache_name, model_dir, runner, seed + 100, {"b": r1 + [3]}, 3)
    assert not continuation_ok(b, {"b": r1 + [3]})
    assert b.device.violations == []
    assert loaded(b) in (256, 512), "what engine B found of r1's prompt it loaded"


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_an_eagle_drafters_layers_are_loaded_before_its_full_graph_reads_them(cache_name, model_dir, runner, seed):
    """An EAGLE-style drafter keeps its layer in the target's KV-cache group;
    its forward comes after the target's (V2: after finish_forward; V1: after
    the step's transfer results, before wait_for_save) and replays a FULL
    CUDA graph: no per-layer hook waits for its loaded layer."""
    p = prompt(600, seed)
    serve(cache_name, model_dir, runner, seed, {"a": p}, 2, drafter_layers=1)
    b = serve(cache_name, model_dir, runner, seed + 10, {"b": p[:560]}, 4, drafter_layers=1)
    assert loaded(b) >= 512
    assert b.device.violations == [], b.device.violations[:3]
    assert b.proposals and b.wrong_proposals() == []
    assert not continuation_ok(b, {"b": p[:560]})


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_sliding_window_group_is_loaded_and_read_right(cache_name, model_dir, runner, seed):
    """A hybrid of full and sliding-window (64 tokens) layers, their groups
    overlaid on one block pool as vLLM lays them out: the hit loads the full
    group's blocks and the window's of the sliding group (asynchronously:
    two groups), and nothing reads a block before its load lands."""
    p = prompt(600, seed)
    a = serve(cache_name, model_dir, runner, seed, {"a": p}, 3, sliding_window=64, num_blocks=128)
    assert not continuation_ok(a, {"a": p}) and a.device.violations == []
    tail = prompt(20, 99)
    b = serve(cache_name, model_dir, runner, seed + 10, {"b": p[:550] + tail, "c": prompt(70, seed + 3)}, 4,
              sliding_window=64, num_blocks=128)
    assert loaded(b) == 512, "engine B loaded both whole chunks"
    assert b.device.violations == [], b.device.violations[:3]
    assert not continuation_ok(b, {"b": p[:550] + tail, "c": prompt(70, seed + 3)})


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_request_aborted_mid_load_keeps_its_blocks_until_the_load_lands(cache_name, model_dir, runner, seed):
    """An asynchronous load (a hybrid engine's) still copying when its request
    is aborted: vLLM keeps the blocks until the worker reports the load in
    finished_recving, then frees them; a request given those blocks next
    writes them only after the copies into them ran (device model), and the
    engine ends with every block free and nothing held."""
    from vllm.v1.request import RequestStatus

    BLOCKS = 96  # tight: the later request needs blocks b held
    p = prompt(600, seed)
    serve(cache_name, model_dir, runner, seed, {"a": p}, 2, sliding_window=64, num_blocks=128)
    h = Harness(cache_name, model_dir, runner, seed=seed + 10, sliding_window=64, num_blocks=BLOCKS,
                query_progress=0.02)
    seen = {"aborted_in_flight": False}
    later = prompt(900, seed + 5)

    def abort_mid_load(h, so):
        req = h.scheduler.requests.get("b")
        if req is None or req.status != RequestStatus.WAITING_FOR_REMOTE_KVS or seen["aborted_in_flight"]:
            return
        if any("b" in reqs for reqs in h.worker._work._async_jobs.values()):  # its copies still run
            seen["aborted_in_flight"] = True
            seen["b_blocks"] = {b for table in h.reqs["b"].blocks for b in table} if "b" in h.reqs else \
                set(h.scheduler.kv_cache_manager.get_block_ids("b")[0])
            h.abort(["b"])
            h.add("later", later, 3)  # needs most of the pool: b's blocks among them

    def watch(h, so):
        abort_mid_load(h, so)
        if "later" in h.reqs:
            seen.setdefault("later_blocks", set()).update(b for table in h.reqs["later"].blocks for b in table)

    try:
        h.add("b", p[:560], 4)
        h.run(after_step=watch)
        assert seen["aborted_in_flight"], "b was aborted while its load's copies were in flight"
        assert not h.scheduler.requests, "vLLM holds no request (b's delayed free came back)"
        pool = h.scheduler.kv_cache_manager.block_pool
        assert pool.get_num_free_blocks() == BLOCKS - 1, "every block is free again (the null block aside)"
    finally:
        h.close()
    assert h.device.violations == [], h.device.violations[:3]
    assert seen["b_blocks"] & seen["later_blocks"], "the later request was given blocks b's load wrote"
    assert h.outputs["b"] == []
    assert not continuation_ok(h, {"later": later})


@pytest.mark.parametrize("runner", SCHEDULED)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_linear_attention_state_is_stored_at_its_boundary_and_loaded_with_the_kv(cache_name, model_dir, runner,
                                                                                  seed, monkeypatch):
    """A Mamba/GDN hybrid (an attention layer and a linear-attention layer,
    vLLM's align mode): engine A's stores take each boundary state from the
    block vLLM hands over, after the forward wrote it; engine B's hit loads
    the attention KV and the state (asynchronously: two groups), vLLM's
    pre-copy moves the state into the block the forward reads, and every
    token is right. With the state's load skipped, B's tokens are wrong:
    the toy model reads the state it loaded."""
    p, tail = prompt(600, seed), prompt(20, 99)
    kw = {"linear_layers": (1,), "num_blocks": 96}
    a = serve(cache_name, model_dir, runner, seed, {"a": p}, 3, **kw)
    assert a.worker._work.off_reason is None
    assert not continuation_ok(a, {"a": p}) and a.device.violations == [], a.device.violations[:3]
    b = serve(cache_name, model_dir, runner, seed + 10, {"b": p[:550] + tail}, 4, **kw)
    assert loaded(b) == 512, "engine B loaded both whole chunks and their state"
    assert b.device.violations == [], b.device.violations[:3]
    assert not continuation_ok(b, {"b": p[:550] + tail})
    monkeypatch.setenv(SKIP_LOAD_LAYERS, "linear_attn")
    c = serve(cache_name, model_dir, runner, seed + 20, {"c": p[:550] + tail}, 4, **kw)
    assert loaded(c) >= 512 and continuation_ok(c, {"c": p[:550] + tail}), "without its state the hit goes wrong"


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_preemption_with_a_state_store_in_flight_keeps_every_state_right(cache_name, model_dir, runner, seed):
    """The preemption case on a Mamba/GDN hybrid: r1's prompt ends on a chunk
    boundary and its chunk and boundary state are being stored when vLLM
    preempts it and gives its blocks to r0, which vLLM zeroes and whose state
    pre-copy and forward write them (V2: all before the connector's first
    call of the step). Every chunk and state committed is what was asked
    for: a second engine loads r1's prompt and samples right."""
    r0, r1 = prompt(60, seed + 1), prompt(512, seed + 2)
    seen, watch = preemption_watch()

    a = serve(cache_name, model_dir, runner, seed, {"r0": r0, "r1": r1}, 60, after_step=watch, num_blocks=40,
              max_num_batched_tokens=128, query_progress=0.05, linear_layers=(1,))
    assert seen["preempted_in_flight"] == {"r1"}, "r1 was preempted while its stores were in flight"
    assert not continuation_ok(a, {"r0": r0, "r1": r1})
    assert a.device.violations == [], a.device.violations[:3]
    b = serve(cache_name, model_dir, runner, seed + 100, {"b": r1 + [3]}, 3, linear_layers=(1,), num_blocks=96)
    assert not continuation_ok(b, {"b": r1 + [3]})
    assert b.device.violations == []
    assert loaded(b) in (256, 512), "what engine B found of r1's prompt it loaded"


@pytest.mark.parametrize("runner", RUNNERS)
def test_an_engine_of_linear_attention_state_alone_is_refused(cache_name, model_dir, runner):
    """N6: an engine whose only group holds linear-attention state would load
    synchronously, with nothing ordering the Mamba ops after the copies
    (vLLM's per-layer wait is in attention ops): it is refused for the whole
    engine with one reason, stores and loads nothing, and serves right."""
    p = prompt(600, 3)
    for label in ("a", "b"):
        h = serve(cache_name, model_dir, runner, 3, {label: p}, 3, linear_layers=(0, 1), num_blocks=96)
        assert "only KV-cache groups hold linear-attention state" in (h.worker._work.off_reason or "")
        assert not continuation_ok(h, {label: p}) and h.device.violations == []
    from shmkv.errors import SegmentNotFoundError

    try:
        touched = segment_stat(cache_name, "puts") + segment_stat(cache_name, "lookups")
    except SegmentNotFoundError:
        touched = 0  # not even created: the engine never used the cache
    assert touched == 0


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_mla_at_tp2_rank_0_stores_once_and_every_rank_loads(cache_name, mla_dir, runner, seed):
    """MLA at TP=2, two ranks on devices of their own: every rank holds the
    same latent KV, rank 0 alone stores it (once per host) while rank 1
    still reports the delayed frees vLLM waits for from every rank (vLLM's
    KVOutputAggregator); engine B's ranks both load every chunk, each into
    its own cache, and sample right (a rank that read other KV than rank 0
    would corrupt the combined output)."""
    p, tail = prompt(600, seed), prompt(20, 99)
    a = serve(cache_name, mla_dir, runner, seed, {"a": p}, 3, tp=2)
    assert [rk.worker._work.stores for rk in a.ranks] == [True, False]
    assert not continuation_ok(a, {"a": p}) and a.violations == [], a.violations[:3]
    assert not a.scheduler.requests, "both ranks reported the delayed frees"
    assert stored_tokens(cache_name) == 592, "2 chunks and the piece, once for the host"
    b = serve(cache_name, mla_dir, runner, seed + 10, {"b": p[:550] + tail}, 4, tp=2)
    assert [rk.worker._work.worker.counters["loaded_tokens"] for rk in b.ranks] == [512, 512]
    assert b.violations == [], b.violations[:3]
    assert not continuation_ok(b, {"b": p[:550] + tail})
    assert not b.scheduler.requests


@pytest.mark.parametrize("runner", RUNNERS)
@pytest.mark.parametrize("seed", SEEDS)
def test_a_load_copy_that_fails_on_the_device_is_recomputed_in_the_step_that_read_it(cache_name, model_dir,
                                                                                     runner, seed):
    """A load's copy of one layer fails on the device: like a lease
    reclaimed meanwhile, it shows only once the copies ran, and the host
    reaches the connector's answer (V2 post_forward, V1
    get_block_ids_with_load_errors) with no sync before it. vLLM must find
    the blocks in that step's invalid blocks (a step later it has emitted
    the token sampled from them), and the chunk that step completed over
    them must not be stored: engine C loads what B stored and samples right."""
    p, tail = prompt(600, seed), prompt(300, seed + 7)
    serve(cache_name, model_dir, runner, seed, {"a": p}, 2)
    # NOTE: a polled copy progressed one time in fifty: the host runs far ahead of the device.
    # 128 blocks: after a failed asynchronous load (every load on V2) vLLM 0.32 keeps the request in
    # its in-flight prefills and reserves its blocks twice when it is admitted again
    h = Harness(cache_name, model_dir, runner, seed=seed + 10, query_progress=0.02, num_blocks=128)
    engine = h.worker._work.worker
    load_layer, failed_jobs = engine._load_layer, []

    def failing_load_layer(job, group, layer, stream):
        if layer == 1 and (not failed_jobs or failed_jobs[0] is job):
            failed_jobs[:] = [job]
            raise RuntimeError("injected: the copy of layer 1 failed on the device")
        load_layer(job, group, layer, stream)

    engine._load_layer = failing_load_layer
    try:
        h.add("b", p[:512] + tail, 4)
        h.run()
    finally:
        h.close()
    assert failed_jobs and engine.counters["load_errors"] >= 1, "the hit's load failed on the device"
    assert h.violations == [], h.violations[:3]
    assert not continuation_ok(h, {"b": p[:512] + tail})
    c = serve(cache_name, model_dir, runner, seed + 20, {"c": p[:512] + tail + [5]}, 3)
    assert loaded(c) >= 512
    assert not continuation_ok(c, {"c": p[:512] + tail + [5]})


@pytest.mark.parametrize("runner", RUNNERS)
# seeds whose device order leaves r1's store in flight when h's load is issued (the test asserts it)
@pytest.mark.parametrize("seed", [0, 2, 3])
def test_a_hit_admitted_into_blocks_a_pending_store_reads_loads_after_the_gather(cache_name, model_dir, runner,
                                                                                 seed):
    """Finding A: a sliding-window hybrid of one KV dtype (no zeroing), a
    tight KV cache. r1's long prefill stores its chunks while its window
    moves on: vLLM frees the sliding group's blocks behind the window while
    the store of the chunk they hold is still copying, and admits the hit h
    into them, parked for its asynchronous load (two KV-cache groups), so
    those blocks are in none of the scheduler's lists of the step. The load
    must run after the gather read them: the device model sees every copy's
    blocks (without the transfer engine's wait it reports the race), h and a
    later engine loading r1's prompt sample right."""
    kw = {"sliding_window": 64}
    hit = prompt(600, seed + 3)
    serve(cache_name, model_dir, runner, seed, {"x": hit}, 2, num_blocks=128, **kw)
    r1 = prompt(640, seed + 2)
    seen = {"raced": set()}

    def watch(h, so):
        if h.step == 3 and "h" not in h.outputs:
            h.add("h", hit[:300], 3)

    a = harness(cache_name, model_dir, runner, seed + 10, num_blocks=72, max_num_batched_tokens=128,
                query_progress=0.02, **kw)
    engine = a.worker._work.worker
    submit_load = engine.submit_load

    def watched_submit_load(items, **kw):  # the blocks of h's load a store of r1 still reads, when it is issued
        mine = {b for it in items if it.req_id == "h" for b in it.block_ids}
        seen["raced"] |= {b for j in engine.pending_stores() if not j.event.op.done for b in j.blocks & mine}
        return submit_load(items, **kw)

    engine.submit_load = watched_submit_load
    try:
        a.add("r1", r1, 3)
        a.run(after_step=watch)
    finally:
        a.close()
    assert seen["raced"], "h was parked in blocks a pending store of r1 still read"
    assert a.violations == [], a.violations[:3]
    assert engine.counters["loads_after_stores"] >= 1
    assert not continuation_ok(a, {"r1": r1, "h": hit[:300]})
    b = serve(cache_name, model_dir, runner, seed + 100, {"b": r1[:600]}, 3, num_blocks=128, **kw)
    assert not continuation_ok(b, {"b": r1[:600]}) and b.violations == []
    assert loaded(b) == 512, "engine B loaded both whole chunks r1 stored"
