"""Who may talk to the controller.

Owns the controller's bearer token (its file, its checks) and the gate every
request passes before its body is read:

  * on TCP (loopback only), every endpoint but /health needs
    `Authorization: Bearer <token>` (and /metrics too, unless
    `controller_open_metrics`); the token is compared in constant time and
    never logged;
  * a `Host` header other than the listen address, or an `Origin` header that
    is not a loopback origin, is refused whatever the token (a web page, or a
    DNS-rebinding one, cannot drive the controller through the browser);
  * on a unix socket, the peer's uid (SO_PEERCRED) must be ours, root's or
    one of `controller_allow_uids`; no token is needed there.

The token lives in a 0600 file: `controller_token_file`, or
<runtime dir>/<cache name>.controller-token. The daemon creates it at its
first start and reuses it afterwards, so clients keep working across
restarts; clients (shmkv.services.controller_client) read it the same way.
Both refuse a token file that someone else could have written or read.
"""

from __future__ import annotations

import hmac
import ipaddress
import os
import secrets
import socket
import struct
from dataclasses import dataclass
from urllib.parse import urlsplit

from shmkv.config import ShmkvConfig, parse_listen
from shmkv.errors import ConfigError, PermissionDeniedError
from shmkv.paths import read_secret_file, runtime_dir

OPEN_PATHS = frozenset({"/health"})


def token_path(cfg: ShmkvConfig) -> str:
    """Where the controller token of this configuration lives."""
    if cfg.controller_token_file:
        return cfg.controller_token_file
    return os.path.join(runtime_dir().path, f"{cfg.cache_name}.controller-token")


def read_token(cfg: ShmkvConfig) -> str:
    """The controller token, for a client. Raises ConfigError naming the file
    when there is none (no daemon has started with this configuration)."""
    path = token_path(cfg)
    try:
        token = read_secret_file(path, "controller token file",
                                 fix=f"remove it (the daemon writes a new one) or `chmod 600 {path}`")
    except FileNotFoundError:
        raise ConfigError(f"no controller token at {path}: the daemon writes it at its first start "
                          "(same cache_name and runtime directory as this process)") from None
    if len(token) < 32:
        raise PermissionDeniedError(f"controller token file {path}: holds no token; remove it, the daemon "
                                    "writes a new one")
    return token.decode("ascii", "replace")


def load_or_create_token(cfg: ShmkvConfig) -> str:
    """The daemon's token: the existing file's, or a new one written 0600."""
    path = token_path(cfg)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        return read_token(cfg)
    try:
        os.fchmod(fd, 0o600)
        token = secrets.token_urlsafe(32)
        os.write(fd, (token + "\n").encode())
    finally:
        os.close(fd)
    return token


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", creds)[1]


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection (from
    /proc/net/tcp{,6}: the socket whose local address is our peer's), or
    None when it cannot be told."""
    try:
        peer, local = sock.getpeername(), sock.getsockname()
        v6 = sock.family == socket.AF_INET6
        want = (_proc_address(peer[0], peer[1], v6), _proc_address(local[0], local[1], v6))
        with open("/proc/net/tcp6" if v6 else "/proc/net/tcp") as f:
            next(f)
            for line in f:
                fields = line.split()
                if (fields[1], fields[2]) == want:
                    return int(fields[7])
    except (OSError, ValueError, IndexError, StopIteration):
        return None
    return None


def _proc_address(host: str, port: int, v6: bool) -> str:
    """An address as /proc/net/tcp writes it: the address in host byte order, then the port, in hex."""
    if v6:
        raw = socket.inet_pton(socket.AF_INET6, host)
        addr = "".join(raw[i:i + 4][::-1].hex() for i in range(0, 16, 4))
    else:
        addr = socket.inet_aton(host)[::-1].hex()
    return f"{addr.upper()}:{port:04X}"


@dataclass(frozen=True)
class Gate:
    """The checks of one controller listener (module doc)."""

    kind: str  # "tcp" or "unix"
    token: str
    hosts: frozenset[str]  # acceptable Host headers (TCP)
    open_metrics: bool = False
    allow_uids: frozenset[int] = frozenset()

    @classmethod
    def for_listener(cls, cfg: ShmkvConfig, url: str, token: str) -> Gate:
        """The gate of a bound listener (`url`: what ControllerServer bound)."""
        kind, _where, _port = parse_listen(cfg.listen)
        hosts: set[str] = set()
        if kind == "tcp":
            parts = urlsplit(url)
            host, port = parts.hostname or "", parts.port
            names = {host, "localhost"} if ipaddress.ip_address(host).is_loopback else {host}
            names |= {"127.0.0.1"} if host in ("127.0.0.1", "localhost") else set()
            for n in names:
                shown = f"[{n}]" if ":" in n else n
                hosts |= {shown, f"{shown}:{port}"}
        return cls(kind, token, frozenset(hosts), cfg.controller_open_metrics, frozenset(cfg.controller_allow_uids))

    def uid_allowed(self, uid: int | None) -> bool:
        return uid is not None and (uid in (os.geteuid(), 0) or uid in self.allow_uids)

    @staticmethod
    def trusted_uid(uid: int | None) -> bool:
        """Ours or root's: clients that can hold the token (other uids cannot read its file)."""
        return uid in (os.geteuid(), 0)

    def check(self, path: str, headers: list[tuple[bytes, bytes]]) -> tuple[int, str] | None:
        """None when the request may run; else (status, message) to refuse it with."""
        if self.kind != "tcp":
            return None  # a unix socket's peer is checked when it connects
        values: dict[bytes, list[bytes]] = {}
        for k, v in headers:
            values.setdefault(k.lower(), []).append(v)
        host = values.get(b"host", [b""])
        if len(host) != 1 or host[0].decode("latin-1").lower() not in self.hosts:
            return 403, "the Host header does not name this controller's listen address"
        origin = values.get(b"origin")
        if origin is not None and not all(_local_origin(o.decode("latin-1")) for o in origin):
            return 403, "cross-origin requests are refused"
        path = path.rstrip("/") or "/"
        if path in OPEN_PATHS or (self.open_metrics and path == "/metrics"):
            return None
        auth = values.get(b"authorization", [b""])
        scheme, _, given = auth[0].decode("latin-1").partition(" ")
        if len(auth) != 1 or scheme.lower() != "bearer" or not given.strip():
            return 401, "this endpoint needs `Authorization: Bearer <token>` (the token file: see README)"
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            return 401, "wrong controller token"
        return None


def _local_origin(origin: str) -> bool:
    """An Origin naming a loopback host (a page served from this host itself)."""
    try:
        host = urlsplit(origin).hostname or ""
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False

