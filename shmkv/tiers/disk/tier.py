"""The disk tier: one file per chunk in a 0700 directory, files 0600.

    <dir>/<key hex>.kv            a complete chunk (shmkv.tiers.format)
    <dir>/.<key hex>.<pid>.<thread>.tmp   being written (its writer holds its flock); renamed into place when whole

Any process may look chunks up (a stat per key: no shared index to keep
consistent) and read them. Only the maintainer writes and removes files, so
only it keeps an index: an LRU of file sizes under the directory's byte cap,
rebuilt at start from a directory scan (stat only, no decompression), which
also removes the temporary files a killed writer left (never those of a
writer that still runs, in any container: a maintainer handing its role over
may be mid-write; the writer's flock says, not its pid).

Nothing here raises into the caller for a damaged file, a full disk or an I/O
error: a bad file is a miss, a counter and an unlink; a failed write is a
counter and a chunk not spilled.

The directory is opened once, checked (shmkv.paths: no planted parent or
link), and every file operation is relative to its fd. A chunk file is opened
O_NOFOLLOW | O_NONBLOCK and must be a regular file (a link, FIFO, device or
directory under a chunk's name is a miss, a `disk_damaged` count and removed);
it is read with exactly the length its header declares, capped.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import zstandard

from shmkv.names import AUTO, DISK
from shmkv.paths import open_private_dir
from shmkv.tiers import format as fmt
from shmkv.tiers.codec import CodecChoice

log = logging.getLogger("shmkv.disk")

SUFFIX = ".kv"
ROOM_MARGIN = 4  # room_returned(): free space for this many of the failed write (not one that fills it again)
MAX_FILE_BYTES = 1 << 34  # larger than any chunk shmkv writes (a segment's max payload is far below)


def _read_exact(fd: int, n: int, offset: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        b = os.pread(fd, n - len(out), offset + len(out))
        if not b:
            break
        out += b
    return bytes(out)


class DiskTier:
    """The disk tier (a shmkv.tiers.Tier): one file per chunk."""

    name = DISK
    max_raw = fmt.MAX_RAW  # largest raw chunk a read accepts; a tier chain sets its segment's
    def __init__(self, directory: str, *, capacity_bytes: int, level: int = 1, element_size: int = 2,
                 codec: str = AUTO, counter: Callable[[str, int], None] | None = None,
                 max_raw: int = fmt.MAX_RAW) -> None:
        """`max_raw`: the largest raw chunk a read decodes (a tier chain sets its segment's)."""
        self.max_raw = max_raw
        self._d = open_private_dir(directory)
        self.dir = self._d.path
        self.capacity = capacity_bytes
        self.level = level
        self.element_size = element_size
        self.codec = CodecChoice(DISK, codec)
        self._count = counter or (lambda name, n: None)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] | None = None  # maintainer only
        self._bytes = 0
        self._unsynced: set[str] = set()  # written since the last sync()
        self._cctx = threading.local()
        self._reported: set[str] = set()  # non-file entries already counted
        self.last_write_error: OSError | None = None  # of the last failed write (None once one works)
        self._room_wanted = 0  # bytes a write failed for with ENOSPC/EDQUOT (0: none since one worked)

    # ------------------------------------------------------------ naming --
    def path(self, key: bytes) -> str:
        """Where a chunk's file is (for messages and tests; I/O goes through the dir fd)."""
        return self._d.join(_name(key))

    # ----------------------------------------------------------- lookups --
    def contains(self, keys: Sequence[bytes], namespaces: Sequence[bytes] | None = None) -> list[bool]:
        """Whether each key's file is here (files are named by key alone: `namespaces` is not needed)."""
        return [self._has(k) for k in keys]

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if not self._has(k):
                break
            n += 1
        return n

    def _has(self, key: bytes) -> bool:
        """A regular file under the key's name; anything else there is counted and removed."""
        name = _name(key)
        try:
            st = self._d.lstat(name)
        except OSError:
            return False
        if stat.S_ISREG(st.st_mode):
            return True
        self._not_a_file(name, key, st.st_mode)
        return False

    def _not_a_file(self, name: str, key: bytes, mode: int) -> None:
        kind = ("a directory" if stat.S_ISDIR(mode) else "a symbolic link" if stat.S_ISLNK(mode)
                else "a FIFO" if stat.S_ISFIFO(mode) else "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode)
                else "not a regular file")
        if name in self._reported:
            return
        self._count("disk_damaged", 1)
        if stat.S_ISDIR(mode):
            self._reported.add(name)  # not ours to remove recursively; counted once
            log.warning("shmkv: %s is a directory, not a chunk file: ignored", self._d.join(name))
            return
        log.warning("shmkv: %s is %s, not a chunk file: removed", self._d.join(name), kind)
        self._unlink(name, key)

    def read_file(self, key: bytes) -> bytes | None:
        """The chunk's file contents exactly as its (checked) header declares
        them, or None: missing, not a regular file, or with a bad header
        (counted and removed). decode() does the remaining checks."""
        name = _name(key)
        try:
            fd = self._d.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symbolic link under a chunk's name
                self._not_a_file(name, key, stat.S_IFLNK)
                return None
            log.warning("shmkv: cannot read %s: %s", self._d.join(name), e)
            self._count("promote_errors", 1)
            return None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                self._not_a_file(name, key, st.st_mode)
                return None
            if st.st_uid != os.geteuid():  # not written by us: whoever did chooses the KV it holds
                self._damaged(name, key, f"owned by uid {st.st_uid}, not by us")
                return None
            head = _read_exact(fd, fmt.HEADER_BYTES, 0)
            try:
                raw_len, comp_len = fmt.read_header(head)[3:5]
                total = fmt.HEADER_BYTES + comp_len
                if total > MAX_FILE_BYTES or total != st.st_size:
                    raise fmt.DamagedChunk(f"file is {st.st_size} bytes, its header says {total}")
                if raw_len > self.max_raw:  # before reading the rest: a reader holds no more than this
                    raise fmt.DamagedChunk(f"raw length {raw_len} exceeds the limit {self.max_raw}")
            except fmt.DamagedChunk as e:
                self._damaged(name, key, e.reason)
                return None
            return head + _read_exact(fd, comp_len, fmt.HEADER_BYTES)
        except OSError as e:
            log.warning("shmkv: cannot read %s: %s", self._d.join(name), e)
            self._count("promote_errors", 1)
            return None
        finally:
            os.close(fd)

    def _damaged(self, name: str, key: bytes, reason: str) -> None:
        log.warning("shmkv: damaged disk chunk %s (%s): removed", self._d.join(name), reason)
        self._count("disk_damaged", 1)
        self._unlink(name, key)

    def read(self, key: bytes) -> bytes | None:
        """The checked raw payload, or None (missing or damaged: then removed)."""
        got = self.fetch(key)
        return None if got is None else got[0]

    def fetch(self, key: bytes, namespace: bytes | None = None) -> tuple[bytearray, bytes] | None:
        """(raw payload, namespace digest), or None (missing, or damaged and removed)."""
        return self.fetch_into(key, namespace, lambda n, _ns: bytearray(n))

    def fetch_into(self, key: bytes, namespace: bytes | None, alloc: Callable[[int, bytes], Any], *,
                   max_raw: int | None = None) -> tuple[Any, bytes] | None:
        """Decode a chunk straight into alloc(raw_len, namespace)'s buffer:
        (that buffer, namespace), or None (missing, no room, or damaged and
        removed; what alloc gave must then be discarded). A header declaring
        more than `max_raw` bytes is damage, found before any decompression."""
        data = self.read_file(key)
        if data is None:
            return None
        try:
            # NOTE: lossy_ok: a lossy chunk is keyed by shmkv.keys.lossy_key, so moving it between
            # tiers under its own key never hands it to an exact request
            got = fmt.decode_into(data, key, alloc, decompressor=self._dctx(), lossy_ok=True,
                                  max_raw=max_raw or self.max_raw)
        except fmt.DamagedChunk as e:
            self._damaged(_name(key), key, e.reason)
            return None
        if got is not None:
            self._touch(key)
        return got

    # ------------------------------------------------ writes (maintainer) --
    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview, tokens: int = 0) -> bool:
        """Write one chunk (temp file + rename). False, counted, on any error."""
        codec = self.codec.pick(space_short=self._space_short())
        t0 = time.perf_counter()
        head, body = fmt.encode_parts(key, namespace, raw, element_size=self.element_size, level=self.level,
                                      compressor=self._cctx_get(), codec=codec)
        return self._write_file(key, head, body, memoryview(raw).nbytes, tokens,
                                measured=(codec, time.perf_counter() - t0))

    def write_encoded(self, key: bytes, data: bytes | memoryview, tokens: int = 0) -> bool:
        """Write one chunk already in the chunk format (a compressed entry of
        the shared tier), as it is. False, counted, on any error."""
        try:
            raw_len = fmt.read_header(bytes(memoryview(data)[:fmt.HEADER_BYTES]))[3]
        except fmt.DamagedChunk as e:
            log.warning("shmkv: not spilling chunk %s: %s", key.hex(), e.reason)
            self._count("spill_errors", 1)
            return False
        view = memoryview(data).cast("B")
        return self._write_file(key, view[:fmt.HEADER_BYTES], view[fmt.HEADER_BYTES:], raw_len, tokens)

    def _write_file(self, key: bytes, head: bytes | memoryview, body: bytes | memoryview, raw_len: int, tokens: int,
                    measured: tuple[str, float] | None = None) -> bool:
        final = _name(key)
        tmp = f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            t1 = time.perf_counter()
            fd = self._d.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                # NOTE: held until the rename: a write in progress to every process that scans
                # the directory, in any PID namespace; the kernel drops it if this one dies
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                _write_all(fd, [memoryview(head).cast("B"), memoryview(body).cast("B")])
                size = memoryview(head).nbytes + memoryview(body).nbytes
                if measured is not None:
                    self.codec.record(measured[0], raw_len, size, measured[1], time.perf_counter() - t1)
                self._d.replace(tmp, final)
            finally:
                os.close(fd)
            with self._lock:
                self._unsynced.add(final)
        except OSError as e:
            self.last_write_error = e
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                self._room_wanted = max(self._room_wanted, memoryview(head).nbytes + memoryview(body).nbytes)
            self._count("spill_errors", 1)
            try:
                self._d.unlink(tmp)
            except OSError:
                pass
            return False
        self.last_write_error = None
        self._room_wanted = 0
        self._added(key, size)
        self._count("spills", 1)
        self._count("spill_bytes", raw_len)
        if tokens:
            self._count("spill_tokens", tokens)
        return True

    def remove(self, key: bytes, namespace: bytes | None = None) -> bool:
        return self._unlink(_name(key), key)

    def clear(self, namespace: bytes | None = None) -> int:
        """Remove every chunk file (or those whose header names `namespace`,
        and any file whose header cannot be read). Returns how many."""
        removed = 0
        for name in self._chunk_names():
            key = bytes.fromhex(name[:32])
            if namespace is not None:
                try:
                    fd = self._d.open(name, os.O_RDONLY | os.O_NONBLOCK)
                except FileNotFoundError:
                    continue
                except OSError:
                    fd = -1  # unreadable: not worth keeping either
                ns = None
                if fd >= 0:
                    try:
                        _es, ns, *_ = fmt.read_header(_read_exact(fd, fmt.HEADER_BYTES, 0))
                    except (OSError, fmt.DamagedChunk):
                        pass
                    finally:
                        os.close(fd)
                if ns is not None and ns != namespace:
                    continue
            removed += self._unlink(name, key)
        return removed

    def sync(self) -> int:
        """Make the chunk files this process wrote since the last sync, and
        the directory, durable (fsync). Returns how many files."""
        with self._lock:
            names, self._unsynced = self._unsynced, set()
        for name in names:
            try:
                fd = self._d.open(name, os.O_RDONLY | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        self._d.fsync()
        return len(names)

    def _writer_alive(self, name: str) -> bool:
        """Whether a process still writes the temporary file `name`: it holds
        the file's flock while it writes (whatever PID namespace it runs in,
        where its pid in the name would mean nothing)."""
        try:
            fd = self._d.open(name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return True  # renamed into place meanwhile, or not ours to open: left alone
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:  # held (BlockingIOError), or not ours to judge
            return True
        finally:
            os.close(fd)
        return False

    def _chunk_names(self) -> list[str]:
        return [d.name for d in self._d.scandir() if d.name.endswith(SUFFIX) and len(d.name) == 32 + len(SUFFIX)]

    def rebuild_index(self) -> tuple[int, int]:
        """Scan the directory (stat only), drop temporary files, enforce the
        cap. Returns (files, bytes)."""
        entries: list[tuple[float, bytes, int]] = []
        for d in self._d.scandir():
            name = d.name
            if name.endswith(".tmp"):
                if not self._writer_alive(name):
                    self._unlink_quiet(name)  # left by a writer that was killed
                continue
            if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
                continue
            try:
                key = bytes.fromhex(name[:32])
                st = self._d.lstat(name)
            except (ValueError, OSError):
                continue
            if not stat.S_ISREG(st.st_mode):
                self._not_a_file(name, key, st.st_mode)
                continue
            entries.append((st.st_mtime, key, st.st_size))
        entries.sort()
        with self._lock:
            self._index = OrderedDict((k, size) for _, k, size in entries)
            self._bytes = sum(size for _, _, size in entries)
        self.enforce_cap()
        return len(self._index), self._bytes

    def enforce_cap(self) -> int:
        """Remove least recently used files until under the byte cap."""
        removed = 0
        while True:
            with self._lock:
                if self._index is None or self._bytes <= self.capacity or not self._index:
                    return removed
                key, _ = next(iter(self._index.items()))
            if self._unlink(_name(key), key):
                self._count("disk_removed", 1)
                removed += 1

    @property
    def used_bytes(self) -> int:
        return self._bytes

    @property
    def files(self) -> int:
        return len(self._index or ())

    # ---------------------------------------------------------- internals --
    def _added(self, key: bytes, size: int) -> None:
        with self._lock:
            if self._index is None:
                return
            old = self._index.pop(key, 0)
            self._index[key] = size
            self._bytes += size - old
        self.enforce_cap()

    def _touch(self, key: bytes) -> None:
        with self._lock:
            if self._index is not None and key in self._index:
                self._index.move_to_end(key)

    def _unlink(self, name: str, key: bytes) -> bool:
        ok = self._unlink_quiet(name)
        with self._lock:
            if self._index is not None and key in self._index:
                self._bytes -= self._index.pop(key)
        return ok

    def _unlink_quiet(self, name: str) -> bool:
        try:
            self._d.unlink(name)
            return True
        except OSError:
            return False

    def room_returned(self) -> bool:
        """After writes failed for want of space (ENOSPC, EDQUOT): whether the
        file system has room for such a write again (someone freed it), so
        spills resume now rather than when a backoff ends. A read of statvfs."""
        if not self._room_wanted:
            return False
        try:
            st = os.fstatvfs(self._d.fd)
        except OSError:
            return False
        return st.f_bavail * st.f_frsize >= ROOM_MARGIN * self._room_wanted

    def _space_short(self) -> bool:
        """Whether the tier is nearly at its byte cap (known to the maintainer's index only)."""
        return self._index is not None and self.capacity > 0 and self._bytes > 0.9 * self.capacity

    def _cctx_get(self) -> zstandard.ZstdCompressor:
        c = getattr(self._cctx, "c", None)
        if c is None:
            c = self._cctx.c = zstandard.ZstdCompressor(level=self.level)
        return c

    def _dctx(self) -> zstandard.ZstdDecompressor:
        d = getattr(self._cctx, "d", None)
        if d is None:
            d = self._cctx.d = zstandard.ZstdDecompressor()
        return d


def _write_all(fd: int, parts: list[memoryview]) -> None:
    """writev every byte of `parts` (short writes resumed)."""
    while parts:
        n = os.writev(fd, parts)
        while parts and n >= parts[0].nbytes:
            n -= parts[0].nbytes
            parts.pop(0)
        if parts and n:
            parts[0] = parts[0][n:]


def _name(key: bytes) -> str:
    return key.hex() + SUFFIX
