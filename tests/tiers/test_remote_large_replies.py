"""A reply of a chunk's size is read straight into the buffer it is returned
in (shmkv.tiers.remote.client): values on both sides of the threshold come
back byte-equal, alone and pipelined with small and missing ones, through
one server and a cluster; a server that closes mid-value, ends a value
without its CRLF or declares more than it sends is an error of that call,
never a wrong value nor memory for what never came."""

from __future__ import annotations

import os
import socket
import threading

import pytest
import redis

from shmkv.tiers.remote import client as remote_client

SIZES = [remote_client.BULK_DIRECT_BYTES - 1, remote_client.BULK_DIRECT_BYTES,
         remote_client.BULK_DIRECT_BYTES + 1, (8 << 20) + 3]


def test_the_direct_read_is_the_one_in_use():
    assert remote_client._BULK_PARSER is not None, "redis-py's parser classes moved: large replies are copied again"


@pytest.mark.parametrize("server", ["redis_server", "redis_cluster"])
def test_values_on_both_sides_of_the_threshold_come_back_byte_equal(request, server):
    url = request.getfixturevalue(server).url
    client, is_cluster = remote_client.make_client(url, 10.0)
    assert is_cluster == (server == "redis_cluster")
    values = {f"shmkv-test-large-{n}".encode(): os.urandom(n) for n in SIZES}
    try:
        for k, v in values.items():
            client.set(k, v)
        for k, v in values.items():
            got = client.get(k)
            assert got == v and len(got) == len(v)
            assert isinstance(got, bytearray if len(v) >= remote_client.BULK_DIRECT_BYTES else bytes)
        if not is_cluster:  # one connection's replies back to back, a large one behind a small one and a miss
            pipe = client.pipeline(transaction=False)
            order = [*values, b"shmkv-test-large-missing", *reversed(values)]
            for k in order:
                pipe.get(k)
            got = pipe.execute()
            assert got == [values.get(k) for k in order]
    finally:
        for k in values:
            client.delete(k)
        client.close()


def one_reply_server(reply: bytes) -> tuple[str, threading.Thread, socket.socket]:
    """A server that answers the client's first command with `reply`, then closes."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(1)

    def serve() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.recv(65536)
            conn.sendall(reply)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    return f"redis://127.0.0.1:{listener.getsockname()[1]}", t, listener


@pytest.mark.parametrize("reply, error", [
    (b"$%d\r\n" % (1 << 20) + b"x" * 1000, redis.exceptions.ConnectionError),  # closed mid-value
    (b"$%d\r\n" % (1 << 20) + b"x" * (1 << 20) + b"zz", redis.exceptions.InvalidResponse),  # no CRLF
    # a length only declared (1 TiB): the buffer grows with what arrives, so the call ends in the server's
    # close, not in a MemoryError (or the OOM killer) for what was never sent
    (b"$%d\r\n" % (1 << 40) + b"x" * ((64 << 20) + 5), redis.exceptions.ConnectionError),
], ids=["closed-mid-value", "no-crlf", "declared-only"])
def test_a_broken_large_reply_is_an_error_not_a_value(reply, error):
    url, t, listener = one_reply_server(reply)
    client = redis.Redis.from_url(url, socket_timeout=10,
                                  connection_class=remote_client._CONNECTIONS["redis"])
    try:
        with pytest.raises(error):
            client.get(b"k")
    finally:
        client.close()
        t.join(timeout=10)
        listener.close()
