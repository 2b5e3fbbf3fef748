"""The requests a tensor-parallel rank's synchronous load failed for, told
to every rank of the engine, so that no rank stores KV computed over
another rank's unfilled blocks.

At TP >= 2 a rank whose lease fails (its chunk evicted between the
scheduler's lookup and its own acquire) or whose copy fails computes its
shard of the step over blocks nobody filled; the forward's all-reduce mixes
that into every rank's hidden states, so every rank's KV of the step's new
tokens is wrong. vLLM recomputes the failed blocks, but chunks the other
ranks stored from that step would stay and become hits (with MLA, where one
rank stores for all, at once). Here the failing rank marks the request in a
file every rank of the engine maps (`weights-board.<engine>.load-failures` in
the runtime directory, 0600, removed with the engine's boards); each rank
checks it before it issues a store and again before it commits one.

Ordering: a failure known when the load is issued (a lease: the common
case) is marked before that rank's forward starts, so before any rank's
forward can pass the first all-reduce: every rank sees it at its store
issue. A failure seen only when the copies ran is marked when the rank
learns it, and checked again at every commit.

Invariant: a marked request stores nothing more on any rank of the engine.
The file is a ring of SLOTS 64-bit request hashes; a request marked more
than SLOTS failures ago is forgotten (it finished long before).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import stat
from collections.abc import Iterable

import numpy as np
import xxhash

from shmkv.paths import runtime_dir

log = logging.getLogger("shmkv.connector")

SLOTS = 4096
_SIZE = 8 * (SLOTS + 1)  # a count, then the slots


def failures_name(engine: str) -> str:
    return f"weights-board.{engine}.load-failures"


def _hash(req_id: str) -> int:
    return xxhash.xxh3_64_intdigest(req_id.encode()) or 1  # 0 marks an empty slot


class RankFailures:
    """One engine's failure file, mapped by each of its ranks (module doc)."""

    def __init__(self, engine: str) -> None:
        rd = runtime_dir()
        fd = rd.open(failures_name(engine), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                raise PermissionError(f"{failures_name(engine)} in the runtime directory is not this user's file")
            if st.st_size < _SIZE:
                os.ftruncate(fd, _SIZE)  # grows only: every rank may do it
            self._map = mmap.mmap(fd, _SIZE, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        self._words = np.frombuffer(self._map, dtype=np.uint64)
        self._known: set[str] = set()  # marked or found here: no scan again

    def mark(self, req_ids: Iterable[str]) -> None:
        """These requests store nothing more on any rank (under the file's lock)."""
        new = [r for r in req_ids if r not in self._known]
        if not new:
            return
        fcntl.flock(self._fd, fcntl.LOCK_EX)
        try:
            count = int(self._words[0])
            for r in new:
                self._words[1 + count % SLOTS] = _hash(r)
                count += 1
            self._words[0] = count
        finally:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._known.update(new)

    def marked(self, req_id: str) -> bool:
        """Whether any rank marked this request (a scan of the mapped slots: no system call)."""
        if req_id in self._known:
            return True
        used = min(int(self._words[0]), SLOTS)  # no failure yet (the usual case): nothing to scan
        if used and bool(np.any(self._words[1:1 + used] == np.uint64(_hash(req_id)))):
            self._known.add(req_id)
            return True
        return False

    def forget(self, req_ids: Iterable[str]) -> None:
        """Finished requests: this process's memo of them (the ring keeps their slots)."""
        self._known.difference_update(req_ids)

    def close(self) -> None:
        del self._words
        self._map.close()
        os.close(self._fd)
