"""The weights as files (weights.py's first part): an xxh3-128 of every
byte of every weight file of a local model (a hub model: the commit vLLM
resolved), remembered by (device, inode, size, mtime, ctime) in
<runtime dir>/weights-digests.json (0600) so the same content is read once,
computed in a thread (FilesIdentity) while the engine starts.

Invariant: a digest names the bytes read; a file that changed while it was
read (its stat before and after differ) is read again, never remembered."""

from __future__ import annotations

import json
import logging
import mmap
import os
import threading
import time

import xxhash

from shmkv.paths import runtime_dir

log = logging.getLogger("shmkv.connector")

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
READ_BLOCK = 16 << 20
DIGESTS_FILE = "weights-digests.json"
MAX_REMEMBERED = 4096  # file digests kept in DIGESTS_FILE

_digests_lock = threading.Lock()


def _file_key(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def _load_remembered() -> dict[str, str]:
    try:
        rd = runtime_dir()
        fd = rd.open(DIGESTS_FILE, os.O_RDONLY)
    except OSError:
        return {}
    with os.fdopen(fd) as f:
        try:
            got = json.load(f)
        except ValueError:
            return {}
    return {str(k): str(v) for k, v in got.items()} if isinstance(got, dict) else {}


def _remember(key: str, digest: str) -> None:
    """Add one digest to the file (write a temp, rename): processes race only to the same content."""
    with _digests_lock:
        try:
            rd = runtime_dir()
            known = _load_remembered()
            known[key] = digest
            if len(known) > MAX_REMEMBERED:
                known = dict(list(known.items())[-MAX_REMEMBERED:])
            tmp = f".{DIGESTS_FILE}.{os.getpid()}.{threading.get_ident()}"
            fd = rd.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                json.dump(known, f)
            rd.replace(tmp, DIGESTS_FILE)
        except OSError as e:
            log.debug("shmkv: cannot remember the digest of a weight file (%s): computed again next start", e)


def file_digest(path: str) -> str:
    """xxh3-128 of every byte of the file, remembered by (device, inode,
    size, mtime, ctime): a rewrite in place with its mtime put back still
    moves the ctime. Raises OSError when the file cannot be read."""
    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        key = _file_key(st)
        known = _load_remembered().get(key)
        if known:
            return known
        h = xxhash.xxh3_128()
        if st.st_size:
            # hashed where the page cache holds it (a mapping: no copy into a buffer first)
            with mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as mm:
                mm.madvise(mmap.MADV_SEQUENTIAL)
                view = memoryview(mm)
                try:
                    for off in range(0, st.st_size, READ_BLOCK):
                        h.update(view[off:off + READ_BLOCK])
                finally:
                    view.release()
        after = os.fstat(f.fileno())
    digest = h.hexdigest()
    if _file_key(after) == key:  # not changed while read: else do not remember it
        _remember(key, digest)
    return digest


def weight_files(model: str) -> tuple[str, list[str]]:
    """(directory, weight file names) of a local model path; ("", []) for a hub name."""
    if os.path.isdir(model):
        return model, sorted(n for n in os.listdir(model) if n.endswith(WEIGHT_FILE_SUFFIXES))
    if os.path.isfile(model):
        base, name = os.path.split(model)
        return base, [name]
    return "", []


def files_identity(model: str, commit: str | None = None) -> str:
    """The weights' identity from their files: "hub:<commit>" for a model
    vLLM loaded from the hub; "files:<xxh3 over every file's name, size and
    digest>" for a local directory or file; "path:<model>" when there are no
    weight files to read (vLLM's dummy loader: the weights are random per
    engine anyway, and only the path is known). Raises OSError when a weight
    file cannot be read."""
    if commit:
        return "hub:" + commit
    base, names = weight_files(model)
    if not names:
        return "path:" + model
    h = xxhash.xxh3_128()
    for name in names:
        path = os.path.join(base, name)
        h.update(f"{name}\0{os.path.getsize(path)}\0{file_digest(path)}\0".encode())
    return "files:" + h.hexdigest()


class FilesIdentity:
    """The files' identity, computed in a thread. `value` is None until known
    (and for good if a weight file cannot be read: logged)."""

    def __init__(self, model: str, commit: str | None = None) -> None:
        self.value: str | None = None
        self.seconds = 0.0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(model, commit), name="shmkv-weights", daemon=True)
        self._thread.start()

    def _run(self, model: str, commit: str | None) -> None:
        t0 = time.perf_counter()
        try:
            self.value = files_identity(model, commit)
        except OSError as e:
            log.warning("shmkv: cannot read the weight files of %s (%s): without knowing the weights, this engine "
                        "serves without the shared cache", model, e)
        finally:
            self.seconds = time.perf_counter() - t0
            self._done.set()

    def wait(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


