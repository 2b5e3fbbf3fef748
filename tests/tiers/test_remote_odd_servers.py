"""A remote that misbehaves cannot stall or break the callers: a server that
drips its answer a byte at a time is cut at the call's deadline (remote_timeout
in total, not per read; counted on a fake clock and in bytes sent, never
timed), a server that answers +OK to everything is a counted fault with the
backoff, never an exception, and a redis:// URL to another host is named in a warning (chunks would travel in clear)."""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Iterator

import pytest
from helpers import key

from shmkv import Store
from shmkv.tiers import TierChain
from shmkv.tiers.remote import client as remote_client
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


DRIP = b"*100\r\n" + b":1\r\n" * 100
DRIPPED: queue.Queue[int] = queue.Queue()  # per answer: the bytes sent before the client hung up (or all)


def drip(conn: socket.socket, _data: bytes) -> None:
    """Answer with a long array, one byte every 0.05 s (about 20 s in all);
    put in DRIPPED how many bytes went out before the client hung up."""
    for i, b in enumerate(DRIP):
        try:
            conn.sendall(bytes([b]))
        except OSError:
            DRIPPED.put(i)
            raise
        time.sleep(0.05)  # the fake server's pace, not a wait in the test
    DRIPPED.put(len(DRIP))


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
    """Counted, not timed: the client hangs up on the drip (a per-read
    timeout would read it all: each byte comes within one), once per call."""
    while not DRIPPED.empty():
        DRIPPED.get()
    r = remote(dripping, store)  # the cluster probe, at start: an answer of its own, cut too
    assert r.contains([key(i) for i in range(100)], [NS] * 100) == [False] * 100
    assert store.stats()["remote_errors"] == 1, "one failed call, counted once"
    r.close()
    sent = sorted(DRIPPED.get(timeout=30) for _ in range(2))  # the probe's answer and the lookup's
    assert all(n < len(DRIP) // 2 for n in sent), f"bytes sent before the client hung up: {sent} of {len(DRIP)}"


class FakeSocket:
    """A socket whose every read takes 1/16 s of a fake clock (exact in binary) and returns a byte."""

    def __init__(self, clock: list[float]) -> None:
        self.clock = clock
        self.reads = 0
        self.timeouts: list[float] = []

    def settimeout(self, t: float | None) -> None:
        self.timeouts.append(t)

    def recv(self, n: int) -> bytes:
        self.reads += 1
        self.clock[0] += 0.0625
        return b"x"

    def sendall(self, data: bytes) -> None:
        self.clock[0] += 0.0625


def test_the_deadline_bounds_a_call_not_each_read(monkeypatch):
    """The deadline socket on a fake clock: 0.5 s of reads that each take
    1/16 s end after 8 reads, whatever the per-read timeout; each read's
    timeout is what is left of the call; a send past the deadline fails too."""
    clock = [100.0]
    monkeypatch.setattr(remote_client.time, "monotonic", lambda: clock[0])
    sock = FakeSocket(clock)
    wrapped = remote_client._DeadlineSocket(sock, timeout_s=TIMEOUT)
    remote_client.set_deadline(clock[0] + TIMEOUT)
    try:
        with pytest.raises(TimeoutError):
            while True:
                wrapped.recv(1)
        assert sock.reads == 8
        assert sock.timeouts[0] == TIMEOUT and sock.timeouts == sorted(sock.timeouts, reverse=True)
        with pytest.raises(TimeoutError):
            wrapped.sendall(b"PING")
        remote_client.set_deadline(None)
        armed = len(sock.timeouts)
        wrapped.recv(1)  # no deadline: the socket's own timeout is left as it is
        assert len(sock.timeouts) == armed
    finally:
        remote_client.set_deadline(None)


def test_a_connect_gets_what_is_left_of_the_call(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(remote_client.time, "monotonic", lambda: clock[0])
    remote_client.set_deadline(clock[0] + TIMEOUT)
    try:
        clock[0] += 0.4
        assert remote_client.time_left(TIMEOUT) == pytest.approx(0.1)
        clock[0] += 0.2
        with pytest.raises(TimeoutError):
            remote_client.time_left(TIMEOUT)
    finally:
        remote_client.set_deadline(None)
    assert remote_client.time_left(TIMEOUT) == TIMEOUT


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
