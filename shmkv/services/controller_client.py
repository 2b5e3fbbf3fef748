"""`shmkv ctl`: a client of the daemon's controller that sends the token by itself.

    shmkv ctl GET /stats
    shmkv ctl POST /lookup '{"tokens": [1, 2, 3]}'
    shmkv ctl --cache shmkv-prod --listen unix:/run/shmkv/ctl.sock GET /namespaces

The address and the token come from the same settings the daemon reads
(--config, --cache, --listen, SHMKV_* variables): the token from its 0600
file (shmkv.services.controller_auth). request() is the same client for
Python code (the benchmarks use it).
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import stat
import sys
from typing import Any

from shmkv.config import ShmkvConfig, load_config
from shmkv.config_values import parse_listen
from shmkv.errors import PermissionDeniedError, ShmkvError
from shmkv.services.controller_auth import owner_socket_path, peer_uid, read_token, tcp_peer_uid


class _UnixConnection(http.client.HTTPConnection):
    def __init__(self, path: str, timeout: float) -> None:
        super().__init__("localhost", timeout=timeout)
        self._path = path

    def connect(self) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(self.timeout)
        self.sock.connect(self._path)


def connect(url: str, timeout: float = 60.0) -> http.client.HTTPConnection:
    """A connection to a controller URL (http://host:port or unix:/path)."""
    if url.startswith("unix:"):
        return _UnixConnection(url[5:], timeout)
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return http.client.HTTPConnection(host.strip("[]"), int(port), timeout=timeout)


def url_of(cfg: ShmkvConfig, *, owner_socket: bool = True) -> str:
    """Where to reach the daemon of `cfg`: its owner socket when there is one
    of ours (no other uid's connections queue before ours there), else the
    configured listener."""
    owner = owner_socket_path(cfg) if owner_socket else None
    if owner is not None:
        try:
            st = os.lstat(owner)
        except OSError:
            st = None
        if st is not None and stat.S_ISSOCK(st.st_mode) and st.st_uid == os.geteuid():
            return f"unix:{owner}"
    kind, where, port = parse_listen(cfg.listen)
    if kind == "unix":
        return f"unix:{where}"
    return f"http://{'[' + where + ']' if ':' in where else where}:{port}"


def check_server(conn: http.client.HTTPConnection, url: str) -> None:
    """The process that answers at `url` is of our uid or root's, or
    PermissionDeniedError: nothing (the token least of all) goes to another
    user's listener, whether it took the port while the daemon was down or
    planted a socket at its path. TCP: the uid of the socket at the other end
    (netlink sock_diag); a unix socket: its peer's credentials (SO_PEERCRED)."""
    me = os.geteuid()
    if url.startswith("unix:"):
        uid, how = peer_uid(conn.sock), "the process at the other end of"
    else:
        uid, how = tcp_peer_uid(conn.sock), "the socket listening at"
    if uid is None:
        raise PermissionDeniedError(f"cannot tell who owns {how} {url}: not sending it the controller token")
    if uid not in (me, 0):
        raise PermissionDeniedError(f"{how} {url} belongs to uid {uid}, not to us (uid {me}) or root: another "
                                    "user's listener, not our daemon; not sending it the controller token")


def request(url: str, token: str | None, method: str, path: str, body: Any = None, *,
            timeout: float = 60.0) -> tuple[int, Any]:
    """One request; (status, the JSON answer, or the text of a non-JSON one).
    With a token, the server is checked first (check_server)."""
    conn = connect(url, timeout)
    if token or url.startswith("unix:"):
        try:
            conn.connect()
            check_server(conn, url)
        except BaseException:
            conn.close()
            raise
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    data = None if body is None else (body if isinstance(body, bytes) else json.dumps(body).encode())
    if data is not None:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=data, headers=headers)
        resp = conn.getresponse()
        text = resp.read().decode()
    finally:
        conn.close()
    ctype = resp.getheader("Content-Type") or ""
    return resp.status, (json.loads(text) if ctype.startswith("application/json") else text)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shmkv ctl", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of shmkv settings (the daemon's)")
    ap.add_argument("--cache", help="cache name (default shmkv-<uid>)")
    ap.add_argument("--listen", help="the daemon's controller address (default 127.0.0.1:7470)")
    ap.add_argument("method", choices=("GET", "POST"))
    ap.add_argument("path", help="endpoint, e.g. /stats")
    ap.add_argument("body", nargs="?", help="JSON body of a POST")
    args = ap.parse_args(argv)
    explicit = {"config_file": args.config, "cache_name": args.cache, "listen": args.listen}
    try:
        cfg = load_config({k: v for k, v in explicit.items() if v is not None})
        token = read_token(cfg)
        body = None if args.body is None else json.loads(args.body)
        status, answer = request(url_of(cfg), token, args.method, args.path, body)
    except (ShmkvError, OSError, ValueError) as e:
        print(f"shmkv ctl: {e}", file=sys.stderr)
        return 2
    print(answer if isinstance(answer, str) else json.dumps(answer, indent=2))
    return 0 if status < 400 else 1
