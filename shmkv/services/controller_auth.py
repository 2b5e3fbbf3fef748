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
<runtime dir>/<cache name>.controller-token. The daemon writes a new one at
every start, once it holds the daemon role (a token captured from an earlier
run, or sent to a squatter while the daemon was down, is worth nothing
after a restart), replacing the file by a rename, never writing through
whatever is at the path. Clients (shmkv.services.controller_client) read it
at each use. Both refuse a token file that someone else could have written
or read, and a path that is not a regular file (a FIFO is never opened
blocking).
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

from shmkv.config import ShmkvConfig
from shmkv.config_values import parse_listen
from shmkv.errors import ConfigError, PermissionDeniedError
from shmkv.paths import read_secret_file, runtime_dir, runtime_dir_path

OPEN_PATHS = frozenset({"/health"})


def token_path(cfg: ShmkvConfig) -> str:
    """Where the controller token of this configuration lives."""
    if cfg.controller_token_file:
        return cfg.controller_token_file
    return os.path.join(runtime_dir().path, f"{cfg.cache_name}.controller-token")


def owner_socket_path(cfg: ShmkvConfig) -> str | None:
    """The owner's own controller socket (0600, in the private runtime
    directory), served beside a TCP listener or a unix one open to other
    uids; None when the configured listener is already the owner's alone."""
    kind, _where, _port = parse_listen(cfg.listen)
    if kind == "unix" and not cfg.controller_allow_uids:
        return None
    return os.path.join(runtime_dir_path(), f"{cfg.cache_name}.controller.sock")


def read_token(cfg: ShmkvConfig) -> str:
    """The controller token, for a client. Raises ConfigError naming the file
    when there is none (no daemon has started with this configuration)."""
    path = token_path(cfg)
    _check_token_dir(path)
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


def _check_token_dir(path: str) -> None:
    """The token file's directory (and its parents) must be ones no other
    user can change: whoever can, can remove or replace the token (a daemon
    nobody can reach, or clients sending the token to a file they chose)."""
    from shmkv.paths import check_trusted_dir

    directory = os.path.dirname(path) or "."
    try:
        check_trusted_dir(directory)
    except FileNotFoundError:
        raise ConfigError(f"controller token file {path}: its directory {directory} does not exist") from None
    except PermissionDeniedError as e:
        raise PermissionDeniedError(f"controller token file {path}: {e}") from None


def check_token_place(cfg: ShmkvConfig) -> None:
    """Before a daemon starts anything: the token path's directory must be
    one no other user can change, and what is at the path, if anything, must
    be a token file of ours that nobody else can read or write
    (PermissionDeniedError naming it otherwise)."""
    path = token_path(cfg)
    _check_token_dir(path)
    try:
        read_secret_file(path, "controller token file",
                         fix=f"remove it (the daemon writes a new one at each start) or `chmod 600 {path}`")
    except FileNotFoundError:
        pass


def rotate_token(cfg: ShmkvConfig) -> str:
    """A new token for this daemon's run: written 0600 to a file of its own
    beside the token path, then renamed over it (a link or anything else
    planted at the path is replaced, not written through)."""
    path = token_path(cfg)
    directory, name = os.path.split(path)
    token = secrets.token_urlsafe(32)
    tmp = os.path.join(directory, f".{name}.{os.getpid()}.new")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:  # left by a process of our pid that died mid-rotation
        os.unlink(tmp)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)
        os.write(fd, (token + "\n").encode())
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
    except OSError as e:
        if fd >= 0:
            os.close(fd)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise PermissionDeniedError(f"controller token file {path}: cannot write a new token there "
                                    f"({e.strerror}); use a controller_token_file in a directory of yours") from None
    return token


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a unix socket."""
    try:
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    except OSError:
        return None
    return struct.unpack("3i", creds)[1]


_NETLINK_SOCK_DIAG, _SOCK_DIAG_BY_FAMILY, _NLMSG_ERROR = 4, 20, 2
_NLM_F_REQUEST = 1
_INET_DIAG_NOCOOKIE = 0xFFFFFFFF


def _diag_uid(family: int, local: tuple, remote: tuple) -> int | None:
    """The uid of the TCP socket whose own address is `local` and whose
    peer is `remote`, asked of the kernel by exactly that 4-tuple (netlink
    sock_diag: one answer, whatever the number of sockets on the host)."""
    def addr16(host: str) -> bytes:
        return socket.inet_pton(family, host).ljust(16, b"\0")

    sockid = (struct.pack("!HH", local[1], remote[1]) + addr16(local[0]) + addr16(remote[0])
              + struct.pack("=III", 0, _INET_DIAG_NOCOOKIE, _INET_DIAG_NOCOOKIE))
    req = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, 0xFFFFFFFF) + sockid
    msg = struct.pack("=IHHII", 16 + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0) + req
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as nl:
        nl.settimeout(1.0)
        nl.sendto(msg, (0, 0))
        data = nl.recv(65536)
    length, kind = struct.unpack_from("=IH", data, 0)
    if kind == _NLMSG_ERROR or kind != _SOCK_DIAG_BY_FAMILY or length < 16 + 72:
        return None
    # inet_diag_msg: family, state, timer, retrans (4 bytes), sockid (48), expires, rqueue, wqueue, uid, inode
    return struct.unpack_from("=I", data, 16 + 4 + 48 + 12)[0]


def tcp_peer_uid(sock: socket.socket) -> int | None:
    """The uid owning the other end of a loopback TCP connection (the socket
    whose own address is our peer's and whose peer is us): the daemon asks it
    of a client, a client of the daemon before it sends the token. From
    netlink sock_diag by the exact 4-tuple, else from /proc/net/tcp{,6};
    None when it cannot be told."""
    try:
        peer, local = sock.getpeername(), sock.getsockname()
        return _diag_uid(sock.family, peer, local)
    except (OSError, ValueError, struct.error):
        pass
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

    def check(self, path: str, headers: list[tuple[bytes, bytes]], method: str = "GET") -> tuple[int, str] | None:
        """None when the request may run; else (status, message) to refuse it
        with. A request that needs no token (an open path) takes no body: it
        is refused from its head, so nobody unauthenticated costs more than
        a head (no body is read, buffered or waited for)."""
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
            framed = any(int(v) > 0 if v.strip().isdigit() else True for v in values.get(b"content-length", []))
            if method not in ("GET", "HEAD") or framed or b"transfer-encoding" in values:
                return 405, f"{path} takes GET without a body"
            return None
        auth = values.get(b"authorization", [b""])
        scheme, _, given = auth[0].decode("latin-1").partition(" ")
        if len(auth) != 1 or scheme.lower() != "bearer" or not given.strip():
            return 401, "this endpoint needs `Authorization: Bearer <token>` (the token file: see docs/operating.md)"
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

