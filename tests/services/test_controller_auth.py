"""Who may use the controller: on TCP every endpoint but /health needs the
daemon's token, a foreign Host or Origin is refused whatever the token, and
nothing a refused request asks for happens; the token file is the daemon's
own (0600, new at every start, refused when others could write or read it
or when it is not a regular file); a unix socket checks its peer's uid; and clients that hold connections
open or half-sent cannot keep /health from answering."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys

import pytest
from helpers import AS_ANOTHER_USER, as_nobody, http, payload_for, serve_in_process, stop_in_process

from shmkv.config import load_config
from shmkv.errors import PermissionDeniedError
from shmkv.services.controller_auth import read_token, token_path
from shmkv.services.daemon import EXIT_CANNOT_SERVE, AlreadyServedError, Daemon

NS = b"N" * 16


start, stop = serve_in_process, stop_in_process


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


def test_the_token_file_is_private_and_new_at_every_start(cache_name):
    """A token captured in one run (sent to a squatter while the daemon was
    down, read from a command line) opens nothing after a restart."""
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
        assert d.token != first and read_token(cfg) == d.token, "a new token, in the file clients read"
        old = {"Authorization": f"Bearer {first}"}
        assert http(d.url, "GET", "/stats", headers=old, token=False)[0] == 401, "the last run's token is refused"
        assert http(d.url, "GET", "/stats")[0] == 200
    finally:
        stop(d, t)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    assert [f for f in os.listdir(os.path.dirname(path)) if f.endswith(".new")] == [], "no rotation left behind"


def test_a_second_daemon_that_cannot_serve_leaves_the_token_of_the_first(cache_name):
    cfg = config(cache_name)
    d, t = start(cfg)
    try:
        other = Daemon(cfg)  # as from another container: the runtime lock is not shared, the segment's role is
        with pytest.raises(AlreadyServedError):
            other.start()
        assert read_token(cfg) == d.token and http(d.url, "GET", "/stats")[0] == 200
    finally:
        stop(d, t)


def test_a_fifo_at_the_token_path_is_refused_at_once_and_no_segment_is_left(cache_name, tmp_path):
    path = tmp_path / "token"
    os.mkfifo(path, 0o600)
    r = subprocess.run([sys.executable, "-m", "shmkv.daemon", "--cache", cache_name, "--listen", "127.0.0.1:0"],
                       env={**os.environ, "SHMKV_CONTROLLER_TOKEN_FILE": str(path), "SHMKV_CAPACITY": "8MiB"},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == EXIT_CANNOT_SERVE, (r.returncode, r.stderr)
    assert f"controller token file {path}" in r.stderr and "regular file" in r.stderr, r.stderr
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "refused before the segment exists"


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


def test_a_token_file_in_a_directory_others_can_change_is_refused(cache_name, tmp_path):
    """Whoever can change the token's directory can remove or replace the
    token: the daemon refuses to start there, and a client to read it."""
    shared = tmp_path / "shared"
    shared.mkdir()
    os.chmod(shared, 0o777)  # writable by everyone, not sticky
    cfg = config(cache_name, controller_token_file=str(shared / "token"))
    with pytest.raises(PermissionDeniedError,
                       match=f"controller token file {shared / 'token'}: .*mode 0777; shmkv only uses directories"):
        Daemon(cfg).start()
    assert not os.path.exists(f"/dev/shm/{cache_name}"), "refused before the segment exists"
    with pytest.raises(PermissionDeniedError, match="controller token file"):
        read_token(cfg)
    os.chmod(shared, 0o1777)  # sticky, as /tmp: nobody else can remove or replace our file
    d, t = start(cfg)
    try:
        assert read_token(cfg) == d.token
    finally:
        stop(d, t)


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
    fields = {"model_id": "m", "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 64,
              "chunk_size": 1, "payload": "tokens"}  # inside a namespace object too
    st, body = http(served.url, "POST", "/lookup", {"tokens": [1] * 64, "namespace": fields})
    assert st == 400 and "chunk_size" in body["error"], body


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
        # allowed uids can connect by the daemon's own choice of mode (0666, every peer's uid checked);
        # otherwise it is 0600, and opened by hand here the peer check still holds
        assert stat.S_IMODE(os.stat(sock).st_mode) == (0o666 if allowed else 0o600)
        if not allowed:
            os.chmod(sock, 0o666)
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


# ------------------------------------------- the client checks the server --
SQUATTER = r"""
import socket, sys
family = socket.AF_UNIX if sys.argv[1].startswith("/") else (socket.AF_INET6 if ":" in sys.argv[1] else socket.AF_INET)
srv = socket.socket(family)
srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(sys.argv[1] if family == socket.AF_UNIX else (sys.argv[1], int(sys.argv[2])))
srv.listen(4)
print("listening", flush=True)
srv.settimeout(30)
got = b""
try:
    c, _ = srv.accept()
    c.settimeout(3)
    try:
        while chunk := c.recv(4096):
            got += chunk
            if b"\r\n\r\n" in got:
                c.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 15\r\n\r\n"
                          b'{"forged": true}'[:15])
                break
    except OSError:
        pass
except OSError:
    pass
print("got", got.hex(), flush=True)
"""


def squatter(*where: str) -> subprocess.Popen:
    """Another uid (nobody) listening where our daemon would; it prints what it received."""
    from helpers import NOBODY, SETPRIV

    p = subprocess.Popen([SETPRIV, *NOBODY, sys.executable, "-c", SQUATTER, *where], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, cwd="/")
    assert p.stdout.readline().strip() == "listening", p.stderr.read()
    return p


def ctl(cfg_file: str, hosts: str | None = None) -> subprocess.CompletedProcess:
    """`shmkv ctl GET /stats`; `hosts`: an /etc/hosts of its own (a mount namespace) for its name lookups."""
    prefix = ["unshare", "--mount", "sh", "-c", f'mount --bind {hosts} /etc/hosts && exec "$@"', "sh"] if hosts else []
    return subprocess.run([*prefix, sys.executable, "-m", "shmkv.cli", "ctl", "--config", cfg_file,
                           "GET", "/stats"], capture_output=True, text=True, timeout=60)


def ctl_config(tmp_path, cache_name, listen: str) -> str:
    """A client's settings, with a token file of ours (as a daemon of an earlier run left it)."""
    token = tmp_path / "token"
    token.write_text("T" * 43 + "\n")
    os.chmod(token, 0o600)
    path = tmp_path / "ctl.yaml"
    path.write_text(f"cache_name: {cache_name}\nlisten: {listen}\ncontroller_token_file: {token}\n")
    return str(path)


@AS_ANOTHER_USER
def test_the_token_is_not_sent_to_another_users_listener_on_the_daemons_port(cache_name, tmp_path):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    sq = squatter("127.0.0.1", str(port))  # the daemon is down; another uid took its port
    r = ctl(ctl_config(tmp_path, cache_name, f"127.0.0.1:{port}"))
    sq.kill()
    got = sq.communicate()[0]
    assert r.returncode == 2 and "belongs to uid 65534" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert "forged" not in r.stdout and b"Bearer".hex() not in got and (b"T" * 8).hex() not in got, got


@AS_ANOTHER_USER
def test_localhost_reaches_the_address_the_daemon_bound_not_another_users_ipv6_listener(cache_name, tmp_path):
    if not socket.has_ipv6:
        pytest.skip("no IPv6 on this host")
    d, t = start(config(cache_name, listen="localhost:0"))
    try:
        port = d.url.rsplit(":", 1)[1]
        assert d.url == f"http://127.0.0.1:{port}", "localhost is bound as its IPv4 address"
        sq = squatter("::1", port)
        cfg_file = tmp_path / "ctl.yaml"
        cfg_file.write_text(f"cache_name: {cache_name}\nlisten: localhost:{port}\n")
        hosts = tmp_path / "hosts"  # Debian's stock /etc/hosts: localhost is ::1 too, and tried first
        hosts.write_text("::1 localhost ip6-localhost ip6-loopback\n127.0.0.1 localhost\n")
        r = ctl(str(cfg_file), hosts=str(hosts))
        sq.kill()
        got = sq.communicate()[0]
        assert r.returncode == 0 and "processes_attached" in r.stdout, (r.returncode, r.stderr)
        assert got.strip() in ("", "got"), f"nothing went to [::1]: {got}"  # killed while it waited, or empty
    finally:
        stop(d, t)


@AS_ANOTHER_USER
def test_a_unix_socket_planted_by_another_user_gets_nothing(cache_name, tmp_path, sticky_tmp):
    path = os.path.join(sticky_tmp, "ctl.sock")
    sq = squatter(path)
    r = ctl(ctl_config(tmp_path, cache_name, f"unix:{path}"))
    sq.kill()
    sq.communicate()
    assert r.returncode == 2 and "belongs to uid 65534" in r.stderr, (r.returncode, r.stdout, r.stderr)
    assert "forged" not in r.stdout


# --------------------------------------------- bodies nobody authenticated --
FLOOD = r"""
import json, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
conns = []
for _ in range(n):
    s = socket.create_connection((host, port), timeout=5)
    # an open path, a body declared 16 MiB long and trickled: the server must not wait for it
    s.sendall(f"POST /health HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 16777216\r\n\r\n".encode() + b"x")
    conns.append(s)
answers = []
for s in conns:
    s.settimeout(5)
    try:
        answers.append(s.recv(64).decode(errors="replace").split("\r\n")[0])
    except OSError as e:
        answers.append(type(e).__name__)
print(json.dumps(answers))
"""


@AS_ANOTHER_USER
def test_bodies_nobody_authenticated_are_refused_from_their_heads(served):
    """Four other uids (what one user's subuid range gives) each send 16
    requests to the open path with a large body they never finish: each is
    refused from its head (no body read, buffered or waited for), and the
    owner's /stats and /health answer meanwhile."""
    from helpers import SETPRIV

    host, port = served.url.removeprefix("http://").rsplit(":", 1)
    floods = [subprocess.Popen([SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                                FLOOD, host, port, "16"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               cwd="/") for uid in range(200001, 200005)]
    try:
        assert http(served.url, "GET", "/health")[0] == 200
        assert http(served.url, "GET", "/stats")[0] == 200
    finally:
        outs = [f.communicate(timeout=60) for f in floods]
    for out, err in outs:
        answers = json.loads(out or "null")
        assert answers == ["HTTP/1.1 405 Method Not Allowed"] * 16, (answers, err)
