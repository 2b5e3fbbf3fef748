"""Each TP rank's weights board and each engine's bell (weights.py): a
rank writes its board (a small JSON file in the runtime directory, renamed
into place) when its weights change or a check is answered, and stamps the
engine's bell (a mapped file of one 8-byte stamp per rank) after the rename;
the scheduler half reads the bell every step without a system call and the
board only when its stamp moved.

Invariant: a reader that hears a stamp reads that board or a newer one;
every process that maps a bell holds a shared flock on it for its lifetime,
so a sweep removes only the bells and boards of engines whose processes are
all gone."""

from __future__ import annotations

import fcntl
import json
import mmap
import os
import stat
import threading
import time
from typing import Any

from shmkv.integration.vllm.rank_failures import failures_name
from shmkv.paths import runtime_dir, runtime_dir_path


def board_name(engine_id: str, rank: int) -> str:
    return f"weights-board.{engine_id}.{rank}"


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


def engine_bell(engine_id: str) -> mmap.mmap | None:
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
    m = engine_bell(engine_id) if rank < BELL_RANKS else None
    if m is not None:
        m[8 * rank:8 * rank + 8] = stamp.to_bytes(8, "little")


def board_stamp(engine_id: str, rank: int) -> tuple[int, int] | None:
    """What changes whenever the rank's board is written: its bell stamp (a
    memory read), else (inode, mtime) of the board file (written, renamed)."""
    m = engine_bell(engine_id) if rank < BELL_RANKS else None
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
    """The engine's boards, its bell and its ranks' load-failure file (rank_failures.py)."""
    rd = runtime_dir()
    names = [board_name(engine_id, r) for r in range(tp_size)] + [failures_name(engine_id)]
    for name in names + [bell_name(engine_id)]:
        try:
            rd.unlink(name)
        except OSError:
            pass
    with _bells_lock:
        held = _bells.pop((runtime_dir_path(), engine_id), None)
    if held is not None:
        held[1].close()
        os.close(held[0])


