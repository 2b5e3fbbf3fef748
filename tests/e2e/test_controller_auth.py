"""Who may use the controller: on TCP every endpoint but /health needs the
daemon's token, a foreign Host or Origin is refused whatever the token, and
nothing a refused request asks for happens; the token file is the daemon's
own (0600, kept across restarts, refused when others could write or read
it); a unix socket checks its peer's uid; and clients that hold connections
open or half-sent cannot keep /health from answering."""

from __future__ import annotations

import json
import os
import socket
import stat
import threading

import pytest
from helpers import AS_ANOTHER_USER, CONTROLLER_TOKENS, as_nobody, http, payload_for

from shmkv.config import load_config
from shmkv.errors import PermissionDeniedError
from shmkv.services.controller_auth import read_token, token_path
from shmkv.services.daemon import Daemon

NS = b"N" * 16


def start(cfg) -> tuple[Daemon, threading.Thread]:
    d = Daemon(cfg)
    assert d.lock.try_acquire()
    d.start()
    CONTROLLER_TOKENS[d.url] = d.token
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    return d, t


def stop(d: Daemon, t: threading.Thread) -> None:
    d.request_stop()
    t.join(timeout=30)
    d.close()


def config(cache_name, **kw):
    return load_config({"cache_name": cache_name, "capacity": "8MiB", "populate": False, "listen": "127.0.0.1:0",
                        **kw}, env={})


@pytest.fixture
def served(cache_name):
    d, t = start(config(cache_name))
    for i in range(4):
        k = bytes([i]) * 16
        d.store.put(k, payload_for(k, 4096), namespace=NS)
    yield d
    stop(d, t)


def test_every_endpoint_but_health_needs_the_token(served):
    routes = served.server.controller.routes
    assert set(routes) > {"/health", "/clear", "/lookup", "/metrics"}
    for path, (method, _model, _fn) in routes.items():
        st, body = http(served.url, method, path, {} if method == "POST" else None, token=False)
        if path == "/health":
            assert st == 200, body
        else:
            assert st == 401 and "Bearer" in body["error"], (path, st, body)
        st, body = http(served.url, method, path, {} if method == "POST" else None,
                        headers={"Authorization": "Bearer " + "x" * 43})
        assert st == (200 if path == "/health" else 401), (path, st, body)
    assert served.store.stats()["entries"] == 4, "no refused request removed anything"
    st, body = http(served.url, "GET", "/stats")
    assert st == 200 and body["controller"]["refused_requests"] >= 2 * (len(routes) - 1)


@pytest.mark.parametrize("headers", [
    {"Host": "evil.example:80"},  # DNS rebinding: the page's own name
    {"Origin": "http://evil.example"},  # a cross-site fetch or form
    {"Origin": "null"},
])
def test_a_foreign_host_or_origin_is_refused_even_with_the_token(served, headers):
    st, body = http(served.url, "POST", "/clear", {}, headers={
        "Authorization": f"Bearer {served.token}", **headers})
    assert st == 403, body
    assert served.store.stats()["entries"] == 4


def test_a_cross_site_form_post_changes_nothing(served):
    """What a web page can send without a preflight: text/plain, no token."""
    st, _ = http(served.url, "POST", "/clear", raw=b'{"x": 1}', token=False,
                 headers={"Content-Type": "text/plain", "Origin": "http://evil.example"})
    assert st == 403
    st, _ = http(served.url, "POST", "/clear", raw=b"{}", token=False, headers={"Content-Type": "text/plain"})
    assert st == 401
    assert served.store.stats()["entries"] == 4


def test_local_origin_and_the_token_work(served):
    port = served.url.rsplit(":", 1)[1]
    st, body = http(served.url, "POST", "/clear", {}, headers={"Origin": f"http://localhost:{port}"})
    assert st == 200 and body["removed"]["shm"] == 4


def test_the_token_file_is_private_and_kept_across_restarts(cache_name):
    cfg = config(cache_name)
    d, t = start(cfg)
    first = d.token
    path = token_path(cfg)
    st = os.stat(path)
    assert stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
    assert read_token(cfg) == first and len(first) >= 32
    stop(d, t)
    d, t = start(cfg)
    try:
        assert d.token == first, "clients keep working after a restart"
        assert http(d.url, "GET", "/stats")[0] == 200
    finally:
        stop(d, t)
    log_text = open(path).read()
    assert first in log_text  # the file holds it; the log never does (below)


def test_the_token_is_never_logged(cache_name, caplog):
    caplog.set_level("DEBUG")
    d, t = start(config(cache_name))
    try:
        http(d.url, "GET", "/stats", headers={"Authorization": "Bearer wrong"})
        http(d.url, "GET", "/stats")
    finally:
        stop(d, t)
    assert d.token not in caplog.text


@pytest.mark.parametrize("mode", [0o644, 0o620])
def test_a_token_file_others_could_read_or_write_is_refused(cache_name, tmp_path, mode):
    path = tmp_path / "token"
    path.write_text("t" * 43 + "\n")
    os.chmod(path, mode)
    cfg = config(cache_name, controller_token_file=str(path))
    with pytest.raises(PermissionDeniedError, match=f"{path}.*mode 0{mode:o}"):
        Daemon(cfg).start()
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "refused before the segment exists"


def test_metrics_can_be_opened_to_scrapers(cache_name):
    d, t = start(config(cache_name, controller_open_metrics=True))
    try:
        st, text = http(d.url, "GET", "/metrics", token=False)
        assert st == 200 and "shmkv_" in text
        assert http(d.url, "GET", "/stats", token=False)[0] == 401
    finally:
        stop(d, t)


def test_health_answers_while_300_partial_requests_are_held(served):
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    held = []
    try:
        for _ in range(300):
            s = socket.create_connection((host, int(port)), timeout=5)
            s.sendall(b"POST /clear HTTP/1.1\r\nHost: " + host.encode())  # never finished
            held.append(s)
        for _ in range(3):
            with socket.create_connection((host, int(port)), timeout=1) as s:  # a 1 s client timeout
                s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
                assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in held:
            s.close()
    assert served.store.stats()["entries"] == 4


def test_lookup_obeys_the_configs_chunk_size_bounds(served):
    st, body = http(served.url, "POST", "/lookup", {"tokens": [1] * 64, "namespace": NS.hex(), "chunk_size": 1})
    assert st == 400 and "chunk_size" in body["error"]


# ------------------------------------------------------------ other users --
CLIENT = r"""
import http.client, json, sys
host, port, path = sys.argv[1], int(sys.argv[2]), sys.argv[3]
c = http.client.HTTPConnection(host, port, timeout=10)
c.request("POST", path, body=b"{}", headers={"Content-Type": "application/json"})
r = c.getresponse()
out = {"status": r.status}
try:
    open(sys.argv[4]).read()
    out["token_file"] = "read"
except PermissionError:
    out["token_file"] = "denied"
print(json.dumps(out))
"""


@AS_ANOTHER_USER
def test_another_user_cannot_clear_or_read_the_token(served):
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    r = as_nobody(CLIENT, host, port, "/clear", token_path(served.cfg))
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == {"status": 401, "token_file": "denied"}, got
    assert served.store.stats()["entries"] == 4


UNIX_CLIENT = r"""
import json, socket, sys
s = socket.socket(socket.AF_UNIX)
s.settimeout(10)
s.connect(sys.argv[1])
try:
    s.sendall(b"GET /stats HTTP/1.1\r\nHost: x\r\n\r\n")
    reply = s.recv(100).decode(errors="replace")
except OSError:  # the server closed the connection at once
    reply = ""
print(json.dumps({"reply": reply}))
"""


@AS_ANOTHER_USER
@pytest.mark.parametrize("allowed", [False, True])
def test_a_unix_socket_checks_its_peers_uid(cache_name, sticky_tmp, allowed):
    sock = os.path.join(sticky_tmp, "ctl.sock")
    d, t = start(config(cache_name, listen=f"unix:{sock}", controller_allow_uids="65534" if allowed else ""))
    try:
        os.chmod(sock, 0o666)  # as if its directory and mode let anyone in: the peer check still holds
        r = as_nobody(UNIX_CLIENT, sock)
        assert r.returncode == 0, r.stderr
        reply = json.loads(r.stdout)["reply"]
        assert reply.startswith("HTTP/1.1 200") if allowed else reply == "", reply
    finally:
        stop(d, t)


HOLDER = r"""
import json, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
conns = []
for _ in range(40):
    s = socket.create_connection((host, port), timeout=10)
    s.sendall(b"POST /clear HTTP/1.1\r\nHo")  # a head that never ends
    conns.append(s)
def closed(s):
    try:
        return s.recv(1) == b""
    except (socket.timeout, TimeoutError):
        return False
    except OSError:
        return True
import select
still, deadline = list(conns), time.monotonic() + 1.0  # what the server closes within 1 s (its cap)
while still and (left := deadline - time.monotonic()) > 0:
    for s in select.select(still, [], [], left)[0]:
        if closed(s):
            still.remove(s)
open_now = len(still)
t0 = time.monotonic()
for s in conns:
    s.settimeout(5)  # another uid gets 2 s for a head (everyone else 10 s)
all_closed = all(closed(s) for s in conns)
print(json.dumps({"open": open_now, "all_closed": all_closed, "s": round(time.monotonic() - t0, 2)}))
"""


@AS_ANOTHER_USER
def test_another_uid_holds_few_connections_for_a_short_time(served):
    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    r = as_nobody(HOLDER, host, port)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got["open"] <= 16, got  # MAX_FOREIGN_CONNECTIONS
    assert got["all_closed"], got  # each within the 2 s head deadline of another uid
    assert http(served.url, "GET", "/health")[0] == 200
