"""The remote tier: chunks shared across hosts through Redis or Valkey.

    shmkv:v1:c:<namespace root hex>:<chunk key hex>   a chunk, in the disk tier's
                                                      checked, compressed format
    shmkv:v1:s:<key id hex>:<namespace root hex>:<chunk key hex>
                                                      the same with a shared secret
                                                      (its key id in the name): key id
                                                      (8 bytes), expiry (8), clear
                                                      generations (8 + 8), HMAC-SHA256
                                                      (secret, key name + the 32 bytes
                                                      before it + chunk) (32), the chunk
    shmkv:v1:m:key-id                                 the key id of the first host's
                                                      secret (the probe at start)
    shmkv:v1:m:gen:<key id hex>:<* | namespace hex>   a clear generation (of everything,
                                                      or of one namespace) and its MAC
    shmkv:v1:m:lru / :sizes / :bytes [:<key id hex>]  byte-budget bookkeeping (only with
                                                      a budget; one per key id)

Writes are asynchronous: `enqueue(key, ns)` is O(1) on the caller's thread; a
writer thread later asks the tier's `source` (set by the tier chain,
shmkv.tiers.chain: the disk file as it is, or the chunk encoded from the
shared tier) for the chunk's encoded bytes and SETs them (with the TTL, and
the budget applied atomically by a Lua script that drops the least recently
written chunks). A chunk the source no longer has is dropped with a counter;
so is one that finds the queue full.

Reads (`contains`, `fetch`) check the header, key, namespace
and payload checksum exactly like the disk tier: garbage is a miss, a counter
and an UNLINK.

Faults never reach the caller: every call is bounded by `timeout_s` (connect
and each socket read; redis-py's own retries are off), an error is a miss and
a counter, and the tier then stays "down" (calls return a miss at once) for a
backoff that doubles from 0.25 s to 30 s and resets on the first success.

Trust: see shmkv.tiers.remote.signing (a MAC of a shared secret, key ids in
the names, signed expiries and clear generations). Hosts with and without
the secret use separate key names, so neither ever reads (or removes) the
other's chunks. Needs a single Redis/Valkey (the
budget script touches several keys).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import redis

from shmkv.backoff import Backoff
from shmkv.config_values import redact_url
from shmkv.errors import ConfigError
from shmkv.names import AUTO, REMOTE
from shmkv.tiers import format as fmt
from shmkv.tiers.codec import CodecChoice
from shmkv.tiers.remote.client import make_client, set_deadline
from shmkv.tiers.remote.signing import (
    SignedValues,
    budget_keys,
    chunk_key,
    key_id,
    key_space,
)

log = logging.getLogger("shmkv.remote")

# (key, namespace, codec) -> (encoded bytes, (codec, raw bytes, encode seconds) | None) | None
Source = Callable[[bytes, bytes, str], "tuple[bytes, tuple[str, int, float] | None] | None"]

# KEYS: chunk, lru, sizes, bytes. ARGV: value, ttl seconds (0: none), budget, now.
_PUT_WITH_BUDGET = """
local old = tonumber(redis.call('HGET', KEYS[3], KEYS[1])) or 0
if ARGV[2] ~= '0' then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
else
  redis.call('SET', KEYS[1], ARGV[1])
end
local size = string.len(ARGV[1])
redis.call('HSET', KEYS[3], KEYS[1], size)
redis.call('ZADD', KEYS[2], ARGV[4], KEYS[1])
local total = redis.call('INCRBY', KEYS[4], size - old)
local dropped = 0
while total > tonumber(ARGV[3]) do
  local victim = redis.call('ZPOPMIN', KEYS[2])
  if #victim == 0 then break end
  local vsize = tonumber(redis.call('HGET', KEYS[3], victim[1])) or 0
  redis.call('HDEL', KEYS[3], victim[1])
  redis.call('UNLINK', victim[1])
  total = redis.call('DECRBY', KEYS[4], vsize)
  dropped = dropped + 1
end
return dropped
"""


class RemoteTier(SignedValues):
    """The remote tier (a shmkv.tiers.Tier) on Redis / Valkey."""

    name = REMOTE
    max_raw = fmt.MAX_RAW  # largest raw chunk a read accepts; a tier chain sets its segment's
    def __init__(self, url: str, *, timeout_s: float = 0.5, ttl_s: int = 0, capacity_bytes: int = 0,
                 counter: Callable[[str, int], None] | None = None, element_size: int = 2, level: int = 1,
                 max_queue: int = 1024, codec: str = AUTO, source: Source | None = None,
                 secret: bytes | None = None) -> None:
        """`source(key, namespace, codec)`: the chunk's encoded bytes and the
        figures of encoding them (None: reused as they were), or None when no
        tier has it any more; the tier chain sets it. `secret`: chunks carry
        a MAC of it (module doc)."""
        self.url = url
        self._secret = secret
        self.timeout_s = timeout_s
        self.ttl_s = ttl_s
        self.capacity = capacity_bytes
        self.source = source
        self.element_size = element_size
        self.level = level
        self.codec = CodecChoice(REMOTE, codec)
        self._count = counter or (lambda name, n: None)
        self.display_url = redact_url(url)
        self._client, self.cluster = make_client(url, timeout_s)
        if self.cluster and capacity_bytes:
            raise ConfigError("remote_capacity keeps one server's byte budget with a multi-key script, which a "
                              "cluster cannot run across slots: leave it 0 and give every shard `maxmemory` and "
                              "`maxmemory-policy allkeys-lru` (docs/design.md: the remote tier)")
        self._put_script = self._client.register_script(_PUT_WITH_BUDGET)
        self._backoff = Backoff()
        self._key_id = key_id(secret) if secret is not None else b""
        self._lru, self._sizes, self._bytes = budget_keys(self._key_id)
        self._skew: float | None = None  # the server's clock minus ours (None: not known)
        self._skew_at: float | None = None  # monotonic time of the last measurement
        self._foreign_logged = False
        self._gens: dict[bytes, tuple[int, float]] = {}  # generation record -> (generation, monotonic read time)
        self._gen_lock = threading.Lock()
        self._rollback_logged = False
        if secret is not None:
            self._probe_key_id()
        self._queue: collections.deque[tuple[bytes, bytes]] = collections.deque()
        self._max_queue = max_queue
        self._cv = threading.Condition()
        self._busy = 0  # items taken by the writer, not yet finished
        self._stopping = False
        self._writer: threading.Thread | None = None

    # ------------------------------------------------------- fault handling --
    @property
    def available(self) -> bool:
        return self._backoff.ready()

    def _call(self, what: str, fn: Callable[[], object]) -> tuple[bool, object]:
        """(ok, result) of one bounded call; a failure marks the tier down."""
        if not self.available:
            return False, None
        set_deadline(time.monotonic() + self.timeout_s)
        try:
            result = fn()
        except Exception as e:  # noqa: BLE001 - any fault of the server or the client library is a miss
            self._backoff.failed()
            self._count("remote_errors", 1)
            log.warning("shmkv: remote tier %s: %s failed (%s: %s); treated as a miss, next try in %.2f s",
                        self.display_url, what, type(e).__name__, e, self._backoff.delay_s)
            return False, None
        finally:
            set_deadline(None)
        if self._backoff.worked():
            log.info("shmkv: remote tier %s reachable again", self.display_url)
        return True, result

    # ---------------------------------------------------------------- reads --
    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes]) -> list[bool]:
        """For each (key, namespace), whether the remote holds it (one round trip)."""
        if not keys:
            return []

        def run():  # noqa: ANN202
            if self.cluster:
                return self._exists_per_shard([self._rkey(k, ns) for k, ns in zip(keys, namespaces)])
            pipe = self._client.pipeline(transaction=False)
            for k, ns in zip(keys, namespaces):
                pipe.exists(self._rkey(k, ns))
            res = pipe.execute()
            if len(res) != len(keys) or not all(type(x) is int for x in res):
                raise redis.ResponseError(f"EXISTS answered {str(res)[:60]}: not a Redis server's answer")
            return res

        ok, res = self._call("lookup", run)
        flags = [bool(x) for x in res] if ok else [False] * len(keys)
        if not all(flags):
            self._count("remote_misses", 1)  # one per lookup that did not find all it asked for
        return flags

    def fetch(self, key: bytes, namespace: bytes) -> tuple[bytearray, bytes] | None:
        """(raw payload, namespace) of a checked chunk, or None (missing, damaged, down)."""
        return self.fetch_into(key, namespace, lambda n, _ns: bytearray(n))

    def fetch_into(self, key: bytes, namespace: bytes, alloc: Callable[[int, bytes], Any], *,
                   max_raw: int | None = None) -> tuple[Any, bytes] | None:
        """Like fetch, decoded straight into alloc(raw_len, namespace)'s buffer;
        a value declaring more than `max_raw` bytes is damage (counted, unlinked)."""
        rkey = self._rkey(key, namespace)
        ok, data = self._call("get", lambda: self._client.get(rkey))
        if ok and data is not None and not isinstance(data, (bytes, bytearray)):  # large: bytearray (client.py)
            ok, data = False, None  # not a value a Redis server gives for GET
        if not ok or data is None:
            self._count("remote_misses", 1)
            return None
        self._count("remote_get_bytes", len(data))
        try:
            chunk = data if self._secret is None else self._authentic(rkey, data, namespace)
            if chunk is None:
                return None  # another secret's, past its expiry or before a clear: counted there
            got = fmt.decode_into(chunk, key, alloc, namespace=namespace, lossy_ok=True,  # see DiskTier.fetch_into
                                  max_raw=max_raw or self.max_raw)
        except fmt.DamagedChunk as e:
            log.warning("shmkv: remote chunk %s rejected (%s): removed", rkey.decode(), e.reason)
            self._count("remote_damaged", 1)
            self._call("unlink", lambda: self._drop([rkey]))
            return None
        if got is not None and self.capacity:
            self._call("touch", lambda: self._client.zadd(self._lru, {rkey: time.time()}, xx=True))
        return got

    # --------------------------------------------------------------- writes --
    def enqueue(self, key: bytes, namespace: bytes, tokens: int = 0) -> bool:
        """Queue one chunk (of `tokens` prompt tokens) for an asynchronous
        write; False (counted) if the queue is full."""
        with self._cv:
            if len(self._queue) >= self._max_queue:
                self._count("remote_dropped", 1)
                return False
            self._queue.append((key, namespace, tokens))
            if self._writer is None:
                self._writer = threading.Thread(target=self._write_loop, name="shmkv-remote-writer", daemon=True)
                self._writer.start()
            self._cv.notify()
        return True

    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        """Encode one chunk's payload and write it now (queued writes: enqueue)."""
        codec = self.codec.pick()
        t0 = time.perf_counter()
        data = fmt.encode(key, namespace, raw, element_size=self.element_size, level=self.level, codec=codec)
        return self.put_encoded(key, namespace, data, tokens,
                                measured=(codec, memoryview(raw).nbytes, time.perf_counter() - t0))

    def remove(self, key: bytes, namespace: bytes) -> bool:
        ok, n = self._call("remove", lambda: self._drop([self._rkey(key, namespace)]))
        return bool(ok and n)

    def put_encoded(self, key: bytes, namespace: bytes, data: bytes, tokens: int = 0,
                    measured: tuple[str, int, float] | None = None) -> bool:
        """Write one encoded chunk now (the writer thread's step; also for
        benchmarks). `measured`: (codec, raw bytes, encode seconds) of this
        chunk's encoding, for the codec choice."""
        rkey = self._rkey(key, namespace)
        if self._secret is not None:
            gens = self._generations(namespace)
            if gens is None:  # the remote did not answer: counted there
                self._count("remote_put_errors", 1)
                return False
            expires = int(self._server_now()[0]) + self.ttl_s if self.ttl_s else 0
            head = self._key_id + expires.to_bytes(8, "big") + gens
            data = head + self._mac(rkey, head, data) + bytes(data)
        t0 = time.perf_counter()
        if self.capacity:
            ok, _ = self._call("put", lambda: self._put_script(
                keys=[rkey, self._lru, self._sizes, self._bytes], args=[data, self.ttl_s, self.capacity, time.time()]))
        elif self.ttl_s:
            ok, _ = self._call("put", lambda: self._client.set(rkey, data, ex=self.ttl_s))
        else:
            ok, _ = self._call("put", lambda: self._client.set(rkey, data))
        if ok and measured is not None:
            self.codec.record(measured[0], measured[1], len(data), measured[2], time.perf_counter() - t0)
        if ok:
            self._count("remote_puts", 1)
            self._count("remote_put_bytes", len(data))
            if tokens:
                self._count("remote_put_tokens", tokens)
        else:
            self._count("remote_put_errors", 1)
        return ok

    def flush(self, timeout_s: float = 60.0) -> bool:
        """Wait until every queued write is done (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._queue or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def clear(self, namespace: bytes | None = None) -> int:
        """Remove every chunk of this tier's key space (or one namespace's)
        from the remote; how many. A host with a secret clears the names of
        its key id and the unauthenticated names (anyone may write those); a
        host without one only the unauthenticated names: no host removes
        what another secret signed."""
        tail = namespace.hex().encode() + b":*" if namespace else b"*"
        spaces = [self._key_id, b""] if self._key_id else [b""]
        if self._secret is not None and not self._raise_generation(namespace):
            return 0  # the remote did not answer: counted and logged there

        def run_space(signer: bytes) -> int:
            pattern, budget = key_space(signer) + tail, budget_keys(signer)
            n, cursor = 0, 0
            if self.cluster:  # every primary's keys, a bounded call's worth at a time
                batch: list[bytes] = []
                for k in self._client.scan_iter(match=pattern, count=1000):
                    batch.append(k)
                    if len(batch) == 1000:
                        n += self._drop(batch, budget)
                        batch = []
                        set_deadline(time.monotonic() + self.timeout_s)
                return n + (self._drop(batch, budget) if batch else 0)
            while True:  # each batch is one bounded call's worth (a fresh deadline)
                set_deadline(time.monotonic() + self.timeout_s)
                cursor, batch = self._client.scan(cursor, match=pattern, count=1000)
                if batch:
                    n += self._drop(batch, budget)
                if not cursor:
                    return n

        ok, n = self._call("clear", lambda: sum(run_space(signer) for signer in spaces))
        return int(n) if ok else 0

    def close(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify_all()
        if self._writer is not None:
            self._writer.join(timeout=self.timeout_s * 4 + 1)
        self._client.close()

    # ------------------------------------------------------------ internals --
    def _drop(self, rkeys: list[bytes], budget: tuple[bytes, bytes, bytes] | None = None) -> int:
        """UNLINK `rkeys` and take them out of a budget's bookkeeping (default: ours)."""
        lru, sizes_key, total = budget or (self._lru, self._sizes, self._bytes)
        if self.cluster:  # no budget bookkeeping on a cluster; keys of many slots: one UNLINK each
            pipe = self._client.pipeline(transaction=False)
            for k in rkeys:
                pipe.unlink(k)
            return sum(int(n) for n in pipe.execute())
        sizes = self._client.hmget(sizes_key, rkeys)
        pipe = self._client.pipeline(transaction=False)
        pipe.unlink(*rkeys)
        pipe.zrem(lru, *rkeys)
        pipe.hdel(sizes_key, *rkeys)
        freed = sum(int(s) for s in sizes if s is not None)
        if freed:
            pipe.decrby(total, freed)
        return int(pipe.execute()[0])

    def _write_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    self._cv.notify_all()
                    return
                key, ns, tokens = self._queue.popleft()
                self._busy += 1
            try:
                got = self._encoded(key, ns)
                if got is None:
                    self._count("remote_dropped", 1)
                else:
                    self.put_encoded(key, ns, got[0], tokens, measured=got[1])
            except Exception:
                log.exception("shmkv: remote write of %s failed", key.hex())
                self._count("remote_put_errors", 1)
            finally:
                with self._cv:
                    self._busy -= 1
                    self._cv.notify_all()

    def _exists_per_shard(self, rkeys: list[bytes]) -> list[int]:
        """EXISTS of each key, one pipeline per shard: a shard that cannot be
        reached (its primary down, before or during a failover) answers 0 for
        its keys, counted in remote_errors, and the others answer as usual.
        Raises (the whole tier backs off) only when every shard of the
        cluster failed: a lookup whose keys all lie on the one dead shard must
        not turn the live shards' chunks into misses for the backoff's time."""
        by_node: dict[str, list[int]] = {}
        for i, rk in enumerate(rkeys):
            by_node.setdefault(self._client.get_node_from_key(rk).name, []).append(i)
        out, failed, last = [0] * len(rkeys), 0, None
        for idx in by_node.values():
            pipe = self._client.pipeline(transaction=False)
            for i in idx:
                pipe.exists(rkeys[i])
            try:
                res = pipe.execute()
            except (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
                    redis.exceptions.RedisClusterException, TimeoutError) as e:
                failed, last = failed + 1, e
                continue
            for i, x in zip(idx, res):
                out[i] = int(x) if type(x) is int else 0
        if failed:
            if failed == len(by_node) and failed >= self._primaries():
                raise last  # type: ignore[misc]
            self._count("remote_errors", failed)
            log.warning("shmkv: remote tier %s: %d of %d shards did not answer (%s); their chunks are misses",
                        self.display_url, failed, len(by_node), last)
        return out

    def _primaries(self) -> int:
        """How many primaries the cluster client knows (1 when it cannot say)."""
        try:
            return max(1, len(self._client.get_primaries()))
        except Exception:  # a client without a slot map yet
            return 1

    def _rkey(self, key: bytes, namespace: bytes) -> bytes:
        return chunk_key(key, namespace, self._key_id)

    def _encoded(self, key: bytes, ns: bytes) -> tuple[bytes, tuple[str, int, float] | None] | None:
        """The chunk's encoded bytes from the source, in the codec this tier picks now."""
        return None if self.source is None else self.source(key, ns, self.codec.pick())
