"""The daemon as operators run it (scripts/start_shm_daemon.sh): one per
cache, clean exit on SIGTERM/SIGINT leaving the segment, restart under a
process that keeps putting and getting, the maintainer role handed over by
an embedded maintainer, --background, and bad settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import REPO, http, key, payload_for

from shmkv import Store

pytestmark = pytest.mark.slow


def wait_for(pred, timeout=30.0, what="condition"):
    """Poll a condition another process must bring about (no fixed sleeps)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_second_daemon_refuses_naming_the_first(daemon, cache_name):
    first = daemon(cache_name, "--capacity", "16MiB", "--listen", "127.0.0.1:0")
    second = daemon(cache_name, "--capacity", "16MiB", "--listen", "127.0.0.1:0", ready=False)
    assert second.proc.wait(timeout=60) == 3
    err = open(second.log_path).read()
    assert f"another daemon (pid {first.proc.pid})" in err and cache_name in err
    st, body = http(first.url, "GET", "/health")
    assert st == 200 and body["pid"] == first.proc.pid, "the first one is undisturbed"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_exits_cleanly_and_leaves_the_segment(daemon, cache_name, tmp_path, sig):
    sock = tmp_path / "ctl.sock"
    d = daemon(cache_name, "--capacity", "16MiB", "--listen", f"unix:{sock}")
    with Store.attach(cache_name) as s:
        s.put(key(1), payload_for(key(1), 5000))
        d.proc.send_signal(sig)
        assert d.proc.wait(timeout=30) == 0
        assert "the segment stays (1 other processes attached)" in open(d.log_path).read()
        assert not sock.exists()
        assert s.get(key(1)) == payload_for(key(1), 5000), "attached processes keep working"
    again = daemon(cache_name, "--capacity", "16MiB", "--listen", f"unix:{sock}")
    st, body = http(again.url, "GET", "/stats")
    assert st == 200 and body["shm"]["entries"] == 1, "the next daemon adopts the segment with its chunks"


WORKER = """
import collections, os, random, sys, json
sys.path.insert(0, {repo!r} + "/tests/support")
from helpers import key, payload_for
from shmkv import Store, PutResult
s = Store.open_or_create({cache!r}, 256 << 20, populate=False)
rng = random.Random(7)
# a sliding window of at most 4000 live chunks (well inside the segment): past
# it, the oldest is deleted before each new put, so puts never stop and
# nothing is evicted; whatever the window holds must be readable, exactly
committed = collections.OrderedDict()
missing = bad = i = 0
print("started", flush=True)
while not os.path.exists({stop!r}):
    if len(committed) >= 4000:
        old, _ = committed.popitem(last=False)
        assert s.delete(key(old))
    k = key(i)
    n = 100 + rng.randrange(3000)
    assert s.put(k, payload_for(k, n)) is PutResult.OK
    committed[i] = n
    j = rng.choice(list(committed)) if i % 64 == 0 else i
    got = s.get(key(j))
    missing += got is None
    bad += got is not None and got != payload_for(key(j), committed[j])
    i += 1
    if i == 50:
        print("warm", flush=True)
print(json.dumps({{"committed": list(committed.items()), "missing": missing, "bad": bad, "puts": i}}), flush=True)
"""


def test_restart_while_a_process_puts_and_gets(daemon, cache_name, tmp_path, child):
    stop = tmp_path / "stop"
    args = ("--capacity", "256MiB", "--listen", "127.0.0.1:0", "--disk-dir", str(tmp_path / "disk"))
    d = daemon(cache_name, *args)
    w = child(WORKER.format(repo=REPO, cache=cache_name, stop=str(stop)))
    w.expect("started")
    w.expect("warm")
    for _ in range(2):  # stop and start the daemon twice under load
        assert d.stop() == 0
        d = daemon(cache_name, *args)
        st, body = http(d.url, "GET", "/health")
        assert st == 200
    stop.write_text("")
    result = json.loads(w.finish().strip().splitlines()[-1])
    assert result["bad"] == 0 and result["missing"] == 0 and result["puts"] > 4000
    with Store.attach(cache_name) as s:
        assert s.check_consistency() == []
        for i, n in result["committed"]:
            assert s.get(key(i)) == payload_for(key(i), n), f"chunk {i} lost or damaged"
    assert d.stop() == 0


def test_embedded_maintainer_hands_the_role_over(daemon, cache_name, child):
    embedded = child(f"""
        import logging, sys, time
        logging.basicConfig(level=logging.WARNING, stream=sys.stdout)
        logging.getLogger("shmkv.maintainer").setLevel(logging.INFO)  # the role's own lines, in order
        from shmkv import Store
        from shmkv.config import load_config
        from shmkv.services.maintainer import MaintainerRole
        from shmkv.tiers import TierChain
        cfg = load_config({{"cache_name": {cache_name!r}}})
        s = Store.open_or_create(cfg.cache_name, 16 << 20, populate=False)
        role = MaintainerRole(cfg, TierChain(s), standby_s=0.2)
        print("started", flush=True)
        role.start()
        sys.stdin.readline()
    """)
    embedded.expect("started")
    embedded.expect("INFO:shmkv.maintainer:shmkv: this process")
    d = daemon(cache_name, "--capacity", "16MiB", "--listen", "127.0.0.1:0")
    wait_for(lambda: http(d.url, "GET", "/health")[1]["maintainer"], what="the daemon to hold the role")
    embedded.expect("INFO:shmkv.maintainer:shmkv: the daemon")  # "... runs: handing it the maintainer role"
    assert d.stop() == 0
    embedded.expect("INFO:shmkv.maintainer:shmkv: this process")  # takes the role back
    embedded.proc.stdin.write("\n")
    embedded.proc.stdin.flush()
    embedded.finish()


def test_background_mode(cache_name, tmp_path):
    log = tmp_path / "daemon.log"
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", cache_name, "--capacity", "16MiB",
                        "--listen", "127.0.0.1:0", "--background", "--log-file", str(log)],
                       capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr
    pid = int(r.stdout.split("pid ")[1].split(",")[0])
    try:
        url = r.stdout.strip().rsplit(" ", 1)[-1]
        st, body = http(url, "GET", "/health")
        assert st == 200 and body["pid"] == pid
        assert oct(os.stat(log).st_mode & 0o777) == "0o600"
    finally:
        os.kill(pid, signal.SIGTERM)
    wait_for(lambda: not os.path.exists(f"/proc/{pid}") or open(f"/proc/{pid}/stat").read().split()[2] == "Z",
             what="the daemon to exit")


@pytest.mark.parametrize("args,words", [
    (["--capacity", "lots"], "capacity='lots'"),
    (["--listen", "0.0.0.0:7470"], "loopback only"),
    (["--listen", "unix:relative.sock"], "absolute path"),
    (["--config", "/nonexistent/shmkv.yaml"], "cannot read it"),
])
def test_bad_settings_stop_start_up_with_a_message(cache_name, args, words):
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", cache_name, *args],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and words in r.stderr, r.stderr


def test_port_in_use_is_reported(daemon, cache_name):
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        d = daemon(cache_name, "--capacity", "16MiB", "--listen", f"127.0.0.1:{port}", ready=False)
        assert d.proc.wait(timeout=60) == 4
        log = open(d.log_path).read()
        assert "cannot start" in log
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "the refused start removed the segment it had created"
    assert "which this refused start had created" in log


def test_a_nul_in_listen_is_refused_before_any_segment(cache_name, tmp_path):
    cfg = tmp_path / "shmkv.yaml"
    cfg.write_text('listen: "unix:/tmp/a\\0b"\n')  # YAML's \0 escape: a NUL in the path
    os.chmod(cfg, 0o600)
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", cache_name, "--config", str(cfg)],
                       capture_output=True, text=True, cwd=REPO, timeout=60)
    assert r.returncode == 2 and "NUL" in r.stderr and "Traceback" not in r.stderr, r.stderr
    assert not os.path.exists(f"/dev/shm/{cache_name}")
