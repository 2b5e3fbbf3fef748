"""What a process group that a benchmark or the test suite started (a vLLM
engine, a `vllm serve`) leaves behind, removed by ownership: never by name
and time, so a neighbour's engine on the same host keeps what it made.

vLLM's processes fill two places that outlive them when they are killed (as
`vllm serve` is by default, or its workers at shutdown):

  * the temporary directory: gloo's file stores (vllm_dist_*), ZMQ's IPC
    sockets. Each group gets a temporary directory of its own (TMPDIR in its
    environment, inherited by every process vLLM starts), removed whole once
    the group ended: everything in it is the group's by construction;
  * /dev/shm, whose names no process chooses for another: vLLM's message
    queues (psm_*), the CPU backend's TP regions (vllm_dist_*), the named
    semaphores of Python's multiprocessing (sem.mp-*). The files of these
    kinds that the group's processes map or hold open are read from /proc
    while they live (when it is ready, every POLL_S, and before it is
    signalled) by device and inode, and named by a listing of /dev/shm (a
    semaphore is mapped under a temporary name). Once the group ended, a
    recorded file is removed only if the name still holds that same file and
    no live process maps or holds it.

A group's descendant that left it (a session of its own) still carries the
group's TMPDIR in its environment: it is the group's too, and remove() ends
it before the directory goes (else it writes there again after the removal).
Each OwnedFiles not yet removed is listed in `unremoved()` with where it was
made: a harness that never ended its group is named (the test suite fails a
run that leaves one).

Invariant: a file is removed only if a process of the group was seen holding
that very file (device and inode); a name that merely appeared while the
group ran is never touched (a neighbour's semaphore, made and mapped under a
temporary name first by glibc, looks exactly like an orphan by name and time).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import tempfile
import threading
import time
import traceback

SHM_DIR = "/dev/shm"
# vLLM's kinds of shared-memory files (module doc); shmkv's segments are their owners' to remove
VLLM_SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_dist_")
GROUP_EXIT_WAIT_S = 10.0  # how long remove() waits for the group's last (killed) processes to exit
POLL_S = 0.5  # how often a live group's files are read again (a group that crashes keeps what it made since)

log = logging.getLogger(__name__)

FileId = tuple[int, int]  # (st_dev, st_ino)
_RMTREE_TRIES = 20  # the directory's removal, tried again while something was still written into it
_SUN_PATH_MAX = 107  # a unix socket's path, in bytes
_TMPDIR_NAME_AND_SOCKET = len("/shmkv--tmp-XXXXXXXX") + len("/") + 36  # the directory's name, then a uuid4 socket


def tmpdir_users(tmpdir: str) -> list[int]:
    """The live processes whose environment (as they were started) names
    `tmpdir` as TMPDIR: a group's descendants, wherever their group is now."""
    needle = b"TMPDIR=" + os.fsencode(tmpdir)
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            with contextlib.suppress(OSError):
                with open(f"/proc/{d}/environ", "rb") as f:
                    if needle in f.read().split(b"\0"):
                        out.append(int(d))
    return out


def _stat_fields(pid: int | str) -> list[bytes]:
    """/proc/PID/stat's fields after the command name (state first, the process group third); [] if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return []
    return data[data.rindex(b")") + 2:].split()  # after the command name, which may hold spaces


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    fields = _stat_fields(pid)
    return bool(fields) and fields[0] != b"Z"


def group_pids(pgid: int) -> list[int]:
    """The live processes (zombies left out) whose process group is `pgid` (read from /proc)."""
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            fields = _stat_fields(d)
            if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != b"Z":  # a zombie holds nothing
                out.append(int(d))
    return out


def files_held_by(pid: int, prefix: str = "/") -> set[FileId]:
    """The files under `prefix` that process `pid` maps or holds open, as
    (device, inode): by inode, not name, since glibc maps a named semaphore
    under a temporary name that it links to the real one and then unlinks
    (the mapping shows the temporary name, deleted). A process in a container
    with a /dev/shm of its own shows its files with that device."""
    out: set[FileId] = set()
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/maps") as f:
            for line in f:
                parts = line.split(maxsplit=5)
                if len(parts) == 6 and parts[5].startswith(prefix):
                    major, minor = parts[3].split(":")
                    out.add((os.makedev(int(major, 16), int(minor, 16)), int(parts[4])))
    with contextlib.suppress(OSError):
        fd_dir = f"/proc/{pid}/fd"
        for fd in os.listdir(fd_dir):
            with contextlib.suppress(OSError):
                if os.readlink(os.path.join(fd_dir, fd)).startswith(prefix):
                    st = os.stat(os.path.join(fd_dir, fd))
                    out.add((st.st_dev, st.st_ino))
    return out


def shm_files_of(pid: int) -> set[FileId]:
    """The files of /dev/shm that process `pid` maps or holds open (files_held_by)."""
    return files_held_by(pid, SHM_DIR + "/")


def shm_files_in_use() -> set[FileId]:
    """Every /dev/shm file some live process maps or holds open."""
    used: set[FileId] = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            used |= shm_files_of(int(d))
    return used


def vllm_shm_files() -> dict[str, FileId]:
    """vLLM's kinds of files in /dev/shm now (VLLM_SHM_PREFIXES): name -> (device, inode)."""
    out = {}
    with contextlib.suppress(OSError):
        for name in os.listdir(SHM_DIR):
            if name.startswith(VLLM_SHM_PREFIXES):
                with contextlib.suppress(OSError):
                    st = os.lstat(os.path.join(SHM_DIR, name))
                    out[name] = (st.st_dev, st.st_ino)
    return out


def held_by_live_processes(paths: list[str]) -> set[str]:
    """Those of `paths` that a live process maps, holds open, or (a unix
    socket) has bound: in use, whoever made them."""
    held: set[FileId] = set()
    for d in os.listdir("/proc"):
        if d.isdigit():
            held |= files_held_by(int(d))
    bound: set[str] = set()
    with contextlib.suppress(OSError):
        with open("/proc/net/unix") as f:
            bound = {line.split()[-1] for line in f if line.count(" ") >= 7 and line.split()[-1].startswith("/")}
    out = set()
    for path in paths:
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if (st.st_dev, st.st_ino) in held or path in bound:
                out.add(path)
    return out


class OwnedFiles:
    """The files of one started process group (module doc): its own
    temporary directory (`tmpdir`, to put in its environment as TMPDIR before
    it starts), and the vLLM shared-memory files its processes were seen
    holding. `watch(pgid)` once it runs; `sample()` before signalling it;
    `remove()` once it ended."""

    def __init__(self, label: str = "engine") -> None:
        base = tempfile.gettempdir()
        if len(base) + len(label) + _TMPDIR_NAME_AND_SOCKET > _SUN_PATH_MAX:
            base = "/tmp"  # NOTE: vLLM's IPC sockets live in it and a unix socket's path has 107 bytes at most
        self.tmpdir = tempfile.mkdtemp(prefix=f"shmkv-{label}-tmp-", dir=base)
        # where it was made (the caller's frames): named if it is never removed (unremoved())
        self.made_at = "".join(traceback.format_stack(limit=6)[:-1])
        _UNREMOVED.add(self)
        self.shm: dict[str, FileId] = {}
        self._pgid: int | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, pgid: int) -> None:
        """Record the group's files now and every POLL_S while it lives."""
        self._pgid = pgid
        self.sample()
        self._thread = threading.Thread(target=self._poll, name=f"shmkv-owned-files-{pgid}", daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._stop.wait(POLL_S):
            if not self.sample():
                return  # the group has ended

    def sample(self) -> bool:
        """Record what the group's live processes hold now; whether any lives."""
        if self._pgid is None:
            return False
        pids = group_pids(self._pgid)
        held: set[FileId] = set()
        for pid in pids:
            held |= shm_files_of(pid)
        if held:
            seen = {name: fid for name, fid in vllm_shm_files().items() if fid in held}
            with self._lock:
                self.shm.update(seen)
        return bool(pids)

    def remove(self) -> list[str]:
        """Once the group ended: its temporary directory, and each recorded
        shared-memory file still the same file that nothing holds. The names removed."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # NOTE: the caller reaped the leader and SIGKILLed the rest, but a killed process maps its files
        # until it has exited: wait (bounded) until none of the group lives, else they look in use
        deadline = time.monotonic() + GROUP_EXIT_WAIT_S
        while self._pgid is not None and group_pids(self._pgid) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._remove_tmpdir()
        _UNREMOVED.discard(self)
        with self._lock:
            recorded = dict(self.shm)
        if not recorded:
            return []
        in_use = shm_files_in_use()
        removed = []
        for name, fid in recorded.items():
            path = os.path.join(SHM_DIR, name)
            try:
                st = os.lstat(path)
            except OSError:
                continue  # unlinked by its owner: the usual end
            if (st.st_dev, st.st_ino) != fid or fid in in_use:
                continue  # another file under the name now, or still held by a live process
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
        return removed

    def end(self) -> list[str]:
        """For a group its harness never ended: SIGKILL to it, then remove()."""
        if self._pgid is not None:
            with contextlib.suppress(OSError):
                os.killpg(self._pgid, signal.SIGKILL)
        return self.remove()

    def _remove_tmpdir(self) -> None:
        """The group's temporary directory, once no descendant of the group
        (tmpdir_users: those that left it too) can write there again."""
        stragglers = tmpdir_users(self.tmpdir)
        for pid in stragglers:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + GROUP_EXIT_WAIT_S
        while any(_alive(p) for p in stragglers) and time.monotonic() < deadline:
            time.sleep(0.05)
        for _ in range(_RMTREE_TRIES):  # NOTE: a process's last writes can land during the walk
            shutil.rmtree(self.tmpdir, ignore_errors=True)
            if not os.path.lexists(self.tmpdir):
                return
            time.sleep(0.1)
        left = sorted(os.listdir(self.tmpdir)) if os.path.isdir(self.tmpdir) else []
        log.warning("could not remove %s (left: %s)", self.tmpdir, ", ".join(left[:10]))


_UNREMOVED: set[OwnedFiles] = set()  # made, not yet removed (strong: one collected unremoved is a leak too)


def unremoved() -> list[OwnedFiles]:
    """The OwnedFiles of this process made and not yet removed: groups whose harness never ended them."""
    return list(_UNREMOVED)
