"""Clients that pipeline or do not read cannot hold the controller: another
uid gets one answer per connection (what it pipelined behind that is never
parsed) and a budget of connections a second, over which its connections
close unanswered (counted); an answer nobody reads aborts its connection
after the write deadline (counted); the owner is answered meanwhile."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import pytest
from helpers import AS_ANOTHER_USER, SETPRIV, http, serve_in_process, stop_in_process, wait_until

import shmkv.services.controller_http as transport
from shmkv.bench.controller_bench import PIPELINER
from shmkv.config import load_config


@pytest.fixture
def served(cache_name):
    d, t = serve_in_process(load_config({"cache_name": cache_name, "capacity": "8MiB", "populate": False,
                                         "listen": "127.0.0.1:0"}, env={}))
    yield d
    stop_in_process(d, t)


def as_uid(uid: int, code: str, *args: str, timeout: float = 60) -> subprocess.Popen:
    return subprocess.Popen([SETPRIV, f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable, "-c",
                             code, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")


ONE_CONNECTION = r"""
import json, socket, sys
host, port = sys.argv[1], int(sys.argv[2])
s = socket.create_connection((host, port), timeout=10)
s.sendall(f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode() * 50)
got = b""
try:
    while chunk := s.recv(65536):
        got += chunk
    closed = True
except (socket.timeout, TimeoutError):
    closed = False
print(json.dumps({"answers": got.count(b"HTTP/1.1 200"), "closed": closed,
                  "says_close": b"connection: close" in got.lower()}))
"""


@AS_ANOTHER_USER
def test_another_uid_gets_one_answer_per_connection(served):
    p = as_uid(200101, ONE_CONNECTION, *map(str, served.addr))
    out, err = p.communicate(timeout=60)
    got = json.loads(out or "null")
    assert got == {"answers": 1, "closed": True, "says_close": True}, (got, err)


@AS_ANOTHER_USER
def test_uids_pipelining_get_their_budget_and_the_owner_is_answered(served):
    """Four other uids each keep 8 connections pipelining /health for 3 s:
    each gets at most its budget of answers (one per connection, FOREIGN_BURST
    at once and FOREIGN_RATE a second), the connections over it are closed
    unanswered and counted, and the owner's /stats and /health answer."""
    attackers = [as_uid(uid, PIPELINER, *map(str, served.addr), "3", "8") for uid in range(200111, 200115)]
    try:
        owner = [http(served.url, "GET", "/stats")[0], http(served.url, "GET", "/health")[0]]
    finally:
        outs = [a.communicate(timeout=60) for a in attackers]
    assert owner == [200, 200]
    results = [json.loads(out or "null") for out, _ in outs]
    assert all(results), [err for _, err in outs]
    budget = lambda r: transport.FOREIGN_BURST + transport.FOREIGN_RATE * r["seconds"] + 1  # noqa: E731
    for r in results:
        assert 0 < r["answers"] <= budget(r), r  # one answer per connection, the budget's connections
    st, body = http(served.url, "GET", "/stats")
    assert st == 200
    # every connection past the budget was closed unanswered by it, but for the 8 each uid still held open
    # when it stopped (its client counts a connection when it opens)
    over = sum(max(0, r["opened"] - int(budget(r)) - 8) for r in results)
    assert body["controller"]["throttled_connections"] >= over, (body["controller"], results)


def test_an_answer_nobody_reads_aborts_its_connection(served, monkeypatch):
    """The owner's own client pipelines /metrics and never reads: once the
    server's buffer stops draining, the connection is aborted within the
    write deadline (counted), instead of being held for ever."""
    monkeypatch.setattr(transport, "IO_TIMEOUT_S", 1.0)
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    s.connect(served.addr)
    host, port = served.addr
    token = served.token
    req = (f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\nAuthorization: Bearer {token}\r\n\r\n").encode()
    s.setblocking(False)
    sent = 0

    def cut_off() -> bool:
        nonlocal sent
        try:
            sent += s.send(req * 16)
        except BlockingIOError:
            pass
        except OSError:
            return True
        return http(served.url, "GET", "/stats")[1]["controller"]["write_timeouts"] >= 1

    wait_until(cut_off, "the unread connection aborted", timeout=60)
    s.close()
    assert http(served.url, "GET", "/health")[0] == 200


def test_the_owner_has_a_socket_of_its_own(cache_name):
    """Beside its TCP listener the daemon serves the owner's own socket (0600
    in the private runtime directory): `shmkv ctl` reaches the daemon there,
    behind no other uid's connections; it is gone when the daemon stops."""
    import os
    import stat

    from shmkv.services.controller_auth import owner_socket_path
    from shmkv.services.controller_client import request, url_of

    cfg = load_config({"cache_name": cache_name, "capacity": "8MiB", "populate": False, "listen": "127.0.0.1:0"},
                      env={})
    d, t = serve_in_process(cfg)
    path = owner_socket_path(cfg)
    try:
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_uid == os.geteuid()
        assert stat.S_IMODE(os.stat(os.path.dirname(path)).st_mode) == 0o700
        assert url_of(cfg) == f"unix:{path}"
        assert request(url_of(cfg), d.token, "GET", "/stats")[0] == 200
        assert request(d.url, d.token, "GET", "/health")[0] == 200, "the configured listener as before"
    finally:
        stop_in_process(d, t)
    assert not os.path.lexists(path)
    assert url_of(cfg).startswith("http://"), "no owner socket: the configured listener"
