"""An engine ended in a process that goes on (an in-process LLM, a notebook,
a test suite) detaches the segment at vLLM's connector shutdown: both halves
close their store once every copy has finished, and what they stored stays
in the segment for the next engine. Driven by the call-order harness
(vLLM's real Scheduler and both connector roles in this process)."""

from __future__ import annotations

from helpers import segment_stat
from vllm_call_order import Harness


def test_both_connector_halves_detach_the_segment_at_shutdown(cache_name, model_dir):
    h = Harness(cache_name, model_dir, "v1", seed=0)
    stores = [h.worker.store, h.scheduler.connector.store]
    assert not any(s.closed for s in stores)
    try:
        h.add("a", list(range(1, 300)), 2)
        h.run()
    finally:
        h.close()
    assert all(s.closed for s in stores), "the worker's and the scheduler's store are closed"
    assert h.worker.store is None and h.scheduler.connector.store is None
    assert segment_stat(cache_name, "ready_entries") >= 1, "the chunk stored before shutdown stays"
