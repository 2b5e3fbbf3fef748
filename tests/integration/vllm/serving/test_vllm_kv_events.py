"""A KV-cache-aware router sees the shared tier: subscribed to vLLM's KV events
(ZMQ, vLLM's own schema), it gets a BlockStored for every chunk the engine
stored into the segment (medium CPU, ownership "shmkv"), naming the same
block hashes vLLM announces for those tokens in its GPU cache, and a
BlockRemoved for each once the chunks leave the segment."""

from __future__ import annotations

import time

import pytest
from helpers import random_prompt

from shmkv import Store

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=21)
OTHER = random_prompt(300, seed=22)


class Router:
    """A ZMQ subscriber as a router runs it, on the endpoint vLLM's publisher
    binds (an ipc socket: nothing leaves the host)."""

    def __init__(self, directory: str) -> None:
        import zmq

        self.endpoint = f"ipc://{directory}/kv-events.sock"
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.events: list = []

    def connect(self, timeout_s: float = 30.0) -> None:
        """Connect, and wait (bounded) until ZMQ reports the connection:
        a PUB drops what it sends before its subscriber has joined."""
        import zmq
        from zmq.utils.monitor import recv_monitor_message

        monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED)
        try:
            self.sub.connect(self.endpoint)
            assert monitor.poll(int(timeout_s * 1000)), "the engine's KV-event publisher never accepted us"
            assert recv_monitor_message(monitor)["event"] == zmq.EVENT_CONNECTED
        finally:
            self.sub.disable_monitor()
            monitor.close(0)

    def receive(self, until, timeout_s: float = 60.0) -> None:
        """Take events until until(self.events) holds (or the timeout)."""
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        deadline = time.monotonic() + timeout_s
        while not until(self.events) and time.monotonic() < deadline:
            if self.sub.poll(200, zmq.POLLIN):
                _topic, _seq, payload = self.sub.recv_multipart()
                self.events.extend(decoder.decode(payload).events)

    def close(self) -> None:
        self.sub.close(0)
        self.ctx.term()


def shmkv_events(events, kind):
    return [e for e in events if type(e).__name__ == kind and e.ownership == "shmkv"]


def test_a_router_sees_the_shared_tier(cache_name, start_engine, tmp_path):
    router = Router(str(tmp_path))
    try:
        e = start_engine("events", shmkv={}, prefix_caching=True, env={"SHMKV_CACHE_NAME": cache_name},
                         llm_kwargs={"kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq",
                                                          "endpoint": router.endpoint}})
        router.connect()
        assert e.generate([P])["num_cached_tokens"] == [0]
        n_units = 3000 // 256 + 1  # 11 chunks and the 128-token tail piece
        router.receive(lambda ev: len(shmkv_events(ev, "BlockStored")) >= n_units)
        stored = shmkv_events(router.events, "BlockStored")
        assert len(stored) == n_units, [(type(x).__name__, x.medium) for x in router.events][:8]
        assert all(s.medium == "CPU" and s.locality == "LOCAL" and s.block_size == 128 for s in stored)
        ours = [h for s in stored for h in s.block_hashes]  # announced in prefix order
        gpu = [h for ev in router.events if type(ev).__name__ == "BlockStored" and ev.medium == "GPU"
               for h in ev.block_hashes]
        assert len(ours) == 3000 // 128 and ours == gpu[:len(ours)], "the same hashes vLLM gives those blocks"
        assert [t for s in stored if s.parent_block_hash is None for t in s.token_ids] == P[:256]
        gpu_events = [ev for ev in router.events if type(ev).__name__ == "BlockStored" and ev.medium == "GPU"]
        assert {(s.group_idx, s.kv_cache_spec_kind) for s in stored} == {(0, "full_attention")}
        assert {s.group_idx for s in gpu_events} == {0}, "vLLM's own events name the same group"
        by_hash = {h: (ev.extra_keys[i] if ev.extra_keys else None, ev.session_id)
                   for ev in gpu_events for i, h in enumerate(ev.block_hashes)}
        ours_extra = {h: (s.extra_keys[i] if s.extra_keys else None, s.session_id)
                      for s in stored for i, h in enumerate(s.block_hashes)}
        assert ours_extra == {h: by_hash[h] for h in ours_extra}, "extra keys and session as vLLM fills them"
        assert all(s.extra_keys is not None and len(s.extra_keys) == len(s.block_hashes) for s in stored)

        removed = Store.attach(cache_name, populate=False).clear()
        assert removed == n_units
        e.generate([OTHER])  # steps of the engine: its scheduler looks at the segment again
        router.receive(lambda ev: len(shmkv_events(ev, "BlockRemoved")) >= n_units)
        gone = shmkv_events(router.events, "BlockRemoved")
        assert sorted(h for g in gone for h in g.block_hashes) == sorted(ours)
        assert {g.group_idx for g in gone} == {0}
    finally:
        router.close()
