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

Trust: without a secret, anyone who can write to the Redis can plant chunks
(the checksum is not a MAC): give shmkv a private instance or ACL user, and
rediss:// across hosts. With `remote_secret_file` every chunk carries a MAC
of the secret and the id of the key that signed it (a digest of the secret),
and the key id is part of the chunk's name: hosts with different secrets (a
rotation under way, a typo) write, budget, clear and remove only their own
names, so a misconfigured host never overwrites or evicts the fleet's values
(it misses them). Under our names, a value whose MAC of our secret fails, or
that carries another key id, was planted or damaged: a miss, counted
(`remote_damaged`, `remote_foreign`), removed. At start the tier compares its
key id with the one the first host recorded (shmkv:v1:m:key-id) and logs one
WARNING when they differ (anyone who can write the Redis can plant that
record too: the warning says so).
With `remote_ttl` the writer signs the value's expiry in the Redis server's
clock (each host measures its offset from Redis `TIME`, at start and every
CLOCK_REFRESH_S): written back after it, a value is a miss (`remote_expired`)
and removed only once it is EXPIRY_SKEW_S past it in that clock; a host that
cannot read the server's clock judges by its own and removes nothing. A host
whose clock runs ahead therefore judges no live value expired.
A clear (`/clear`, vLLM's reset_prefix_cache) first raises a signed generation
(of everything, or of the namespace it clears), then removes the keys; every
value signs the two generations it was written under, so a value captured
before the clear and written back later is a miss (`remote_stale`) and is
removed. Each host reads the generations again at most GEN_REFRESH_S after it
last did and never goes back to a lower one: a record deleted or rolled back
by someone who can write to the Redis reads as what the host saw, and is
written back; a signed value of a newer generation than a host knows is
proof of that generation (only a holder of the secret could sign it): the host
adopts it, writes the records back and serves the value. What remains: a
host that starts while the records are erased and every host that saw them is
gone learns the generations only from the values it reads.
Hosts with and without the secret use separate key names, so neither ever
reads (or removes) the other's chunks. Needs a single Redis/Valkey (the
budget script touches several keys).
"""

from __future__ import annotations

import collections
import hashlib
import hmac
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

log = logging.getLogger("shmkv.remote")

# (key, namespace, codec) -> (encoded bytes, (codec, raw bytes, encode seconds) | None) | None
Source = Callable[[bytes, bytes, str], "tuple[bytes, tuple[str, int, float] | None] | None"]

PREFIX = b"shmkv:v1:"

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


MAC_BYTES = 32
KEY_ID_BYTES = 8
GEN_BYTES = 16  # the clear generations a value was written under: of everything, of its namespace
SIGNED_HEAD = KEY_ID_BYTES + 8 + GEN_BYTES + MAC_BYTES  # key id, expiry (unix s, 0: none), generations, MAC
_KEY_ID_KEY = PREFIX + b"m:key-id"
GEN_REFRESH_S = 1.0  # how stale a host's view of the clear generations may be (another host's clear)
_GEN_MAC_BYTES = 16
CLOCK_REFRESH_S = 60.0  # how often a host measures its clock's offset from the Redis server's (TIME)
EXPIRY_SKEW_S = 30  # a value is removed as expired only this far past its signed expiry (server clock)


def _now() -> float:
    """This host's wall clock; signed expiries are judged in the server's (its offset from this: TIME)."""
    return time.time()


def key_id(secret: bytes) -> bytes:
    """Which secret signed a value: a digest of it that reveals nothing of it."""
    return hashlib.sha256(b"shmkv remote key id\0" + secret).digest()[:KEY_ID_BYTES]


def _split_gens(gens: bytes) -> tuple[int, int]:
    return int.from_bytes(gens[:8], "big"), int.from_bytes(gens[8:16], "big")


def key_space(signer: bytes = b"") -> bytes:
    """The prefix of every chunk name of one key space: unauthenticated, or one key id's."""
    return PREFIX + (b"s:" + signer.hex().encode() + b":" if signer else b"c:")


def chunk_key(key: bytes, namespace: bytes, signer: bytes = b"") -> bytes:
    """The Redis key of a chunk (module doc); `signer`: the key id of a tier with a secret."""
    return key_space(signer) + namespace.hex().encode() + b":" + key.hex().encode()


def budget_keys(signer: bytes = b"") -> tuple[bytes, bytes, bytes]:
    """The byte-budget bookkeeping of one key space: (LRU zset, sizes hash, bytes total)."""
    tail = b":" + signer.hex().encode() if signer else b""
    return PREFIX + b"m:lru" + tail, PREFIX + b"m:sizes" + tail, PREFIX + b"m:bytes" + tail


class RemoteTier:
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
        if ok and data is not None and not isinstance(data, bytes):
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

    def _mac(self, rkey: bytes, head: bytes, data: bytes | memoryview) -> bytes:
        h = hmac.new(self._secret or b"", rkey, hashlib.sha256)
        h.update(head)
        h.update(data)
        return h.digest()

    def _authentic(self, rkey: bytes, value: bytes, namespace: bytes) -> memoryview | None:
        """The chunk of a signed value; None (counted) when another key
        signed it, when it is past the expiry its writer signed, or when it
        was written before a clear (those two removed). A value of our key
        whose MAC fails raises DamagedChunk."""
        if len(value) < SIGNED_HEAD:
            raise fmt.DamagedChunk("shorter than a signed value's head")
        head, mac = value[:SIGNED_HEAD - MAC_BYTES], value[SIGNED_HEAD - MAC_BYTES:SIGNED_HEAD]
        chunk = memoryview(value)[SIGNED_HEAD:]
        if head[:KEY_ID_BYTES] != self._key_id:
            # under our key id's name only we write: another key id here was planted (or moved) by
            # someone who can write to the Redis
            self._count("remote_foreign", 1)
            if not self._foreign_logged:
                self._foreign_logged = True
                log.warning("shmkv: remote chunk %s carries another key id (%s; ours %s) under our name: written "
                            "by someone who can write to the Redis without our secret; removed", rkey.decode(),
                            head[:KEY_ID_BYTES].hex(), self._key_id.hex())
            self._call("unlink", lambda: self._drop([rkey]))
            return None
        if not hmac.compare_digest(mac, self._mac(rkey, head, chunk)):
            raise fmt.DamagedChunk("its MAC of our secret does not match: changed after it was written")
        expires = int.from_bytes(head[KEY_ID_BYTES:KEY_ID_BYTES + 8], "big")
        if expires:
            now, measured = self._server_now()
            if now > expires + EXPIRY_SKEW_S:
                self._count("remote_expired", 1)
                if measured:  # in the server's clock: never on a clock of ours that runs ahead
                    self._call("unlink", lambda: self._drop([rkey]))
                return None
        signed = _split_gens(head[KEY_ID_BYTES + 8:])
        ours = self._generations(namespace)
        if ours is not None and any(v > o for v, o in zip(signed, _split_gens(ours))):
            ours = self._generations(namespace, fresh=True)  # another host cleared since we last looked
        if ours is None:
            return None  # the remote did not answer: counted there
        current = _split_gens(ours)
        if any(v < o for v, o in zip(signed, current)):
            self._count("remote_stale", 1)  # written before a clear (and written back since)
            self._call("unlink", lambda: self._drop([rkey]))
            return None
        if signed != current:
            # signed under a newer generation than the records say: only a holder of the secret could sign
            # it, so a clear happened whose record was erased or rolled back since: adopt it, write it back
            self._adopt_generations(namespace, signed)
        return chunk

    # ------------------------------------------------ clear generations --
    def _gen_key(self, namespace: bytes | None) -> bytes:
        return PREFIX + b"m:gen:" + self._key_id.hex().encode() + b":" + (namespace.hex().encode()
                                                                         if namespace else b"*")

    def _gen_value(self, gkey: bytes, gen: int) -> bytes:
        g = gen.to_bytes(8, "big")
        return g + hmac.new(self._secret or b"", b"shmkv gen\0" + gkey + g, hashlib.sha256).digest()[:_GEN_MAC_BYTES]

    def _gen_parse(self, gkey: bytes, value: object) -> int:
        """A record's generation; 0 when absent, or when it is not ours (its
        MAC fails: nobody with the secret wrote it)."""
        if not isinstance(value, bytes) or len(value) != 8 + _GEN_MAC_BYTES:
            return 0
        gen = int.from_bytes(value[:8], "big")
        return gen if hmac.compare_digest(value, self._gen_value(gkey, gen)) else 0

    def _generations(self, namespace: bytes, fresh: bool = False) -> bytes | None:
        """The two generations (of everything, of `namespace`) a value is
        signed under now, 16 bytes; None when the remote did not answer.
        Read again at most GEN_REFRESH_S after the last read (now: `fresh`)."""
        keys = [self._gen_key(None), self._gen_key(namespace)]
        now = time.monotonic()
        with self._gen_lock:
            known = [self._gens.get(k) for k in keys]
            if not fresh and all(k is not None and now - k[1] < GEN_REFRESH_S for k in known):
                return b"".join(k[0].to_bytes(8, "big") for k in known)  # type: ignore[union-attr]
        ok, values = self._call("generation", lambda: self._client.mget(keys) if not self.cluster
                                else [self._client.get(k) for k in keys])
        if not ok:
            return None
        out = []
        for k, old, v in zip(keys, known, values):
            gen = self._gen_parse(k, v)
            if old is not None and gen < old[0]:
                # NOTE: a record went back (someone who can write to the Redis replayed an old one):
                # ours is written back, or values from before a clear would be served again
                if not self._rollback_logged:
                    self._rollback_logged = True
                    log.warning("shmkv: remote tier %s: clear generation %s went back from %d to %d: "
                                "written back", self.display_url, k.decode(), old[0], gen)
                self._count("remote_healed", 1)
                self._call("generation", lambda k=k, g=old[0]: self._client.set(k, self._gen_value(k, g)))
                gen = old[0]
            out.append(gen)
        with self._gen_lock:
            for k, gen in zip(keys, out):
                self._gens[k] = (gen, now)
        return b"".join(g.to_bytes(8, "big") for g in out)

    def _adopt_generations(self, namespace: bytes, signed: tuple[int, int]) -> None:
        """Raise what we know of the generations (of everything, of
        `namespace`) to those a genuine value was signed under, and write
        the records back."""
        now = time.monotonic()
        for k, gen in zip((self._gen_key(None), self._gen_key(namespace)), signed):
            with self._gen_lock:
                if gen <= self._gens.get(k, (0, 0.0))[0]:
                    continue
                self._gens[k] = (gen, now)
            self._count("remote_healed", 1)
            log.warning("shmkv: remote tier %s: a value signed under clear generation %d of %s, newer than its "
                        "record: the record was erased or rolled back; written back", self.display_url, gen,
                        k.decode())
            self._call("generation", lambda k=k, g=gen: self._client.set(k, self._gen_value(k, g)))

    def _server_now(self) -> tuple[float, bool]:
        """(now in the Redis server's clock, whether that clock was measured):
        this host's clock plus its offset from the server's `TIME`, measured
        at most CLOCK_REFRESH_S ago; this host's own clock when TIME cannot
        be read."""
        mono = time.monotonic()
        if self._skew_at is None or mono - self._skew_at > CLOCK_REFRESH_S:
            first, self._skew_at = self._skew_at is None, mono
            set_deadline(mono + self.timeout_s)
            try:
                t0 = _now()
                answer = self._client.time()
                t1 = _now()
                if isinstance(answer, dict):  # a cluster: every primary's; they agree to NTP's precision
                    answer = next(iter(answer.values()))
                self._skew = float(answer[0]) + float(answer[1]) / 1e6 - (t0 + t1) / 2
                if first and abs(self._skew) > EXPIRY_SKEW_S:
                    log.warning("shmkv: remote tier %s: this host's clock is %+.0f s off the server's; signed "
                                "expiries are judged in the server's clock", self.display_url, -self._skew)
            except Exception as e:  # noqa: BLE001 - a server or proxy without TIME: our clock, remove nothing
                if first:
                    log.info("shmkv: remote tier %s: cannot read the server's clock (%s: %s); values past their "
                             "signed expiry are misses, not removed", self.display_url, type(e).__name__, e)
                self._skew = None
            finally:
                set_deadline(None)
        return (_now(), False) if self._skew is None else (_now() + self._skew, True)

    def _raise_generation(self, namespace: bytes | None) -> bool:
        """A clear's first step: the generation of everything (or of
        `namespace`) goes up by one, so that values written before it are
        stale wherever they come back from. False when the remote did not answer."""
        k = self._gen_key(namespace)

        def run() -> int:
            with self._gen_lock:
                seen = self._gens.get(k, (0, 0.0))[0]
            gen = max(self._gen_parse(k, self._client.get(k)), seen) + 1
            self._client.set(k, self._gen_value(k, gen))
            return gen

        ok, gen = self._call("clear", run)
        if ok:
            with self._gen_lock:
                self._gens[k] = (int(gen), time.monotonic())  # type: ignore[call-overload]
        return ok

    def _probe_key_id(self) -> None:
        """One WARNING at start when the first host of this remote signed with
        another secret (its key id is recorded once, SET NX)."""
        def run() -> bytes | None:
            self._client.set(_KEY_ID_KEY, self._key_id, nx=True)
            return self._client.get(_KEY_ID_KEY)

        ok, theirs = self._call("probe", run)
        if ok and isinstance(theirs, bytes) and theirs != self._key_id:
            log.warning("shmkv: remote tier %s: the hosts that wrote there first sign with another "
                        "remote_secret_file (key id %s; ours %s), or that record was planted by someone who can "
                        "write to the Redis: their chunks are misses here and ours there, and neither writes, "
                        "evicts or removes the other's; give every host the same secret", self.display_url,
                        theirs.hex(), self._key_id.hex())

    def _encoded(self, key: bytes, ns: bytes) -> tuple[bytes, tuple[str, int, float] | None] | None:
        """The chunk's encoded bytes from the source, in the codec this tier picks now."""
        return None if self.source is None else self.source(key, ns, self.codec.pick())
