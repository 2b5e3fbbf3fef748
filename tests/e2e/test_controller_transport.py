"""The controller's HTTP transport: a body is read exactly as its headers
declare it (chunked included) or the request is refused, never taken as
empty; idle connections time out; many idle or concurrent clients do not
stop /health from answering; JSON nested too deeply is a 400."""

from __future__ import annotations

import json
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from helpers import http, payload_for

import shmkv.daemon as daemon_mod
from shmkv.config import load_config
from shmkv.daemon import Daemon
from shmkv.keys import Namespace

NS = [Namespace(model_id=f"m{i}", dtype="bfloat16", num_layers=2, num_kv_heads=2, head_size=64, chunk_size=32,
                block_size=16)
      for i in range(2)]


def start_daemon(cache_name: str) -> tuple[Daemon, threading.Thread]:
    """A daemon serving in this process on a loopback port (d.addr)."""
    cfg = load_config({"cache_name": cache_name, "capacity": "8MiB", "listen": "127.0.0.1:0", "populate": False},
                      env={})
    d = Daemon(cfg)
    assert d.lock.try_acquire()
    d.start()
    t = threading.Thread(target=d.serve, daemon=True)
    t.start()
    host, port = d.url.removeprefix("http://").rsplit(":", 1)
    d.addr = (host, int(port))
    return d, t


@pytest.fixture
def served(cache_name):
    d, t = start_daemon(cache_name)
    for i in range(10):  # 5 chunks in each of two namespaces
        k = bytes([i]) * 16
        d.store.put(k, payload_for(k, 4096), namespace=NS[i % 2].root_key())
    yield d
    d.request_stop()
    t.join(timeout=30)
    d.close()


def raw_request(addr, data: bytes, *, half_close: bool = False, timeout: float = 10) -> tuple[int, dict]:
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
        head, _, body = buf.partition(b"\r\n\r\n")
        length = int(next(line.split(b":")[1] for line in head.split(b"\r\n")
                          if line.lower().startswith(b"content-length")))
        while len(body) < length:
            body += s.recv(65536)
    return int(head.split()[1]), json.loads(body)


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
    (b"POST /clear HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n0\r\n\r\n", 400),
    (b"POST /clear HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n10\r\n{}", 400),  # truncated chunk
    (b"POST /clear HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n{}", 501),
    (b"POST /clear HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}", 400),
    (b"POST /clear HTTP/1.1\r\nContent-Length: 100\r\n\r\n{\"namespace\"", 400),  # short body
])
def test_a_body_that_cannot_be_read_as_declared_changes_nothing(served, request_bytes, status):
    st, reply = raw_request(served.addr, request_bytes, half_close=True)
    assert st == status, reply
    assert served.store.stats()["entries"] == 10


def test_json_nested_too_deeply_is_a_400(served):
    st, reply = http(served.url, "POST", "/lookup", raw=b"[" * 100_000 + b"]" * 100_000)
    assert st == 400 and "nested too deeply" in reply["error"]


def test_health_answers_with_200_idle_connections_open(served):
    idle = [socket.create_connection(served.addr, timeout=5) for _ in range(200)]
    try:
        with socket.create_connection(served.addr, timeout=2) as s:  # well inside a 2 s client timeout
            s.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
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


def test_idle_connections_time_out_and_the_cap_evicts_the_oldest(cache_name, monkeypatch):
    monkeypatch.setattr(daemon_mod._Handler, "timeout", 0.5)
    monkeypatch.setattr(daemon_mod, "MAX_CONNECTIONS", 8)
    d, t = start_daemon(cache_name)
    try:
        addr = d.addr
        with socket.create_connection(addr, timeout=10) as s:
            s.sendall(b"GET /health HTT")  # a slow client that never finishes its request line
            assert s.recv(100) == b"", "closed by the server's read timeout"
        idle = [socket.create_connection(addr, timeout=10) for _ in range(20)]
        try:
            st, body = http(d.url, "GET", "/health")
            assert st == 200 and body["status"] == "ok"
            assert d.server.evicted_idle >= 1
        finally:
            for s in idle:
                s.close()
    finally:
        d.request_stop()
        t.join(timeout=30)
        d.close()
