"""The test run leaves /dev/shm, shmkv's runtime directory and the
temporary directory as it found them (#54, #67): a pytest plugin that notes
what each held at the session's start and, at its end, fails the run when
new files are there that nothing holds, naming them
(SHMKV_TEST_LEFTOVERS=report: only says so).

Nothing here removes vLLM's files by name: what the run's engines leave is
removed by the harness that ends each one, by ownership
(shmkv.engines.owned_files). A neighbour's engine started while the run ran
keeps its files: a new file of vLLM's kinds that a live process holds is
named as in use, not counted; so is any new file or directory that a live
process outside the run holds, maps or names as its TMPDIR (a neighbour's
engine, `bench churn` or another test run beside this one), and the runtime
directory's files of a cache whose segment such a process maps. "Outside
the run": its environment lacks the run's mark (RUN_MARK, set at the start
and inherited by every process the run starts; a process started with an
environment of its own making is taken for a neighbour, named, not counted).
tests/conftest.py loads this plugin; a test that runs a nested session loads
it with `-p leftovers`."""

from __future__ import annotations

import contextlib
import os
import stat
import tempfile

import pytest


# The places a run must leave as it found them (#54): what vLLM's killed engines leave there is
# removed by the harness that ends them (shmkv.engines.owned_files); pytest's own
# temporary directories (it keeps the last three runs) and this run's engine-start log are not leftovers
def _watched() -> dict[str, set[str]]:
    from shmkv.paths import runtime_dir_path

    out = {}
    for d in ("/dev/shm", runtime_dir_path(), tempfile.gettempdir()):
        try:
            out[d] = set(os.listdir(d))
        except OSError:
            out[d] = set()
    return out


def _not_a_leftover(directory: str, name: str) -> bool:
    return (directory == tempfile.gettempdir() and name.startswith("pytest-of-")) or \
        os.path.join(directory, name) == os.environ.get("PYTEST_ENGINE_START_LOG")


def _is_socket(path: str) -> bool:
    try:
        return stat.S_ISSOCK(os.lstat(path).st_mode)
    except OSError:
        return False


RUN_MARK = "PYTEST_SHMKV_RUN"  # in the environment of every process the run starts


def _outside_the_run() -> dict[int, list[bytes]]:
    """The live processes whose environment lacks this run's mark (or cannot
    be read: another uid's, then []), with their environment's entries."""
    mark = f"{RUN_MARK}={os.environ.get(RUN_MARK, '')}".encode()
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    env = f.read().split(b"\0")
            except OSError:
                env = None  # gone (it holds nothing then) or another uid's
            if env is None or (env != [b""] and mark not in env):  # a kernel thread's is empty: it holds nothing
                out[int(d)] = env or []
    return out


def _neighbours(new: dict[str, list[str]]) -> set[str]:
    """Those of the new paths that a live process outside the run holds, maps
    or names as TMPDIR, and the runtime directory's files of a cache whose
    segment such a process maps (`<cache>.*`): a neighbour's, not this run's."""
    from shmkv.engines.owned_files import files_held_by
    from shmkv.paths import runtime_dir_path

    held: set[tuple[int, int]] = set()
    tmpdirs: set[bytes] = set()
    for pid, env in _outside_the_run().items():
        held |= files_held_by(pid)
        tmpdirs |= {v[len(b"TMPDIR="):] for v in env if v.startswith(b"TMPDIR=")}
    out: set[str] = set()
    for d, names in new.items():
        for n in names:
            p = os.path.join(d, n)
            with contextlib.suppress(OSError):
                st = os.lstat(p)
                if (st.st_dev, st.st_ino) in held or os.fsencode(p) in tmpdirs:
                    out.add(p)
    caches = set()
    for d, names in _watched().items():  # every segment a neighbour maps, new or not
        for n in names:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(d, n))
                if (st.st_dev, st.st_ino) in held:
                    caches.add(n)
    rd = runtime_dir_path()
    out |= {os.path.join(rd, n) for n in new.get(rd, ()) if any(n.startswith(c + ".") for c in caches)}
    return out


def pytest_sessionstart(session) -> None:
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        from shmkv.paths import runtime_dir_path

        os.environ[RUN_MARK] = os.urandom(8).hex()  # a nested run is a run of its own: the outer one a neighbour
        session.config.stash[_BEFORE] = _watched()
        session.config.stash[_RUNTIME_DIR_EXISTED] = os.path.isdir(runtime_dir_path())
        # before xdist starts its workers (its sessionstart runs last): they inherit the log's path
        fd, path = tempfile.mkstemp(prefix="shmkv-unended-groups-", suffix=".txt")
        os.close(fd)
        os.environ[UNENDED_LOG] = session.config.stash[_UNENDED_LOG] = path


# A process group a harness started and never ended (no close(), say a fixture that forgot one): at
# the session's end each process of the run (each xdist worker) ends it, removes its files, and
# notes where it was made in the controller's log; the controller names them and fails the run
UNENDED_LOG = "SHMKV_TEST_UNENDED_GROUPS_LOG"


def _end_unended_groups() -> None:
    import sys

    from shmkv.engines.owned_files import unremoved

    forks = sys.modules.get("shmkv.engines.forks")
    if forks is not None:  # this process's engine fork servers, and their directories, go before the count
        forks.close_servers()
    for owned in unremoved():
        owned.end()
        with contextlib.suppress(OSError), open(os.environ.get(UNENDED_LOG, os.devnull), "a") as f:
            f.write(f"never ended: {owned.tmpdir}, made at:\n{owned.made_at}\n")


# vLLM's own files of the run's engines (message queues, TP regions, semaphores, gloo stores, IPC
# sockets) are removed by the harness that ends each engine, by ownership (shmkv.engines.owned_files):
# never here by name and time, which removed a neighbour engine's semaphores while it started (#67).
# A file shmkv keeps in the runtime directory on purpose across processes (the weights' digests, so
# an engine does not hash the same checkpoint twice) is a cache: the run removes it if it was not
# there before (a neighbour that wrote to it too hashes its checkpoint once more, nothing breaks).
PRODUCT_MEMOS = ("weights-digests.json",)


def _remove_what_the_run_made(before: dict[str, set[str]], runtime_dir_existed: bool) -> None:
    from shmkv.engines.engine import sweep_weights_boards
    from shmkv.paths import runtime_dir_path

    sweep_weights_boards()  # what the harness does after each engine, once more (shmkv's own sweep)
    d = runtime_dir_path()
    for n in PRODUCT_MEMOS:
        if n not in before.get(d, set()):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(d, n))
    if not runtime_dir_existed:  # the run's engines made it (a fresh host): it goes if they left it empty
        with contextlib.suppress(OSError):
            os.rmdir(d)


def pytest_sessionfinish(session, exitstatus) -> None:
    """Fails the run when it left files in /dev/shm, the runtime directory or
    the temporary directory that were not there when it started, naming
    them (SHMKV_TEST_LEFTOVERS=report: says so without failing). What the
    run's engines left is removed by their harness, by ownership."""
    _end_unended_groups()  # in every process of the run (the workers' engines are theirs)
    before = session.config.stash.get(_BEFORE, None)
    if before is None or os.environ.get("PYTEST_XDIST_WORKER"):
        return
    unended = ""
    with contextlib.suppress(OSError):
        with open(session.config.stash[_UNENDED_LOG]) as f:
            unended = f.read()
        os.unlink(session.config.stash[_UNENDED_LOG])
    if exitstatus == pytest.ExitCode.INTERRUPTED:
        return
    _remove_what_the_run_made(before, session.config.stash.get(_RUNTIME_DIR_EXISTED, True))
    from shmkv.engines.owned_files import VLLM_SHM_PREFIXES, held_by_live_processes

    new = {d: sorted(n for n in names - before.get(d, set()) if not _not_a_leftover(d, n))
           for d, names in _watched().items()}
    # a new file of vLLM's kinds (or a socket) that a live process holds is in use: a neighbour engine's,
    # started while the run ran; named, not counted. shmkv's own files always count (a leaked daemon's too)
    held = held_by_live_processes([os.path.join(d, n) for d, names in new.items() for n in names
                                   if n.startswith(VLLM_SHM_PREFIXES) or _is_socket(os.path.join(d, n))])
    held |= _neighbours(new)
    left = {d: [n for n in names if os.path.join(d, n) not in held] for d, names in new.items()}
    left = {d: names for d, names in left.items() if names}
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    say = reporter.write_line if reporter is not None else (lambda line, **kw: print(line))
    if held:
        say(f"in use by live processes, not this run's to remove: {', '.join(sorted(held)[:20])}"
            f"{' ...' if len(held) > 20 else ''}")
    if unended:
        say(f"ENGINES NEVER ENDED by their harness (ended and removed at the run's end):\n{unended}", red=True)
        if os.environ.get("SHMKV_TEST_LEFTOVERS") != "report":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED
    if left:
        for d, names in left.items():
            say(f"LEFT BEHIND in {d} by this run: {', '.join(names[:20])}{' ...' if len(names) > 20 else ''}",
                red=True)
        if os.environ.get("SHMKV_TEST_LEFTOVERS") != "report":
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


_BEFORE = pytest.StashKey[dict]()
_UNENDED_LOG = pytest.StashKey[str]()
_RUNTIME_DIR_EXISTED = pytest.StashKey[bool]()


