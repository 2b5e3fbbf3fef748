"""The remote tier's connection to Redis / Valkey: one server or a cluster.

Owns how a `remote_url` becomes a redis-py client, and the bounds of every
call made through it:

  * `remote_url` is one server's redis:// / rediss:// / unix:// URL; a
    redis:// or rediss:// URL of any node of a Redis or Valkey Cluster (the
    server's `INFO cluster` says so at start); or a comma-separated list of
    seed nodes' URLs (always a cluster). A cluster gets redis-py's cluster
    client: keys spread over every slot, MOVED/ASK and failovers handled by
    it; the single-server mode stays as it was;
  * every call has one deadline across its connect, its sends and its
    socket reads (a thread-local set by RemoteTier._call): redis-py bounds
    each read by socket_timeout, not a call, so a server dripping its answer
    would hold a call for ever. Whether the server is a cluster is asked once,
    when the tier is made, under a deadline of its own: never inside a
    caller's call;
  * a redis:// URL to a host that is not loopback is named in a warning:
    chunks would travel in clear;
  * a reply of a chunk's size is read from the socket straight into the one
    buffer it is returned in (a bytearray; smaller replies stay bytes):
    redis-py's pure-Python parser would copy it three more times on the way.

Also the shared secret's file (read_secret): a file of ours that nobody
else can read or write.
"""

from __future__ import annotations

import ipaddress
import logging
import threading
import time
from typing import Any
from urllib.parse import urlsplit

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.retry import Retry

from shmkv.config_values import redact_url

log = logging.getLogger("shmkv.remote")

_deadline = threading.local()


def set_deadline(at: float | None) -> None:
    """The calling thread's deadline (time.monotonic()) for its remote calls; None: none."""
    _deadline.at = at


def time_left(cap: float) -> float:
    """Seconds the calling thread's call may still take, at most `cap`
    (`cap` without a deadline); TimeoutError once the deadline passed."""
    at = getattr(_deadline, "at", None)
    if at is None:
        return cap
    left = at - time.monotonic()
    if left <= 0:
        raise TimeoutError("the remote call's deadline passed")
    return min(left, cap)


class _DeadlineSocket:
    """A connected socket whose reads and sends end at the calling thread's deadline."""

    def __init__(self, sock: Any, timeout_s: float) -> None:
        self._sock = sock
        self._timeout_s = timeout_s

    def _arm(self) -> None:
        if getattr(_deadline, "at", None) is not None:
            self._sock.settimeout(time_left(self._timeout_s))

    def recv(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv(*args)

    def recv_into(self, *args: Any) -> Any:
        self._arm()
        return self._sock.recv_into(*args)

    def send(self, *args: Any) -> Any:
        self._arm()
        return self._sock.send(*args)

    def sendall(self, *args: Any) -> Any:
        self._arm()  # NOTE: sendall's timeout bounds the whole send (CPython), so the deadline holds
        return self._sock.sendall(*args)

    def settimeout(self, t: float | None) -> None:
        self._timeout_s = self._timeout_s if t is None else t
        self._sock.settimeout(t)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._sock, name)


def _bulk_parser_class() -> type | None:
    """redis-py's Python parser (RESP3's, which also reads RESP2 replies)
    with large bulk replies read by recv_into into one bytearray: the
    default path recv()s 64 KiB pieces into a BytesIO, reads the value out
    of it and slices off its CRLF, a copy each (0.6 GB/s for an 8 MiB chunk
    here). None where redis-py's private parser classes are not where this
    version of it was read (the default parser is used then)."""
    try:
        from redis._parsers.resp3 import _RESP3Parser
        from redis._parsers.socket import SENTINEL, SocketBuffer
    except ImportError:
        return None
    if not all(hasattr(SocketBuffer, m) for m in ("read", "_read_from_socket")):
        return None

    class BulkSocketBuffer(SocketBuffer):  # type: ignore[misc,valid-type]
        def read(self, length: int, timeout: Any = SENTINEL) -> Any:
            if length < BULK_DIRECT_BYTES:
                return super().read(length, timeout)
            # the value and its CRLF; a length the server only declares takes no memory: the buffer starts at
            # BULK_FIRST_BYTES at most and doubles as what arrives fills it
            want = length + 2
            out = bytearray(min(want, BULK_FIRST_BYTES))
            with memoryview(out) as view:
                got = self._buffer.readinto(view)  # what was read past the reply's first line
            while got < want:
                if got == len(out):
                    out.extend(bytes(min(len(out), want - len(out))))
                with memoryview(out) as view:
                    n = self._sock.recv_into(view[got:])  # a timeout or a reset: the connection is dropped
                if not n:
                    raise redis.exceptions.ConnectionError("the server closed the connection mid-reply")
                got += n
            if out[length:] != b"\r\n":
                raise redis.exceptions.InvalidResponse("a bulk reply without its CRLF")
            del out[length:]  # shrinks in place
            return out

    class BulkParser(_RESP3Parser):  # type: ignore[misc,valid-type]
        def on_connect(self, connection: Any) -> None:
            super().on_connect(connection)
            self._buffer = BulkSocketBuffer(self._sock, self.socket_read_size, connection.socket_timeout)

    return BulkParser


BULK_DIRECT_BYTES = 256 << 10  # replies this large go straight into their buffer (_bulk_parser_class)
BULK_FIRST_BYTES = 64 << 20  # ... which starts at most this large, and doubles as the reply fills it
_BULK_PARSER = _bulk_parser_class()


class _DeadlineMixin:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        if _BULK_PARSER is not None:  # NOTE: here, not in the client's kwargs: redis-py's cluster drops those
            kwargs["parser_class"] = _BULK_PARSER
        super().__init__(*args, **kwargs)  # type: ignore[call-arg]

    def _connect(self) -> Any:
        cap = self.socket_connect_timeout or self.socket_timeout or 1.0  # type: ignore[attr-defined]
        saved = self.socket_connect_timeout  # type: ignore[attr-defined]
        self.socket_connect_timeout = time_left(cap)  # a connect within the call's deadline too
        try:
            sock = super()._connect()  # type: ignore[misc]
        finally:
            self.socket_connect_timeout = saved
        return _DeadlineSocket(sock, self.socket_timeout or 1.0)  # type: ignore[attr-defined]


_CONNECTIONS = {
    "redis": type("DeadlineConnection", (_DeadlineMixin, redis.connection.Connection), {}),
    "rediss": type("DeadlineSSLConnection", (_DeadlineMixin, redis.connection.SSLConnection), {}),
    "unix": type("DeadlineUnixConnection", (_DeadlineMixin, redis.connection.UnixDomainSocketConnection), {}),
}


def make_client(url: str, timeout_s: float) -> tuple[Any, bool]:
    """(redis-py client, whether it is a cluster's) for a remote_url (module doc)."""
    urls = [u.strip() for u in url.split(",") if u.strip()]
    for u in urls:
        _warn_if_clear_text(u)
    scheme = urls[0].partition("://")[0]
    common = {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s,
              "connection_class": _CONNECTIONS[scheme]}
    if len(urls) == 1:
        single = redis.Redis.from_url(urls[0], retry=Retry(NoBackoff(), 0), health_check_interval=0, **common)
        if scheme == "unix" or not _is_cluster(single, urls[0], timeout_s):
            return single, False
        single.close()
    # NOTE: redis-py gives every node our connection class only for a client made from a URL, and a
    # rediss:// URL would replace it with its own SSL class: the first URL goes in as redis://, the
    # class (ours, with TLS for rediss) set here
    first = "redis" + urls[0][len(scheme):]
    nodes = [redis.cluster.ClusterNode(p.hostname or "localhost", p.port or 6379) for p in map(urlsplit, urls[1:])]
    client = redis.cluster.RedisCluster(url=first, startup_nodes=nodes, require_full_coverage=False,
                                        retry=Retry(NoBackoff(), 1), **common)
    return client, True


def _is_cluster(client: redis.Redis, url: str, timeout_s: float) -> bool:
    set_deadline(time.monotonic() + timeout_s)
    try:
        return bool(client.info("cluster").get("cluster_enabled"))
    except Exception as e:  # noqa: BLE001 - unreachable now: used as one server (calls fail over to misses)
        log.warning("shmkv: remote tier %s: could not ask whether it is a cluster (%s: %s); used as one server",
                    redact_url(url), type(e).__name__, e)
        return False
    finally:
        set_deadline(None)


def read_secret(path: str) -> bytes:
    """The shared secret in `path` (shmkv.paths.read_secret_file: ours or
    root's, nobody else can read or write it), of at least 16 bytes. Raises
    PermissionDeniedError / ConfigError naming the file."""
    from shmkv.errors import ConfigError
    from shmkv.paths import read_secret_file

    try:
        secret = read_secret_file(path, "remote_secret_file", fix=f"`chmod 600 {path}`", root_ok=True)
    except (FileNotFoundError, IsADirectoryError) as e:
        raise ConfigError(f"remote_secret_file={path!r}: cannot read it: {e}") from None
    if len(secret) < 16:
        raise ConfigError(f"remote_secret_file {path}: holds {len(secret)} bytes; give it at least 16 random bytes "
                          "(e.g. `openssl rand -hex 32 > FILE`)")
    return secret


def _warn_if_clear_text(url: str) -> None:
    """One warning when chunks would cross a network in clear: redis:// to a
    host that is not loopback (rediss:// encrypts; unix:// stays on the host)."""
    parts = urlsplit(url)
    if parts.scheme != "redis":
        return
    host = parts.hostname or "localhost"
    try:
        local = host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        local = False
    if not local:
        log.warning("shmkv: remote tier %s: redis:// to another host: chunks travel in clear and unauthenticated "
                    "(anyone on the path can read the KV, or plant it); use rediss://", redact_url(url))
