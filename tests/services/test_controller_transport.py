"""The controller's HTTP transport (uvicorn + FastAPI): a body is read exactly
as its headers frame it (chunked included) or the request never runs, never
taken as empty; a body over the limit is a 413, chunked or not; a slow client
gets a 408 for its body and loses its connection for a slow head; many idle
or concurrent clients do not stop /health from answering; JSON nested too
deeply is a 400."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import CONTROLLER_TOKENS, http, payload_for, serve_in_process, stop_in_process

import shmkv.services.controller_http as transport
from shmkv.config import load_config
from shmkv.keys import Namespace
from shmkv.services.daemon import Daemon

NS = [Namespace(model_id=f"m{i}", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, chunk_size=32,
                block_size=16)
      for i in range(2)]


def start_daemon(cache_name: str) -> tuple[Daemon, threading.Thread]:
    """A daemon serving in this process on a loopback port (d.addr)."""
    return serve_in_process(load_config({"cache_name": cache_name, "capacity": "8MiB", "listen": "127.0.0.1:0",
                                         "populate": False}, env={}))


def serve_filled(cache_name: str):
    """A served daemon holding 5 chunks in each of two namespaces; stopped after."""
    d, t = start_daemon(cache_name)
    for i in range(10):
        k = bytes([i]) * 16
        d.store.put(k, payload_for(k, 4096), namespace=NS[i % 2].root_key())
    yield d
    stop_in_process(d, t)


@pytest.fixture
def served(cache_name):
    yield from serve_filled(cache_name)


def authed(addr, data: bytes) -> bytes:
    """`data` with "Host: x" replaced by the controller's own Host and its token."""
    token = CONTROLLER_TOKENS[f"http://{addr[0]}:{addr[1]}"]
    return data.replace(b"Host: x\r\n", f"Host: {addr[0]}:{addr[1]}\r\nAuthorization: Bearer {token}\r\n".encode())


def raw_request(addr, data: bytes, *, half_close: bool = False, timeout: float = 10) -> tuple[int | None, dict]:
    """(status, JSON body or {"text": ...}) of one raw request; (None, {})
    when the server closed the connection without answering. "Host: x" in
    `data` stands for the controller's own Host and its token."""
    data = authed(addr, data)
    with socket.create_connection(addr, timeout=timeout) as s:
        s.sendall(data)
        if half_close:
            s.shutdown(socket.SHUT_WR)
        buf = b""
        while b"\r\n\r\n" not in buf:
            got = s.recv(65536)
            if not got:
                break
            buf += got
        if not buf:
            return None, {}
        head, _, body = buf.partition(b"\r\n\r\n")
        fields = dict(line.split(b":", 1) for line in head.split(b"\r\n")[1:])
        fields = {k.strip().lower(): v.strip() for k, v in fields.items()}
        if b"content-length" in fields:
            while len(body) < int(fields[b"content-length"]):
                body += s.recv(65536)
        else:  # close-delimited (uvicorn's own refusals)
            while got := s.recv(65536):
                body += got
    ok_json = b"json" in fields.get(b"content-type", b"")
    return int(head.split()[1]), (json.loads(body) if ok_json else {"text": body.decode(errors="replace")})


def chunked(body: bytes, piece: int = 7) -> bytes:
    out = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + piece]), body[i:i + piece]) for i in range(0, len(body), piece))
    return out + b"0\r\n\r\n"


def test_chunked_clear_removes_only_the_namespace_asked(served):
    body = json.dumps({"namespace": NS[0].root_key().hex()}).encode()
    st, reply = raw_request(served.addr, b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + chunked(body))
    assert st == 200 and reply["removed"]["shm"] == 5
    assert served.store.stats()["entries"] == 5


@pytest.mark.parametrize("request_bytes,status", [
    (b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    (b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{}", None),  # truncated chunk
    (b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: gzip\r\n\r\n{}", 400),
    (b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}", None),
    (b"POST /clear HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"namespace\"", None),  # short body
    (b"POST /clear HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n0\r\n\r\n", 400),  # no Host
])
def test_a_body_that_cannot_be_read_as_declared_changes_nothing(served, request_bytes, status):
    """Refused with a 400, or (a body cut short) the connection closed: the
    request never runs, and in particular /clear never clears everything."""
    st, reply = raw_request(served.addr, request_bytes, half_close=True)
    assert st == status, reply
    assert served.store.stats()["entries"] == 10
    st, body = http(served.url, "GET", "/stats")
    assert st == 200 and body["controller"]["bad_requests"] == 1, "the refusal is counted"


def test_json_nested_too_deeply_is_a_400(served):
    st, reply = http(served.url, "POST", "/lookup", raw=b"[" * 100_000 + b"]" * 100_000)
    assert st == 400 and "nested too deeply" in reply["error"]


def test_health_answers_with_200_idle_connections_open(served):
    idle = [socket.create_connection(served.addr, timeout=5) for _ in range(200)]
    try:
        with socket.create_connection(served.addr, timeout=2) as s:  # well inside a 2 s client timeout
            s.sendall(f"GET /health HTTP/1.1\r\nHost: {served.addr[0]}:{served.addr[1]}\r\n\r\n".encode())
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
    finally:
        for s in idle:
            s.close()


def test_64_concurrent_clients_are_all_answered(served):
    def one(i: int) -> int:
        st, _ = http(served.url, "POST", "/lookup", {"tokens": list(range(i, i + 64)),
                                                    "namespace": NS[0].root_key().hex()})
        return st

    with ThreadPoolExecutor(64) as ex:
        assert list(ex.map(one, range(64))) == [200] * 64


@pytest.fixture
def quick(monkeypatch, cache_name):
    """A daemon with a 0.5 s transport timeout and a 4 KiB body limit."""
    monkeypatch.setattr(transport, "IO_TIMEOUT_S", 0.5)
    monkeypatch.setattr(transport, "MAX_BODY_BYTES", 4096)
    yield from serve_filled(cache_name)


def test_a_slow_request_head_loses_its_connection_while_others_are_answered(quick):
    with socket.create_connection(quick.addr, timeout=10) as slow:
        closed = False
        for byte in b"GET /health HTTP/1.1\r\nHost: x":  # one byte every 0.1 s, never the end of the head
            try:
                slow.sendall(bytes([byte]))
            except OSError:
                closed = True
                break
            st, body = http(quick.url, "GET", "/health")  # others are served meanwhile
            assert st == 200 and body["status"] == "ok"
            slow.settimeout(0.1)
            try:
                if slow.recv(100) == b"":
                    closed = True
                    break
            except TimeoutError:
                pass
        assert closed, "the server closed a connection whose request head never ended (before all of it was sent)"


def test_idle_connections_are_closed_after_the_timeout(quick):
    idle = [socket.create_connection(quick.addr, timeout=10) for _ in range(20)]
    try:
        for s in idle:
            assert s.recv(100) == b"", "closed by the server"
        st, body = http(quick.url, "GET", "/health")
        assert st == 200
    finally:
        for s in idle:
            s.close()


def test_a_slow_body_gets_a_408_and_changes_nothing(quick):
    body = json.dumps({"namespace": NS[0].root_key().hex()}).encode()
    with socket.create_connection(quick.addr, timeout=10) as s:
        s.sendall(authed(quick.addr, b"POST /clear HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
                  + body[:5])
        reply = s.recv(65536)
        assert reply.startswith(b"HTTP/1.1 408"), reply
        assert b"did not arrive within 0.5 s (5 bytes read)" in reply
        s.sendall(body[5:])  # too late: the request was refused and the connection closed
    assert quick.store.stats()["entries"] == 10


@pytest.mark.parametrize("framing", ["content-length", "chunked"])
def test_a_body_over_the_limit_is_a_413_and_changes_nothing(quick, framing):
    body = json.dumps({"namespace": NS[0].root_key().hex(), "pad": "x" * 8192}).encode()
    if framing == "chunked":
        request = b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + chunked(body, 1000)
    else:
        request = b"POST /clear HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body) + body
    st, reply = raw_request(quick.addr, request)
    assert st == 413 and "over the limit of 4096" in reply["error"], reply
    assert quick.store.stats()["entries"] == 10
    ok = json.dumps({"namespace": NS[0].root_key().hex()}).encode()
    st, reply = raw_request(quick.addr, b"POST /clear HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + chunked(ok, 9))
    assert st == 200 and reply["removed"]["shm"] == 5, "a chunked body under the limit is read whole"
