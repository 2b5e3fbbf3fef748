"""Directories no one else controls, and the files shmkv keeps in them.

Every directory shmkv creates or uses (the disk tier's, the runtime directory
of locks, logs and the namespace registry, a controller socket's) is opened
component by component from "/" without following a link that someone else
could have planted:

  * each component is opened with O_DIRECTORY | O_NOFOLLOW relative to the
    previous one (openat), so the path cannot be swapped between a check and
    its use;
  * each component must be owned by us or by root, and not writable by group
    or others unless it is sticky and root-owned (/tmp, /dev/shm); a symbolic
    link is followed only if it is owned by us or by root (it then sits in a
    directory that passed these checks, so nobody else placed it);
  * the final directory must be owned by us; it is made 0700 through its fd.

A directory that fails is refused with PermissionDeniedError naming the path,
its owner and mode. Later file operations are relative to the directory's
fd (PrivateDir), never to its path.

The runtime directory is $SHMKV_RUNTIME_DIR, else $XDG_RUNTIME_DIR/shmkv, else
/tmp/shmkv-<uid>. The last one can be made by another user first: then it is
refused with a message that names the fix (set SHMKV_RUNTIME_DIR or
XDG_RUNTIME_DIR to a directory of yours).
"""

from __future__ import annotations

import errno
import fcntl
import os
import stat
import threading

from shmkv.errors import PermissionDeniedError

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_LINKS = 16


def _describe(st: os.stat_result) -> str:
    return f"owned by uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}"


def _trusted_parent(st: os.stat_result) -> bool:
    """A directory nobody but us (or root) can change entries of."""
    me = os.geteuid()
    if st.st_uid not in (me, 0):
        return False
    if stat.S_IMODE(st.st_mode) & 0o022:
        return bool(st.st_mode & stat.S_ISVTX) and st.st_uid == 0
    return True


class PrivateDir:
    """An open, checked directory: every operation is relative to its fd."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def open(self, name: str, flags: int, mode: int = 0o600) -> int:
        """os.open of a file in this directory, never following a link."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def is_file(self, name: str) -> bool:
        """Whether `name` is a regular file here (a link, FIFO or directory is not)."""
        try:
            return stat.S_ISREG(self.lstat(name).st_mode)
        except OSError:
            return False

    def unlink(self, name: str) -> None:
        os.unlink(name, dir_fd=self.fd)

    def replace(self, src: str, dst: str) -> None:
        os.replace(src, dst, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def scandir(self) -> list[os.DirEntry]:
        """Entries of the directory. Use only their names: stat them with
        lstat(), since DirEntry.stat() would need the (closed) listing fd."""
        return list(os.scandir(self.fd))  # CPython reads a dup of the fd and rewinds it

    def fsync(self) -> None:
        os.fsync(self.fd)

    def join(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _refuse(path: str, why: str) -> PermissionDeniedError:
    return PermissionDeniedError(f"{path}: {why}; shmkv only uses directories that no other user can change")


def _walk(path: str, *, create: bool, final_private: bool, links: int = 0) -> tuple[int, str]:
    """(fd, checked path) of `path`, opened component by component."""
    if not os.path.isabs(path):
        path = os.path.abspath(path)
    fd = os.open("/", _DIR_FLAGS)
    done = "/"
    try:
        st = os.fstat(fd)
        if st.st_uid != 0 and st.st_uid != os.geteuid():
            raise _refuse("/", _describe(st))
        parts = [p for p in path.split("/") if p not in ("", ".")]
        i = 0
        while i < len(parts):
            comp = parts[i]
            last = i == len(parts) - 1
            here = os.path.join(done, comp)
            if comp == "..":
                raise _refuse(path, "'..' in the path")
            try:
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except FileNotFoundError:
                if not create:
                    raise
                try:
                    os.mkdir(comp, 0o700, dir_fd=fd)
                except FileExistsError:
                    pass  # made by someone else meanwhile: checked below like any other
                nfd = os.open(comp, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                lst = os.stat(comp, dir_fd=fd, follow_symlinks=False)
                if not stat.S_ISLNK(lst.st_mode):
                    raise _refuse(here, f"not a directory ({e.strerror})") from None
                if lst.st_uid not in (0, os.geteuid()):
                    raise _refuse(here, f"a symbolic link {_describe(lst)}") from None
                if links >= _MAX_LINKS:
                    raise _refuse(here, "too many levels of symbolic links") from None
                links += 1
                target = os.readlink(comp, dir_fd=fd)
                rest = parts[i + 1:]
                base = target if os.path.isabs(target) else os.path.join(done, target)
                os.close(fd)
                fd = -1
                return _walk(os.path.normpath(os.path.join(base, *rest)), create=create,
                             final_private=final_private, links=links)
            os.close(fd)
            fd = nfd
            done = here
            st = os.fstat(fd)
            if last and final_private:
                if st.st_uid != os.geteuid():
                    raise _refuse(here, _describe(st))
                if stat.S_IMODE(st.st_mode) & 0o022:  # others could have planted files in it: never adopt it silently
                    raise _refuse(here, f"{_describe(st)}: writable by group or others, so its files may be "
                                        f"anyone's; check them, then `chmod 700 {here}`")
                if stat.S_IMODE(st.st_mode) != 0o700:
                    os.fchmod(fd, 0o700)
            elif not _trusted_parent(st):
                raise _refuse(here, _describe(st))
            i += 1
        out, fd = fd, -1
        return out, done
    finally:
        if fd >= 0:
            os.close(fd)


def open_private_dir(path: str, *, create: bool = True) -> PrivateDir:
    """The directory `path`, created (0700, with any missing parents) if
    needed, owned by us and 0700, reached without following anybody else's
    links (module doc). Raises PermissionDeniedError naming what is wrong."""
    fd, real = _walk(path, create=create, final_private=True)
    return PrivateDir(real, fd)


def check_private_file(path: str, what: str) -> None:
    """Refuse, as OpenSSH does, a file (a config, a token) that someone else
    could have written: owned by another uid than ours or root, or writable
    by group or others. The message names the file, its owner and mode and
    the fix. A missing file is left to the caller's open()."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISREG(st.st_mode):
        raise PermissionDeniedError(f"{what} {path}: not a regular file")
    if st.st_uid not in (os.geteuid(), 0):
        raise PermissionDeniedError(f"{what} {path}: {_describe(st)}, not by us (uid {os.geteuid()}) or root: "
                                    f"whoever owns it chooses our settings; use a file of yours")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise PermissionDeniedError(f"{what} {path}: {_describe(st)}: writable by group or others; "
                                    f"`chmod go-w {path}` if its contents are yours")


def read_secret_file(path: str, what: str, *, fix: str, root_ok: bool = False) -> bytes:
    """The contents (at most 4 KiB, whitespace stripped) of a file holding a
    secret: a regular file, not a link, owned by us (or root with `root_ok`),
    that nobody else can read or write. Raises PermissionDeniedError naming
    the file, its owner and mode and `fix`; FileNotFoundError when missing."""
    try:
        # O_NONBLOCK: a FIFO planted at the path must not hang the open (fstat then refuses it)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionDeniedError(f"{what} {path}: a symbolic link; {fix}") from None
        raise
    try:
        st = os.fstat(fd)
        owners = (os.geteuid(), 0) if root_ok else (os.geteuid(),)
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in owners or stat.S_IMODE(st.st_mode) & 0o077:
            raise PermissionDeniedError(f"{what} {path}: {_describe(st)}; it must be a regular file of ours that "
                                        f"nobody else can read or write; {fix}")
        return os.read(fd, 4096).strip()
    finally:
        os.close(fd)


def open_private_log(path: str, what: str) -> int:
    """An fd appending to the log file `path`: created 0600 if missing;
    otherwise it must be a regular file of ours that group and others cannot
    write (whoever owns it, or can write it, would read what we log and forge
    lines in it). Never follows a link, never blocks on a FIFO. Raises
    PermissionDeniedError naming the file, its owner and mode."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise PermissionDeniedError(f"{what} {path}: a symbolic link; give a file of ours") from None
        if e.errno == errno.ENXIO:
            raise PermissionDeniedError(f"{what} {path}: a FIFO, not a regular file; give a file of ours") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o022:
        os.close(fd)
        raise PermissionDeniedError(f"{what} {path}: {_describe(st)}; it must be a regular file of ours "
                                    f"(uid {os.geteuid()}) that nobody else can write; remove it or give another")
    return fd


def check_trusted_dir(path: str) -> str:
    """Check that `path` (e.g. the directory of a controller socket) and its
    parents cannot be changed by another user; the directory need not be
    ours (a sticky, root-owned one such as /tmp is fine). Returns the path
    after trusted links."""
    fd, real = _walk(path, create=False, final_private=False)
    os.close(fd)
    return real


# ------------------------------------------------------- runtime directory --
_runtime: dict[tuple[int, str], PrivateDir] = {}
_runtime_lock = threading.Lock()


def runtime_dir_path() -> str:
    """Where the runtime directory is (see the module doc), not yet checked."""
    explicit = os.environ.get("SHMKV_RUNTIME_DIR")
    if explicit:
        return explicit
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg:
        return os.path.join(xdg, "shmkv")
    return f"/tmp/shmkv-{os.geteuid()}"


def runtime_dir() -> PrivateDir:
    """The private runtime directory (locks, the namespace registry, daemon
    logs), opened once per process (and again after a fork)."""
    path = runtime_dir_path()
    key = (os.getpid(), path)
    with _runtime_lock:
        d = _runtime.get(key)
        if d is None:
            try:
                d = open_private_dir(path)
            except PermissionDeniedError as e:
                raise PermissionDeniedError(
                    f"{e}. Set SHMKV_RUNTIME_DIR (or XDG_RUNTIME_DIR) to a directory of yours, "
                    f"e.g. /run/user/{os.geteuid()}") from None
            _runtime[key] = d
        return d


class PidLock:
    """An exclusive, process-lifetime flock on a 0600 file in the runtime
    directory that also records the holder's pid (released by the kernel
    when the holder exits, however it exits)."""

    def __init__(self, name: str, directory: PrivateDir | None = None) -> None:
        self.dir = directory or runtime_dir()
        self.name = name
        self.path = self.dir.join(name)
        self._fd: int | None = None

    def try_acquire(self) -> bool:
        if self._fd is not None:
            return True
        fd = self.dir.open(self.name, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd = fd
        return True

    def holder_pid(self) -> int | None:
        """The pid written by the holder (None if never held or unreadable)."""
        try:
            fd = self.dir.open(self.name, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            return None
        try:
            return int(os.read(fd, 32).decode().strip() or 0) or None
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)

    def is_held_elsewhere(self) -> bool:
        """Whether another process holds the lock now."""
        if self._fd is not None:
            return False
        try:
            fd = self.dir.open(self.name, os.O_RDONLY | os.O_NONBLOCK)
        except FileNotFoundError:
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(fd)  # closing drops a shared lock we may have taken
        return False

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    @property
    def held(self) -> bool:
        return self._fd is not None


def maintainer_lock(cache_name: str) -> PidLock:
    """The maintainer role of one cache."""
    return PidLock(f"{cache_name}.maintainer.lock")


def daemon_lock(cache_name: str) -> PidLock:
    """Held by the one daemon of a cache for its lifetime."""
    return PidLock(f"{cache_name}.daemon.lock")


# the files a cache keeps in the runtime directory, by suffix (<cache>.<suffix>)
CACHE_FILE_SUFFIXES = ("engines.jsonl", "namespaces.jsonl", "maintainer.lock", "daemon.lock", "controller-token",
                       "controller.sock")


def remove_cache_files(cache_name: str) -> list[str]:
    """Remove what a cache keeps in the runtime directory (its registries,
    locks, controller token and socket), for a cache nobody uses any more (a
    benchmark's or a test's, after its segment): a lock some process still
    holds is left alone (removing it would let a second holder in). The
    names removed."""
    d = runtime_dir_path()
    removed = []
    for suffix in CACHE_FILE_SUFFIXES:
        name = f"{cache_name}.{suffix}"
        if suffix.endswith(".lock") and PidLock(name).is_held_elsewhere():
            continue
        try:
            os.unlink(os.path.join(d, name))
            removed.append(name)
        except FileNotFoundError:
            pass
    return removed
