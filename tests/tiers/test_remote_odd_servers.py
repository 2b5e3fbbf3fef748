"""A remote that misbehaves cannot stall or break the callers: a server that
drips its answer a byte at a time is cut at the call's deadline (remote_timeout
in total, not per read), a server that answers +OK to everything is a counted
fault with the backoff, never an exception, and a redis:// URL to another
host is named in a warning (chunks would travel in clear)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import key

from shmkv import Store
from shmkv.tiers import TierChain
from shmkv.tiers.remote.tier import RemoteTier

NS = b"N" * 16
TIMEOUT = 0.5


@pytest.fixture
def store(small_store):
    return small_store


def fake_server(answer: Callable[[socket.socket, bytes], None]) -> Iterator[str]:
    """A TCP server on loopback that calls answer(conn, data) for what each client sends."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    stop = threading.Event()
    conns: list[socket.socket] = []

    def serve(conn: socket.socket) -> None:
        conn.settimeout(0.1)
        while not stop.is_set():
            try:
                data = conn.recv(65536)
            except TimeoutError:
                continue
            except OSError:
                return
            if not data:
                return
            try:
                answer(conn, data)
            except OSError:
                return

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            conns.append(conn)
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    t = threading.Thread(target=accept, daemon=True)
    t.start()
    yield f"redis://127.0.0.1:{listener.getsockname()[1]}/0"
    stop.set()
    t.join()
    listener.close()
    for c in conns:
        c.close()


def drip(conn: socket.socket, _data: bytes) -> None:
    """Answer with a long array, one byte every 0.05 s (about 20 s in all)."""
    for b in b"*100\r\n" + b":1\r\n" * 100:
        conn.sendall(bytes([b]))
        time.sleep(0.05)  # the fake server's pace, not a wait in the test


def ok_to_everything(conn: socket.socket, data: bytes) -> None:
    conn.sendall(b"+OK\r\n" * max(1, data.count(b"*")))


@pytest.fixture
def dripping() -> Iterator[str]:
    yield from fake_server(drip)


@pytest.fixture
def yes_server() -> Iterator[str]:
    yield from fake_server(ok_to_everything)


def remote(url: str, store: Store) -> RemoteTier:
    r = RemoteTier(url, timeout_s=TIMEOUT, counter=store.bump)
    TierChain(store, [r])
    return r


def test_a_dripping_server_is_cut_at_the_calls_deadline(store, dripping):
    r = remote(dripping, store)
    t0 = time.monotonic()
    assert r.contains([key(i) for i in range(100)], [NS] * 100) == [False] * 100
    elapsed = time.monotonic() - t0
    assert elapsed < 2 * TIMEOUT, f"contains() took {elapsed:.2f} s with remote_timeout {TIMEOUT} s"
    assert store.stats()["remote_errors"] == 1
    r.close()


def test_a_server_that_says_ok_to_everything_is_a_fault_not_an_error(store, yes_server):
    r = remote(yes_server, store)
    assert r.contains([key(1), key(2)], [NS, NS]) == [False, False]
    assert store.stats()["remote_errors"] == 1
    assert r.fetch(key(1), NS) is None, "while backing off: a miss at once"
    r._backoff = type(r._backoff)()  # a fresh backoff: the next call reaches the server again
    assert r.fetch(key(1), NS) is None
    assert store.stats()["remote_damaged"] == 1, "its b'OK' for a GET is no chunk: a counted miss"
    chain = TierChain(store, [r])
    assert chain.promote([key(1)], [NS]) == 0
    r.close()


@pytest.mark.parametrize("url,warned", [("redis://10.0.0.7:6379/0", True), ("redis://127.0.0.1:6379/0", False),
                                        ("rediss://10.0.0.7:6379/0", False),
                                        ("redis://:secret@10.0.0.7:6379/0?password=pw", True)])
def test_clear_text_to_another_host_is_named(caplog, url, warned):
    with caplog.at_level(logging.WARNING, logger="shmkv.remote"):
        RemoteTier(url, timeout_s=TIMEOUT).close()
    lines = [r.getMessage() for r in caplog.records if "in clear" in r.getMessage()]
    assert bool(lines) == warned, lines
    assert "secret" not in caplog.text and "pw" not in caplog.text.replace("pwd", "")
