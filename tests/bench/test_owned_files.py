"""Cleanup by ownership (shmkv.bench.owned_files): what a killed process
group held in /dev/shm and put in its own temporary directory is removed;
what a neighbour made meanwhile under the same kinds of names stays, and so
does a name that holds another file by the time of the removal."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from shmkv.bench.owned_files import OwnedFiles, group_pids, shm_files_of

# A process that makes what vLLM's processes make: a message queue (psm_*), a named semaphore that a
# spawned child must open by name (sem.mp-*), a file in the temporary directory; then says their names.
MAKER = textwrap.dedent("""
    import multiprocessing as mp, os, sys, tempfile
    from multiprocessing import shared_memory
    shm = shared_memory.SharedMemory(create=True, size=4096)
    lock = mp.get_context("spawn").Lock()
    tmp = os.path.join(tempfile.gettempdir(), "vllm_dist_" + os.urandom(8).hex())
    open(tmp, "w").close()
    print(shm.name, lock._semlock.name.lstrip("/"), tmp, flush=True)
    sys.stdin.read()
""")


def start_maker(env: dict[str, str] | None = None) -> tuple[subprocess.Popen, list[str]]:
    p = subprocess.Popen([sys.executable, "-c", MAKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, **(env or {})}, start_new_session=True)
    names = p.stdout.readline().split()
    assert len(names) == 3, names
    return p, names


def kill_group(p: subprocess.Popen) -> None:
    os.killpg(p.pid, signal.SIGKILL)
    p.wait()


@pytest.fixture
def owned():
    """An OwnedFiles of the test's; what it recorded is gone after the test, passed or failed."""
    o = OwnedFiles("test")
    yield o
    o.remove()
    for name in o.shm:
        if os.path.exists(f"/dev/shm/{name}"):
            os.unlink(f"/dev/shm/{name}")


def test_a_killed_groups_files_go_and_a_neighbours_stay(owned):
    ours, (psm, sem, tmp) = start_maker({"TMPDIR": owned.tmpdir})
    owned.watch(ours.pid)
    assert os.path.dirname(tmp) == owned.tmpdir, "the group's temporary files are in its own directory"
    neighbour, (n_psm, n_sem, n_tmp) = start_maker()  # a neighbour's, made while ours runs
    try:
        owned.sample()
        assert {psm, "sem." + sem} <= set(owned.shm), owned.shm
        assert n_psm not in owned.shm and "sem." + n_sem not in owned.shm
        kill_group(ours)  # no teardown: its files stay behind
        assert os.path.exists(f"/dev/shm/{psm}") and os.path.exists(f"/dev/shm/sem.{sem}")
        removed = owned.remove()
        assert sorted(removed) == sorted([psm, "sem." + sem])
        assert not os.path.exists(f"/dev/shm/{psm}") and not os.path.exists(f"/dev/shm/sem.{sem}")
        assert not os.path.exists(owned.tmpdir)
        for name in (n_psm, "sem." + n_sem):
            assert os.path.exists(f"/dev/shm/{name}"), f"the neighbour's {name} was removed"
        assert os.path.exists(n_tmp)
    finally:
        kill_group(neighbour)
        for name in (n_psm, "sem." + n_sem):
            if os.path.exists(f"/dev/shm/{name}"):
                os.unlink(f"/dev/shm/{name}")
        os.unlink(n_tmp)


def test_a_name_that_holds_another_file_now_is_kept(owned):
    ours, (psm, _sem, _tmp) = start_maker({"TMPDIR": owned.tmpdir})
    owned.watch(ours.pid)
    kill_group(ours)
    path = f"/dev/shm/{psm}"
    os.unlink(path)  # its owner's name, unlinked and made again by someone else
    with open(path, "wb") as f:
        f.write(b"someone else's")
    try:
        removed = owned.remove()
        assert psm not in removed and os.path.exists(path), "another file under the name is not ours"
    finally:
        os.unlink(path)


def test_a_file_a_live_process_still_holds_is_kept(owned):
    ours, (psm, sem, _tmp) = start_maker({"TMPDIR": owned.tmpdir})
    owned.watch(ours.pid)
    holder = subprocess.Popen([sys.executable, "-c", f"import mmap,os,sys; fd=os.open('/dev/shm/{psm}', os.O_RDWR);"
                               "m=mmap.mmap(fd, 4096); print('held', flush=True); sys.stdin.read()"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        kill_group(ours)
        assert owned.shm[psm] in shm_files_of(holder.pid)
        removed = owned.remove()
        assert psm not in removed and os.path.exists(f"/dev/shm/{psm}")
        assert "sem." + sem in removed
    finally:
        holder.kill()
        holder.wait()


def test_group_pids_finds_a_groups_children():
    p = subprocess.Popen([sys.executable, "-c", "import subprocess,sys; c=subprocess.Popen(['sleep','60']);"
                          "print(c.pid, flush=True); sys.stdin.read()"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        child = int(p.stdout.readline())
        assert sorted(group_pids(p.pid)) == sorted([p.pid, child])
        assert os.getpid() not in group_pids(p.pid)
    finally:
        kill_group(p)
