"""The disk tier: one file per chunk in a 0700 directory, files 0600.

    <dir>/<key hex>.kv            a complete chunk (shmkv.disk.format)
    <dir>/.<key hex>.<pid>.<thread>.tmp   being written; renamed into place when whole

Any process may look chunks up (a stat per key: no shared index to keep
consistent) and read them. Only the maintainer writes and removes files, so
only it keeps an index: an LRU of file sizes under the directory's byte cap,
rebuilt at start from a directory scan (stat only, no decompression), which
also removes the temporary files a killed writer left (never those of a
writer that still runs: a maintainer handing its role over may be mid-write).

Nothing here raises into the caller for a damaged file, a full disk or an I/O
error: a bad file is a miss, a counter and an unlink; a failed write is a
counter and a chunk not spilled.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

import zstandard

from shmkv.disk import format as fmt

log = logging.getLogger("shmkv.disk")

SUFFIX = ".kv"


class DiskTier:
    def __init__(self, directory: str, *, capacity_bytes: int, level: int = 1, element_size: int = 2,
                 counter: Callable[[str, int], None] | None = None) -> None:
        self.dir = os.path.abspath(directory)
        self.capacity = capacity_bytes
        self.level = level
        self.element_size = element_size
        self._count = counter or (lambda name, n: None)
        self._lock = threading.Lock()
        self._index: OrderedDict[bytes, int] | None = None  # maintainer only
        self._bytes = 0
        self._unsynced: set[str] = set()  # written since the last sync()
        self._cctx = threading.local()
        _make_private_dir(self.dir)

    # ------------------------------------------------------------ naming --
    def path(self, key: bytes) -> str:
        return os.path.join(self.dir, key.hex() + SUFFIX)

    # ----------------------------------------------------------- lookups --
    def contains(self, keys: Sequence[bytes]) -> list[bool]:
        return [os.path.exists(self.path(k)) for k in keys]

    def prefix_length(self, keys: Sequence[bytes]) -> int:
        n = 0
        for k in keys:
            if not os.path.exists(self.path(k)):
                break
            n += 1
        return n

    def read(self, key: bytes) -> bytes | None:
        """The checked raw payload, or None (missing or damaged: then removed)."""
        got = self.read_with_namespace(key)
        return None if got is None else got[0]

    def read_with_namespace(self, key: bytes) -> tuple[bytes, bytes] | None:
        """(raw payload, namespace digest), or None (missing, or damaged and removed)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as e:
            log.warning("shmkv: cannot read %s: %s", path, e)
            self._count("promote_errors", 1)
            return None
        try:
            got = fmt.decode(data, key, decompressor=self._dctx())
        except fmt.DamagedChunk as e:
            log.warning("shmkv: damaged disk chunk %s (%s): removed", path, e.reason)
            self._count("disk_damaged", 1)
            self._unlink(path, key)
            return None
        self._touch(key)
        return got

    # ------------------------------------------------ writes (maintainer) --
    def write(self, key: bytes, namespace: bytes, raw: bytes | memoryview) -> bool:
        """Write one chunk (temp file + rename). False, counted, on any error."""
        final = self.path(key)
        tmp = os.path.join(self.dir, f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            data = fmt.encode(key, namespace, raw, element_size=self.element_size, level=self.level,
                              compressor=self._cctx_get())
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
            finally:
                os.close(fd)
            os.replace(tmp, final)
            with self._lock:
                self._unsynced.add(final)
        except OSError as e:
            log.warning("shmkv: spilling %s failed (%s); the chunk stays in memory only", key.hex(), e)
            self._count("spill_errors", 1)
            try:
                os.unlink(tmp)
            except OSError:
                pass
            return False
        self._added(key, len(data))
        self._count("spills", 1)
        self._count("spill_bytes", len(raw))
        return True

    def remove(self, key: bytes) -> bool:
        return self._unlink(self.path(key), key)

    def clear(self, namespace: bytes | None = None) -> int:
        """Remove every chunk file (or those whose header names `namespace`,
        and any file whose header cannot be read). Returns how many."""
        removed = 0
        for name in self._chunk_names():
            path = os.path.join(self.dir, name)
            key = bytes.fromhex(name[:32])
            if namespace is not None:
                try:
                    with open(path, "rb") as f:
                        _es, ns, *_ = fmt.read_header(f.read(fmt.HEADER_BYTES))
                except FileNotFoundError:
                    continue
                except (OSError, fmt.DamagedChunk):
                    ns = None  # unreadable: not worth keeping either
                if ns is not None and ns != namespace:
                    continue
            removed += self._unlink(path, key)
        return removed

    def sync(self) -> int:
        """Make the chunk files this process wrote since the last sync, and
        the directory, durable (fsync). Returns how many files."""
        with self._lock:
            paths, self._unsynced = self._unsynced, set()
        for path in paths:
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return len(paths)

    def _chunk_names(self) -> list[str]:
        with os.scandir(self.dir) as it:
            return [d.name for d in it if d.name.endswith(SUFFIX) and len(d.name) == 32 + len(SUFFIX)]

    def rebuild_index(self) -> tuple[int, int]:
        """Scan the directory (stat only), drop temporary files, enforce the
        cap. Returns (files, bytes)."""
        entries: list[tuple[float, bytes, int]] = []
        with os.scandir(self.dir) as it:
            for d in it:
                name = d.name
                if name.endswith(".tmp"):
                    if not _writer_alive(name):
                        self._unlink_quiet(d.path)  # left by a writer that was killed
                    continue
                if not name.endswith(SUFFIX) or len(name) != 32 + len(SUFFIX):
                    continue
                try:
                    key = bytes.fromhex(name[:32])
                    st = d.stat()
                except (ValueError, OSError):
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
            if self._unlink(self.path(key), key):
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

    def _unlink(self, path: str, key: bytes) -> bool:
        ok = self._unlink_quiet(path)
        with self._lock:
            if self._index is not None and key in self._index:
                self._bytes -= self._index.pop(key)
        return ok

    @staticmethod
    def _unlink_quiet(path: str) -> bool:
        try:
            os.unlink(path)
            return True
        except OSError:
            return False

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


def _writer_alive(tmp_name: str) -> bool:
    """Whether the process named in `.<key>.<pid>.<thread>.tmp` still runs
    (then the file is a write in progress, not debris)."""
    parts = tmp_name.split(".")
    try:
        pid = int(parts[2])
    except (IndexError, ValueError):
        return False
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _make_private_dir(path: str) -> None:
    """Create (0700) or check a directory only we can use."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    st = os.stat(path)
    if st.st_uid != os.geteuid():
        raise PermissionError(f"disk tier directory {path} is owned by uid {st.st_uid}, not {os.geteuid()}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        os.chmod(path, 0o700)
