"""Cleanup by ownership (shmkv.engines.owned_files): what a killed process
group held in /dev/shm and put in its own temporary directory is removed;
what a neighbour made meanwhile under the same kinds of names stays, and so
does a name that holds another file by the time of the removal."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest

from shmkv.engines.owned_files import OwnedFiles, group_pids, shm_files_of, unremoved

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


# A descendant that left the group (a session of its own), as vLLM's and torch's helper processes may:
# it keeps making the group's temporary directory again, as a cache writer does (makedirs)
STRAY = textwrap.dedent("""
    import os, subprocess, sys, tempfile
    child = subprocess.Popen([sys.executable, "-c",
        "import os, tempfile\\nd = os.path.join(tempfile.gettempdir(), 'cache')\\n"
        "while True:\\n    os.makedirs(d, exist_ok=True)\\n    open(os.path.join(d, 'f'), 'w').close()\\n"],
        start_new_session=True)
    print(child.pid, flush=True)
    sys.stdin.read()
""")


def test_a_descendant_that_left_the_group_is_ended_before_its_directory_goes(owned):
    p = subprocess.Popen([sys.executable, "-c", STRAY], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "TMPDIR": owned.tmpdir}, start_new_session=True)
    stray = int(p.stdout.readline())
    try:
        owned.watch(p.pid)
        assert stray not in group_pids(p.pid), "the descendant left the group"
        kill_group(p)
        owned.remove()
        assert not _alive(stray), "the group's descendant outside it was ended"
        assert not os.path.lexists(owned.tmpdir), "and the directory it wrote to is gone"
    finally:
        with contextlib.suppress(OSError):
            os.kill(stray, signal.SIGKILL)
        shutil.rmtree(owned.tmpdir, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except OSError:
        return False


def test_an_unremoved_owner_is_listed_with_where_it_was_made_until_removed():
    o = OwnedFiles("test")
    try:
        assert o in unremoved()
        assert "test_an_unremoved_owner_is_listed" in o.made_at, o.made_at
    finally:
        o.remove()
    assert o not in unremoved() and not os.path.exists(o.tmpdir)


def test_end_kills_a_group_its_harness_never_ended_and_removes_its_files():
    o = OwnedFiles("test")
    p, (psm, sem, _tmp) = start_maker({"TMPDIR": o.tmpdir})
    o.watch(p.pid)
    o.sample()
    removed = o.end()
    assert p.wait(timeout=30) == -signal.SIGKILL
    assert sorted(removed) == sorted([psm, "sem." + sem]) and not os.path.exists(o.tmpdir)
    assert o not in unremoved()


def test_an_engine_that_fails_to_launch_leaves_no_directory(tmp_path):
    from shmkv.engines.engine import EngineProcess, EngineSpec

    before = set(unremoved())

    def launch(spec_json, env, log_fd):
        assert os.path.isdir(env["TMPDIR"])
        launch.tmpdir = env["TMPDIR"]
        raise OSError("no fork server")

    with pytest.raises(OSError, match="no fork server"):
        EngineProcess(EngineSpec(model_dir=str(tmp_path), in_process=True), str(tmp_path / "engine.log"),
                      launch=launch)
    assert not os.path.exists(launch.tmpdir)
    assert set(unremoved()) == before


def test_the_fork_server_outlives_the_engine_whose_environment_started_it():
    """The fork server started for an engine's environment keeps a temporary
    directory of its own: ending that engine's group (its TMPDIR's users
    too) leaves the server serving the next engine, and nothing the server
    writes makes that engine's directory again."""
    from shmkv.engines import forks as engine_forks

    o = OwnedFiles("test")
    # a server of this test's own (PYTHONPATH is part of a server's key): started by this engine's environment
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), f"/nonexistent-{os.urandom(4).hex()}") if p)
    env = {**os.environ, "TMPDIR": o.tmpdir, "PYTHONPATH": path}
    key = tuple(env.get(k, "") for k in engine_forks.IMPORT_ENV)
    try:
        child = engine_forks.fork_module("json.tool", ["--help"], env)
        server = engine_forks._SERVERS[key]
        with open(f"/proc/{server.proc.pid}/environ", "rb") as f:
            server_env = dict(v.split(b"=", 1) for v in f.read().split(b"\0") if b"=" in v)
        # NOTE: what the server writes to its temporary directory (torch's inductor cache) would make
        # the engine's again once it was removed: the directory a run found left behind (CI, stop 74)
        assert server_env[b"TMPDIR"] != os.fsencode(o.tmpdir), "the server has a temporary directory of its own"
        o.watch(child.pid)
        assert child.wait(timeout=60) == 0
        o.remove()
        assert server.proc.poll() is None, "the fork server was ended with the engine"
        assert engine_forks.fork_module("json.tool", ["--help"], env).wait(timeout=60) == 0
    finally:
        o.remove()
        with engine_forks._SERVERS_LOCK:
            server = engine_forks._SERVERS.pop(key, None)
        if server is not None:
            server.close()


def test_a_fork_server_that_fails_to_start_leaves_no_directory(tmp_path, monkeypatch):
    from shmkv.engines import forks as engine_forks

    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "vllm.py").write_text("raise ImportError('no vLLM here')\n")  # the server's import fails
    private_tmp = tmp_path / "tmp"
    private_tmp.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(private_tmp))
    with pytest.raises(RuntimeError, match="did not start"):
        engine_forks.ForkServer({**os.environ, "PYTHONPATH": str(broken)})
    assert os.listdir(private_tmp) == []
