"""What a remote value carries when the hosts share a secret, and the names
of every remote key (shmkv.tiers.remote.tier stores and reads them).

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
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import time

from shmkv.tiers import format as fmt
from shmkv.tiers.remote.client import set_deadline

log = logging.getLogger("shmkv.remote")

PREFIX = b"shmkv:v1:"
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


class SignedValues:
    """RemoteTier's signing side (module doc): MACs, signed expiries, clear
    generations and the key-id probe. The attributes it uses are the tier's
    (RemoteTier.__init__)."""

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
