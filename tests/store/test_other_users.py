"""Other users on the host: the segment, the disk tier's files, the runtime
files and the controller's unix socket are usable by their owner only,
whatever the umask; and what another user plants under our names (a segment,
a disk directory) is refused, not used. The other user is `nobody`, reached
with setpriv (needs root; skipped with a reason otherwise)."""

from __future__ import annotations

import glob
import json
import os
import shutil
import stat
import subprocess
import sys
import threading

import pytest
from helpers import AS_ANOTHER_USER, REPO, as_nobody, key

from shmkv import Store
from shmkv.config import load_config
from shmkv.errors import PermissionDeniedError
from shmkv.paths import runtime_dir
from shmkv.services.daemon import EXIT_CANNOT_SERVE, Daemon
from shmkv.tiers.disk.tier import DiskTier

pytestmark = AS_ANOTHER_USER

PROBE = r"""
import errno, json, os, socket, sys
args = json.loads(sys.argv[1])
out = {"uid": os.getuid()}
def attempt(name, fn):
    try:
        fn()
        out[name] = "allowed"
    except PermissionError:
        out[name] = "denied"
    except OSError as e:
        out[name] = errno.errorcode.get(e.errno, str(e.errno))
attempt("segment_open", lambda: os.close(os.open(args["segment"], os.O_RDONLY)))
attempt("disk_file", lambda: open(args["disk_file"], "rb").read())
attempt("disk_dir", lambda: os.listdir(args["disk_dir"]))
attempt("runtime_dir", lambda: os.listdir(args["runtime_dir"]))
def connect():
    s = socket.socket(socket.AF_UNIX)
    try:
        s.connect(args["socket"])
    finally:
        s.close()
attempt("socket", connect)
if args.get("ext_dir"):  # the real attach path, when this interpreter can load the extension
    sys.path.insert(0, args["ext_dir"])
    try:
        import _C
        code, msg, table, _ = _C.open_table(args["cache"], "", 1, 1 << 20, 0, 4096, 0, 0, 256, False)
        out["attach_code"], out["attach_message"] = code, msg
    except ImportError as e:
        out["attach_code"] = "no extension: " + str(e)
print(json.dumps(out))
"""



def ext_dir(workdir: str) -> str:
    """A copy of the extension module that another user can read."""
    d = os.path.join(workdir, "ext")
    os.makedirs(d, mode=0o755)
    for so in glob.glob(os.path.join(REPO, "shmkv", "_C.*.so")):
        shutil.copy(so, d)
        os.chmod(os.path.join(d, os.path.basename(so)), 0o644)
    return d


@pytest.mark.parametrize("umask", [0o000, 0o022])
def test_another_user_can_use_nothing(cache_name, sticky_tmp, umask):
    old = os.umask(umask)
    try:
        cfg = load_config({"cache_name": cache_name, "capacity": "8MiB", "populate": False,
                           "disk_dir": os.path.join(sticky_tmp, "disk"), "listen": f"unix:{sticky_tmp}/ctl.sock"})
        d = Daemon(cfg)
        assert d.lock.try_acquire()
        d.start()
        t = threading.Thread(target=d.serve, daemon=True)
        t.start()
    finally:
        os.umask(old)
    try:
        d.store.put(key(1), b"secret prompt KV" * 100, namespace=b"N" * 16)
        disk = d.role.disk
        assert disk.write(key(1), b"N" * 16, b"secret prompt KV" * 100)
        paths = {"segment": f"/dev/shm/{cache_name}", "disk_file": disk.path(key(1)), "disk_dir": disk.dir,
                 "runtime_dir": runtime_dir().path, "socket": f"{sticky_tmp}/ctl.sock"}
        modes = {k: stat.S_IMODE(os.stat(p).st_mode) for k, p in paths.items()}
        assert modes == {"segment": 0o600, "disk_file": 0o600, "disk_dir": 0o700, "runtime_dir": 0o700,
                         "socket": 0o600}, modes
        for f in os.listdir(runtime_dir().path):
            if f.startswith(cache_name + "."):
                assert stat.S_IMODE(os.stat(runtime_dir().join(f)).st_mode) == 0o600, f

        r = as_nobody(PROBE, json.dumps({**paths, "cache": cache_name, "ext_dir": ext_dir(sticky_tmp)}))
        assert r.returncode == 0, r.stderr
        got = json.loads(r.stdout)
        assert got["uid"] == 65534
        for what in ("segment_open", "disk_file", "disk_dir", "runtime_dir", "socket"):
            assert got[what] == "denied", (what, got)
        if isinstance(got.get("attach_code"), int):  # the extension loaded in nobody's interpreter
            assert got["attach_code"] == 22 and "/dev/shm/" + cache_name in got["attach_message"], got
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()


def test_a_segment_planted_by_another_user_is_refused(cache_name):
    r = as_nobody("import os, sys; fd = os.open('/dev/shm/' + sys.argv[1], os.O_CREAT | os.O_RDWR, 0o666); "
                  "os.fchmod(fd, 0o666); os.ftruncate(fd, 8 << 20)", cache_name)
    assert r.returncode == 0, r.stderr
    try:
        for open_it in (lambda: Store.open_or_create(cache_name, 8 << 20), lambda: Store.attach(cache_name),
                        lambda: Store.create(cache_name, 8 << 20)):
            with pytest.raises(PermissionDeniedError, match="owned by uid 65534"):
                open_it()
    finally:
        os.unlink(f"/dev/shm/{cache_name}")


def test_a_disk_directory_of_another_user_is_refused(sticky_tmp):
    target = os.path.join(sticky_tmp, "planted")
    r = as_nobody("import os, sys; os.mkdir(sys.argv[1], 0o777); os.chmod(sys.argv[1], 0o777)", target)
    assert r.returncode == 0, r.stderr
    with pytest.raises(PermissionError, match="owned by uid 65534"):
        DiskTier(target, capacity_bytes=1 << 20)


ATTACH = r"""
import json, sys
sys.path.insert(0, sys.argv[2])  # the repository (nobody's Python does not run our editable install's finder)
from shmkv import Store
from shmkv.errors import ShmkvError
try:
    Store.attach(sys.argv[1], populate=False)
    print(json.dumps({"attached": True}))
except ShmkvError as e:
    print(json.dumps({"error": type(e).__name__, "message": str(e)}))
"""


@pytest.mark.parametrize("place", ["dev-shm", "segment-dir"])
def test_a_container_of_another_uid_is_told_which_uid_owns_the_cache(cache_name, sticky_tmp, monkeypatch, place):
    """Containers of different uids do not share a cache: the one that
    attaches with another uid gets one line naming the owner's uid, its own,
    and the fix (run it as the owner's uid)."""
    what = f"segment /dev/shm/{cache_name}"
    if place == "segment-dir":
        d = os.path.join(sticky_tmp, "segments")  # nobody may reach the directory, not enter it
        os.mkdir(d, 0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "shmkv-segments", d], check=True)
        monkeypatch.setenv("SHMKV_SEGMENT_DIR", d)
        what = f"segment_dir={d}"
    try:
        with Store.create(cache_name, 8 << 20, populate=False):
            r = as_nobody(ATTACH, cache_name, REPO)
    finally:
        if place == "segment-dir":
            subprocess.run(["umount", "-l", d], check=False)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got.get("error") == "PermissionDeniedError", got
    assert got["message"] == (
        f"{what} is owned by uid 0 with mode 0{'700' if place == 'segment-dir' else '600'} and this process runs as "
        "uid 65534: every process sharing a cache, in every container, runs as the uid that owns it "
        "(docker run --user 0, Kubernetes runAsUser: 0)"), got


def test_a_log_file_planted_by_another_user_is_refused(cache_name, sticky_tmp):
    """--log-file in a shared sticky directory, made first by another user
    as her 0666 file: the daemon refuses it rather than write its log (paths,
    settings) where she reads it and forges lines."""
    planted = os.path.join(sticky_tmp, "shmkv.log")
    r = as_nobody("import os, sys; fd = os.open(sys.argv[1], os.O_CREAT | os.O_WRONLY, 0o666); os.fchmod(fd, 0o666)",
                  planted)
    assert r.returncode == 0, r.stderr
    daemon = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", cache_name, "--capacity", "8MiB",
                             "--listen", "127.0.0.1:0", "--background", "--log-file", planted],
                            capture_output=True, text=True, timeout=120)
    assert daemon.returncode == EXIT_CANNOT_SERVE, (daemon.returncode, daemon.stdout, daemon.stderr)
    assert f"--log-file {planted}: owned by uid 65534" in daemon.stderr, daemon.stderr
    assert os.path.getsize(planted) == 0, "nothing written to her file"
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "refused before anything started"
