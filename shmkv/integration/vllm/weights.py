"""What an engine's weights are, so that no engine ever loads KV computed
with other weights. It owns two identities, both in every key (the namespace):

  * The files: an xxh3-128 digest of every byte of every weight file of a
    local model (hub models: the commit vLLM resolved). Each file's digest is
    remembered by (device, inode, size, mtime, ctime) in
    <runtime dir>/weights-digests.json (0600), so restarts read nothing; a
    new file content is read once, in a thread (vLLM's loader has just read
    the files, so they come from the page cache). The engine waits for it up
    to FILES_WAIT_S at start; past that it serves without shmkv (no lookup,
    no store) until the digest is known: a namespace is right or unused.
  * The weights in memory (RLHF updates, reload_weights, every weight-
    transfer engine: all go through the model's load_weights). Each worker
    fingerprints its parameters at registration; a load_weights (wrapped)
    marks its per-rank board file in the runtime directory "dirty" before the
    call returns (cheap: a weight sync calls it once per tensor) and rings
    the engine's bell (a mapped file of one stamp per rank, read by the
    scheduler every step without a system call), so the next step knows;
    the worker fingerprints again at its next step, and
    when the scheduler half asks (after a prefix-cache reset, vLLM's or the
    connector's). Weights that differ from those loaded at start name a new
    generation (namespace field weights_gen); the same weights again are the
    starting generation. While a board is dirty or a check is unanswered,
    lookups answer "ask again" and nothing is stored.

Invariant: a key's namespace names the weights that computed its KV; when in
doubt (unknown digest, pending check), shmkv neither loads nor stores.
"""

from __future__ import annotations

import fcntl
import gc
import json
import logging
import mmap
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

import torch
import xxhash

from shmkv.paths import runtime_dir, runtime_dir_path

log = logging.getLogger("shmkv.connector")

WEIGHT_FILE_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
CHECK_WAIT_S = 30.0  # how long lookups wait for the workers' answer to a weights check
FILES_WAIT_S = 5.0  # how long engine start waits for the files' digest (then serves without shmkv until known)
READ_BLOCK = 16 << 20
DIGESTS_FILE = "weights-digests.json"
MAX_REMEMBERED = 4096  # file digests kept in DIGESTS_FILE
SAMPLES_PER_TENSOR = 64

_digests_lock = threading.Lock()


# ------------------------------------------------------------------ files --
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


# -------------------------------------------------------------- in memory --
def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's elements as integers of the same width (its bits)."""
    flat = t.detach().reshape(-1)
    if not flat.is_floating_point() and not flat.is_complex():
        return flat
    by_size = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    size = flat.element_size()
    if flat.is_complex() or size not in by_size:
        return flat.contiguous().view(torch.uint8)
    return flat.contiguous().view(by_size[size])


def fingerprint(params: Iterable[tuple[str, torch.Tensor]]) -> str:
    """A fingerprint of the parameters' values: per tensor the int64 sum of
    its elements' bits and SAMPLES_PER_TENSOR elements spread through it,
    computed where the tensors live, one copy to the host."""
    parts: list[torch.Tensor] = []
    h = xxhash.xxh3_128()
    with torch.no_grad():
        for name, p in params:
            h.update(f"{name}:{tuple(p.shape)}:{p.dtype}\0".encode())
            b = _bits(p)
            n = b.numel()
            if n == 0:
                continue
            idx = torch.linspace(0, n - 1, min(n, SAMPLES_PER_TENSOR), device=b.device).long()
            parts.append(torch.cat([b.sum(dtype=torch.int64).reshape(1), b[idx].to(torch.int64)]))
    if parts:
        h.update(torch.cat([p.to(parts[0].device) for p in parts]).cpu().numpy().tobytes())
    return h.hexdigest()


def find_models(layers: Iterable[torch.nn.Module]) -> list[torch.nn.Module]:
    """The outermost modules with a load_weights method that hold one of
    `layers` (vLLM's attention layers of this worker): the target model and
    a drafter's. The model runner that registers the KV caches is on the
    call stack (its get_model() and its drafter's model); failing that, one
    scan of the heap."""
    want = {id(m) for m in layers}
    if not want:
        return []

    def holding(cands: Iterable[Any]) -> list[torch.nn.Module]:
        mods = [m for m in cands if isinstance(m, torch.nn.Module) and callable(getattr(m, "load_weights", None))]
        mods = [m for m in mods if any(id(s) in want for s in m.modules())]
        inner = {id(s) for m in mods for s in m.modules() if s is not m}
        out, seen = [], set()
        for m in mods:
            if id(m) not in inner and id(m) not in seen:
                seen.add(id(m))
                out.append(m)
        return out

    frame = sys._getframe(1)
    for _ in range(40):
        if frame is None:
            break
        owner = frame.f_locals.get("self")
        get_model = getattr(owner, "get_model", None)
        if callable(get_model):
            try:
                cands = [get_model()]
            except Exception:
                cands = []
            for name in ("drafter", "speculator"):
                cands.append(getattr(getattr(owner, name, None), "model", None))
            found = holding(cands)
            if found:
                return found
        frame = frame.f_back
    ok_type: dict[type, bool] = {}  # one check per type: the heap holds about a million objects

    def model_like(o: Any) -> bool:
        t = type(o)
        ok = ok_type.get(t)
        if ok is None:
            ok = ok_type[t] = issubclass(t, torch.nn.Module) and callable(getattr(t, "load_weights", None))
        return ok

    return holding(o for o in gc.get_objects() if model_like(o))


def board_name(engine_id: str, rank: int) -> str:
    return f"weights-board.{engine_id}.{rank}"


class WorkerWeights:
    """A worker's watch over its model's weights in memory (module doc)."""

    def __init__(self, engine_id: str, rank: int, models: list[torch.nn.Module]) -> None:
        self.engine_id, self.rank = engine_id, rank
        self.models = models
        self.answered = 0  # the scheduler's last check request answered
        self.dirty = False  # a load_weights ran since the last fingerprint
        self.fingerprint = ""
        for m in models:
            self._wrap(m)
        self.publish()

    def due(self, asked: int) -> bool:
        """Whether this step must fingerprint (weights loaded, or a check asked for)."""
        return self.dirty or asked > self.answered

    def _params(self) -> Iterable[tuple[str, torch.Tensor]]:
        for i, m in enumerate(self.models):
            for name, p in m.named_parameters():
                yield f"{i}.{name}", p
            for name, b in m.named_buffers():
                yield f"{i}.buffer.{name}", b

    def _wrap(self, model: torch.nn.Module) -> None:
        original: Callable = model.load_weights

        def load_weights(*args: Any, **kwargs: Any) -> Any:
            if not self.dirty:  # before the weights move: the scheduler stops using their keys
                self.dirty = True
                write_board(self.engine_id, self.rank, self._board())
            return original(*args, **kwargs)

        model.load_weights = load_weights  # type: ignore[method-assign]

    def _board(self) -> dict[str, Any]:
        return {"answered": self.answered, "fingerprint": self.fingerprint, "dirty": self.dirty}

    def publish(self, answered: int | None = None) -> None:
        """Fingerprint the weights now and write the board (before returning)."""
        if answered is not None:
            self.answered = max(self.answered, answered)
        t0 = time.perf_counter()
        self.dirty = False
        self.fingerprint = fingerprint(self._params())
        write_board(self.engine_id, self.rank, self._board())
        log.debug("shmkv: TP rank %d weights fingerprint %s (%.3f s)", self.rank, self.fingerprint,
                  time.perf_counter() - t0)


_last_stamp = 0


def write_board(engine_id: str, rank: int, content: dict[str, Any]) -> None:
    """Write a rank's board (a temp file, renamed). Its mtime is a stamp this
    process never repeats (a clock's granularity and a reused inode could
    otherwise make two boards look alike to the reader's stat)."""
    global _last_stamp
    rd = runtime_dir()
    name = board_name(engine_id, rank)
    tmp = f".{name}.{os.getpid()}"
    fd = rd.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(content, f)
        f.flush()
        _last_stamp = max(time.time_ns(), _last_stamp + 1)
        os.utime(f.fileno(), ns=(_last_stamp, _last_stamp))
    rd.replace(tmp, name)
    _ring(engine_id, rank, _last_stamp)  # after the rename: a reader that hears it reads this board or a newer one


BELL_RANKS = 512  # stamps in a bell file (8 bytes each); a rank past them is read by its board's stat
ORPHAN_BOARD_S = 3600  # a board with no bell this old belongs to no live engine (a live one rings at once)
_bells: dict[tuple[str, str], tuple[int, mmap.mmap]] = {}  # by (runtime directory, engine id): (locked fd, map)
_bells_lock = threading.Lock()


def bell_name(engine_id: str) -> str:
    return f"weights-bell.{engine_id}"


def _bell(engine_id: str) -> mmap.mmap | None:
    """The engine's bell, mapped (created at its size by whichever side comes
    first): one 8-byte stamp per rank, bumped after each board write. Every
    process that maps it holds a shared flock on it for its lifetime, so a
    sweep (sweep_stale) removes only the bells and boards of engines whose
    processes are all gone. None where the runtime directory cannot hold it
    (the boards' stat is used)."""
    key = (runtime_dir_path(), engine_id)
    held = _bells.get(key)  # every step: a dict read, no lock
    if held is not None:
        return held[1]
    with _bells_lock:
        held = _bells.get(key)
        if held is not None:
            return held[1]
        rd = runtime_dir()
        for _ in range(8):  # a sweep may unlink it between our open and our lock: open it again
            try:
                fd = rd.open(bell_name(engine_id), os.O_RDWR | os.O_CREAT, 0o600)
            except OSError:
                return None
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a sweep holds it (an unlink)
                st = os.fstat(fd)
                try:
                    named = rd.lstat(bell_name(engine_id))
                except OSError:
                    named = None
                if named is None or (named.st_dev, named.st_ino) != (st.st_dev, st.st_ino):
                    os.close(fd)
                    continue
                if st.st_uid != os.geteuid() or not stat.S_ISREG(st.st_mode):
                    os.close(fd)
                    return None
                if st.st_size < 8 * BELL_RANKS:
                    os.ftruncate(fd, 8 * BELL_RANKS)  # grows only: both sides may do it
                m = mmap.mmap(fd, 8 * BELL_RANKS, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError:
                os.close(fd)
                return None
            _bells[key] = (fd, m)
            return m
        return None


def sweep_stale(own_engine_id: str) -> int:
    """Remove the bells and boards of engines that are gone (no process holds
    their bell), and boards with no bell older than ORPHAN_BOARD_S (an older
    build's). An engine killed before its shutdown leaves them; each start
    sweeps. How many files were removed."""
    rd = runtime_dir()
    removed = 0
    names = [e.name for e in rd.scandir()]
    gone: set[str] = set()
    for name in names:
        if not name.startswith("weights-bell.") or name == bell_name(own_engine_id):
            continue
        try:
            fd = rd.open(name, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            st, named = os.fstat(fd), rd.lstat(name)
            if (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino):
                rd.unlink(name)  # under the lock: a process opening it now opens it again
                removed += 1
                gone.add(name[len("weights-bell."):])
        except OSError:
            pass  # held: the engine lives
        finally:
            os.close(fd)
    now = time.time()
    for name in names:
        if not name.startswith("weights-board."):
            continue
        engine_id = name[len("weights-board."):].rpartition(".")[0]
        try:
            if engine_id == own_engine_id:
                continue
            if engine_id not in gone and (bell_name(engine_id) in names
                                          or now - rd.lstat(name).st_mtime < ORPHAN_BOARD_S):
                continue
            rd.unlink(name)
            removed += 1
        except OSError:
            pass
    return removed


def _ring(engine_id: str, rank: int, stamp: int) -> None:
    m = _bell(engine_id) if rank < BELL_RANKS else None
    if m is not None:
        m[8 * rank:8 * rank + 8] = stamp.to_bytes(8, "little")


def board_stamp(engine_id: str, rank: int) -> tuple[int, int] | None:
    """What changes whenever the rank's board is written: its bell stamp (a
    memory read), else (inode, mtime) of the board file (written, renamed)."""
    m = _bell(engine_id) if rank < BELL_RANKS else None
    if m is not None:
        ring = int.from_bytes(m[8 * rank:8 * rank + 8], "little")
        return (0, ring) if ring else None
    try:
        st = runtime_dir().lstat(board_name(engine_id, rank))
    except OSError:
        return None
    return st.st_ino, st.st_mtime_ns


def read_board(engine_id: str, rank: int) -> dict[str, Any] | None:
    try:
        fd = runtime_dir().open(board_name(engine_id, rank), os.O_RDONLY)
    except OSError:
        return None
    with os.fdopen(fd) as f:
        try:
            got = json.load(f)
        except ValueError:
            return None
    return got if isinstance(got, dict) else None


def remove_boards(engine_id: str, tp_size: int) -> None:
    rd = runtime_dir()
    for name in [board_name(engine_id, r) for r in range(tp_size)] + [bell_name(engine_id)]:
        try:
            rd.unlink(name)
        except OSError:
            pass
    with _bells_lock:
        held = _bells.pop((runtime_dir_path(), engine_id), None)
    if held is not None:
        held[1].close()
        os.close(held[0])


class EngineWeights:
    """The scheduler half's view of the engine's weights: the files' identity
    and the workers' boards, read once per step. `fields()` are the
    namespace's weight fields, or None while they are not known (no lookup,
    no store)."""

    def __init__(self, engine_id: str, tp_size: int, files: FilesIdentity) -> None:
        self.engine_id, self.tp_size = engine_id, tp_size
        self.files = files
        _bell(engine_id)  # held from the start: no sweep takes it while this engine lives
        try:
            swept = sweep_stale(engine_id)
        except OSError as e:
            log.warning("shmkv: sweeping the weights boards of engines that are gone failed: %s", e)
        else:
            if swept:
                log.info("shmkv: removed %d weights board(s) of engines that are gone", swept)
        self._start: list[str | None] = [None] * tp_size  # each rank's fingerprint at registration
        self._now: list[str | None] = [None] * tp_size
        self._answered = [0] * tp_size
        self._dirty = [False] * tp_size
        self._stamps: list[tuple[int, int] | None] = [None] * tp_size
        self.asked = 0  # the last check request (ask_check), shipped to the workers in the step's metadata
        self._asked_at = 0.0
        self._check_late_logged = False
        self._fields: tuple[tuple[str, str], ...] | None = None
        self.generation = ""  # "" while the weights are those the engine started with

    def ask_check(self) -> None:
        """The workers fingerprint their weights at the next step (a prefix-cache reset: weights may have changed)."""
        self.asked += 1
        self._asked_at = time.monotonic()

    def pending(self) -> bool:
        """A check asked for is not answered by every worker yet (lookups ask
        again), for at most CHECK_WAIT_S: then the engine serves without
        shmkv until the answers come (a worker that never answers must not
        hold requests)."""
        if self.files.value is None or any(f is None for f in self._now):
            return False
        if all(a >= self.asked for a in self._answered) and not any(self._dirty):
            return False
        if time.monotonic() - self._asked_at > CHECK_WAIT_S:
            if not self._check_late_logged:
                self._check_late_logged = True
                log.warning("shmkv: the workers did not answer a weights check within %.0f s: requests are served "
                            "without the shared cache until they do", CHECK_WAIT_S)
            return False
        return True

    def refresh(self) -> bool:
        """Read the boards (once per step). True when the namespace's fields changed."""
        for r in range(self.tp_size):
            stamp = board_stamp(self.engine_id, r)
            if stamp is None or stamp == self._stamps[r]:
                continue  # unchanged since the last step: one stat
            b = read_board(self.engine_id, r)
            if b is None:
                continue
            self._stamps[r] = stamp
            fp = str(b.get("fingerprint", ""))
            if self._start[r] is None:
                self._start[r] = fp
            self._now[r] = fp
            self._answered[r] = int(b.get("answered", 0))
            was_dirty, self._dirty[r] = self._dirty[r], bool(b.get("dirty"))
            if self._dirty[r] and not was_dirty:
                self._asked_at = time.monotonic()  # the wait for its fingerprint starts now
        fields = self._compute()
        if fields == self._fields:
            return False
        self._fields = fields
        return True

    def _compute(self) -> tuple[tuple[str, str], ...] | None:
        if self.files.value is None or any(f is None for f in self._now):
            return None
        if any(a < self.asked for a in self._answered) or any(self._dirty):
            return None
        fields: tuple[tuple[str, str], ...] = (("weights", self.files.value),)
        if self._now != self._start:
            gen = xxhash.xxh3_128("\0".join(str(f) for f in self._now).encode()).hexdigest()
            fields += (("weights_gen", gen),)
            if gen != self.generation:
                log.info("shmkv: this engine's weights changed in memory (generation %s): it loads and stores only "
                         "KV of these weights from now on", gen[:12])
            self.generation = gen
        elif self.generation:
            log.info("shmkv: this engine's weights are those it started with again: it shares their chunks")
            self.generation = ""
        return fields

    def fields(self) -> tuple[tuple[str, str], ...] | None:
        return self._fields
