"""The controller's HTTP transport: FastAPI routes served by uvicorn.

Owns the sockets, the routes' typed bodies and the limits a server on a
shared host needs; the answers themselves are shmkv.controller's.

Invariants:
  * it listens only on loopback TCP or on a unix socket that is born 0600 in
    a directory only we can change (checked before binding); beside a TCP
    listener (or a unix one open to other uids) it also serves the owner's
    own socket (owner_socket_path: 0600 in the private runtime directory),
    so that no other uid's connections stand between the owner and its
    daemon: `shmkv ctl` uses it when it is there;
  * every request passes shmkv.services.controller_auth's gate (token, Host,
    Origin; a unix socket's peer uid when it connects) before its body is read;
  * a body is read whole, as its headers frame it (uvicorn's parser: chunked
    or Content-Length), before anything runs: a body over MAX_BODY_BYTES is a
    413 (refused from Content-Length before it is read), one that does not
    arrive within IO_TIMEOUT_S is a 408, and one cut short never runs;
  * a connection must deliver each request head within IO_TIMEOUT_S of
    opening or of its last answer, or it is closed (a slow or idle client
    holds no slot for long); at MAX_CONNECTIONS open connections a new one
    closes the oldest that has no request running (an idle or half-sent
    one), so clients that hold connections cannot lock /health out; another
    uid (a TCP peer's, from netlink sock_diag) holds at most
    MAX_FOREIGN_CONNECTIONS, other uids together leave RESERVED_CONNECTIONS
    free, and each gets FOREIGN_HEAD_TIMEOUT_S for each request head; at the
    cap, a connection of ours or root's closes another uid's oldest, busy or
    not, and anyone else is answered 503;
  * a uid other than ours and root's gets one answer per connection (then
    the connection closes: pipelined requests behind it are dropped unread)
    and FOREIGN_RATE connections a second (FOREIGN_BURST at once); over that
    budget a connection closes unanswered, counted `throttled_connections`;
  * an answer that is not written out within IO_TIMEOUT_S (another uid's:
    FOREIGN_HEAD_TIMEOUT_S) aborts its connection, counted
    `write_timeouts`: a client that does not read holds nothing;
  * a request that needs no token (/health) takes no body: refused from its
    head, so nobody unauthenticated makes the server read or buffer a body;
  * /health is answered on the event loop itself, never behind busy workers;
  * endpoints run in a thread pool, so a long /flush does not stop /health;
    stop() lets the requests in flight finish for up to IO_TIMEOUT_S.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import resource
import socket
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from uvicorn.protocols.http.h11_impl import H11Protocol

from shmkv.config_values import parse_listen
from shmkv.errors import RequestError
from shmkv.paths import check_trusted_dir
from shmkv.services.controller import (
    JSON,
    MAX_BODY_BYTES,
    Controller,
    EmptyArgs,
    MoveArgs,
    NamespaceArgs,
    RecodeArgs,
    TokensArgs,
    request_error,
)
from shmkv.services.controller_auth import Gate, peer_uid, tcp_peer_uid

log = logging.getLogger("shmkv.controller")

IO_TIMEOUT_S = 10.0  # for a request head, and for a whole body
FOREIGN_HEAD_TIMEOUT_S = 2.0  # for each request head of another uid's connection (it cannot hold the token)
MAX_CONNECTIONS = 256
MAX_FOREIGN_CONNECTIONS = 16  # per other uid: one neighbour cannot fill the connection cap
RESERVED_CONNECTIONS = 64  # of the cap, never given to other uids (many uids together cannot fill it either)
FOREIGN_RATE = 20.0  # connections a second per other uid (each gets one answer), refilled continuously
FOREIGN_BURST = 20  # ... and at most this many at once
BACKLOG = 128


# ------------------------------------------------------------------ app --
def make_app(controller: Controller, gate: Gate | None = None) -> FastAPI:
    """The routes of controller.routes, each with its typed body."""
    app = FastAPI(title="shmkv controller", docs_url=None, redoc_url=None, openapi_url=None)

    def answer(path: str, args: Any) -> Response:
        status, ctype, out = controller.run(path, args)
        return Response(out, status_code=status, media_type=ctype)

    async def run(path: str, args: Any) -> Response:
        return await run_in_threadpool(answer, path, args)

    @app.get("/health")
    async def health() -> Response:
        return answer("/health", None)  # cheap and lock-free: never queued behind the thread pool

    @app.get("/stats")
    async def stats() -> Response:
        return await run("/stats", None)

    @app.get("/metrics")
    async def metrics() -> Response:
        return await run("/metrics", None)

    @app.get("/namespaces")
    async def namespaces() -> Response:
        return await run("/namespaces", None)

    @app.post("/lookup")
    async def lookup(args: TokensArgs) -> Response:
        return await run("/lookup", args)

    @app.post("/clear")
    async def clear(args: NamespaceArgs | None = None) -> Response:  # no body: everything
        return await run("/clear", args or NamespaceArgs())

    @app.post("/pin")
    async def pin(args: TokensArgs) -> Response:
        return await run("/pin", args)

    @app.post("/unpin")
    async def unpin(args: TokensArgs) -> Response:
        return await run("/unpin", args)

    @app.post("/move")
    async def move(args: MoveArgs) -> Response:
        return await run("/move", args)

    @app.post("/flush")
    async def flush(args: EmptyArgs | None = None) -> Response:
        return await run("/flush", args or EmptyArgs())

    @app.post("/compress")
    async def compress(args: RecodeArgs | None = None) -> Response:  # no body: the only namespace, whole
        return await run("/compress", args or RecodeArgs())

    @app.post("/decompress")
    async def decompress(args: RecodeArgs | None = None) -> Response:
        return await run("/decompress", args or RecodeArgs())

    models = {path: model for path, (_m, model, _fn) in controller.routes.items()}
    assert set(models) == {r.path for r in app.routes}, "every controller route is served"

    def refuse(e: RequestError) -> Response:
        status, ctype, out = controller.refuse(e)
        return Response(out, status_code=status, media_type=ctype)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> Response:
        # one message naming the field, as Controller.handle gives it
        return refuse(request_error(list(exc.errors()), models.get(request.url.path.rstrip("/")) or EmptyArgs))

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, exc: HTTPException) -> Response:
        path = request.url.path
        if exc.status_code == 404:
            message = f"no endpoint {path!r}; endpoints: {', '.join(sorted(controller.routes))}"
        elif exc.status_code == 405 and path.rstrip("/") in controller.routes:
            message = f"{path} takes {controller.routes[path.rstrip('/')][0]}, not {request.method}"
        elif isinstance(exc.__cause__, RecursionError):
            message = "request body is JSON nested too deeply"
        else:
            message = str(exc.detail)
        return refuse(RequestError(message, exc.status_code))

    return _BodyLimits(app, controller, gate)


class _BodyLimits:
    """ASGI middleware: pass the gate, then read each request's body whole,
    within the size and time limits, before the app sees it (then hand it
    over in one piece)."""

    def __init__(self, app: Any, controller: Controller, gate: Gate | None) -> None:
        self.app = app
        self.controller = controller
        self.gate = gate

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        refused = self.gate.check(scope["path"], scope["headers"], scope["method"]) if self.gate is not None else None
        if refused is not None:
            return await self._refuse(send, *refused)
        declared = [v for k, v in scope["headers"] if k == b"content-length"]
        if declared and declared[0].isdigit() and int(declared[0]) > MAX_BODY_BYTES:
            return await self._refuse(send, 413, f"a body of {int(declared[0])} bytes is over the limit of "
                                                 f"{MAX_BODY_BYTES}")
        body = bytearray()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + IO_TIMEOUT_S
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    message = await receive()
            except TimeoutError:
                return await self._refuse(send, 408, f"the request body did not arrive within {IO_TIMEOUT_S:g} s "
                                                     f"({len(body)} bytes read)")
            if message["type"] == "http.disconnect":
                self.controller.count(400)  # cut short: nothing runs, nobody to answer
                log.debug("shmkv: controller client left after %d body bytes of %s", len(body), scope["path"])
                return None
            body += message.get("body", b"")
            if len(body) > MAX_BODY_BYTES:
                return await self._refuse(send, 413, f"the request body is over the limit of {MAX_BODY_BYTES} bytes")
            if not message.get("more_body", False):
                break

        delivered = False

        async def replay() -> dict:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        # Bodies are JSON whatever the client says (curl -d sends a form type):
        # FastAPI parses only a body labelled JSON.
        headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
        scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        return await self.app(scope, replay, send)

    async def _refuse(self, send: Any, status: int, message: str) -> None:
        self.controller.count(status)
        out = (json.dumps({"error": message}) + "\n").encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", JSON.encode()), (b"content-length", str(len(out)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": out})


# ------------------------------------------------------------ transport --
class _UidBudget:
    """Token buckets of connections per uid (FOREIGN_RATE a second, FOREIGN_BURST at once)."""

    def __init__(self, rate: float = FOREIGN_RATE, burst: int = FOREIGN_BURST) -> None:
        self.rate, self.burst = rate, burst
        self.buckets: dict[int | None, tuple[float, float]] = {}  # uid -> (tokens, when)

    def take(self, uid: int | None, now: float) -> bool:
        tokens, then = self.buckets.get(uid, (float(self.burst), now))
        tokens = min(float(self.burst), tokens + (now - then) * self.rate)
        if len(self.buckets) > 4096:  # uids long quiet are full again: forget them
            self.buckets = {u: b for u, b in self.buckets.items() if b[0] + (now - b[1]) * self.rate < self.burst}
        if tokens < 1.0:
            self.buckets[uid] = (tokens, now)
            return False
        self.buckets[uid] = (tokens - 1.0, now)
        return True


class _HeadDeadline(H11Protocol):
    """uvicorn's h11 protocol, plus: each request head must arrive within
    IO_TIMEOUT_S of the connection opening or of the last answer (uvicorn's
    keep-alive timer stops at the first byte, so a client sending one byte a
    second would otherwise hold its connection for ever); an answer must be
    written out within a deadline too; another uid's connection gets one
    answer, within its uid's connection budget; and the requests h11 refuses
    as malformed are counted with the controller's."""

    controller: Controller  # set on the subclass ControllerServer makes
    gate: Gate | None
    live: dict  # this server's open connections (protocol -> None), oldest first
    cap: int
    budget: _UidBudget  # other uids' connections

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        sock = transport.get_extra_info("socket")
        self.peer: int | None = None
        self.trusted = True  # a client that can hold the token: ours, root's, or a unix peer let in
        self.one_answer = False  # another uid than ours and root's: the connection closes after one answer
        self.lost = False
        self.head_timeout_s = IO_TIMEOUT_S
        if self.gate is not None and sock is not None and sock.family == socket.AF_UNIX:
            uid = peer_uid(sock)
            allowed = self.gate.uid_allowed(uid) if self.gate.kind == "unix" else Gate.trusted_uid(uid)
            if not allowed:
                self.controller.count(403)
                log.warning("shmkv: controller refused a connection from uid %s (allowed: ours, root, "
                            "controller_allow_uids)", uid)
                transport.close()
                return
            self.peer = uid
            self.one_answer = not Gate.trusted_uid(uid)
        elif self.gate is not None:
            self.peer = tcp_peer_uid(sock)
            self.trusted = Gate.trusted_uid(self.peer)
            self.one_answer = not self.trusted
            if not self.trusted:
                self.head_timeout_s = min(FOREIGN_HEAD_TIMEOUT_S, IO_TIMEOUT_S)
                mine = [p for p in self.live if p.peer == self.peer]
                if len(mine) >= MAX_FOREIGN_CONNECTIONS and not self._make_room(mine):
                    return
                foreign = [p for p in self.live if not p.trusted]
                if len(foreign) >= self.cap - min(RESERVED_CONNECTIONS, self.cap // 2) and not self._make_room(foreign):
                    return
        if self.one_answer and not self.budget.take(self.peer, self.loop.time()):
            self.controller.count_transport("throttled_connections")
            transport.abort()  # nothing written: the cheapest answer to a uid over its budget
            return
        if len(self.live) >= self.cap:
            # the owner always gets in: at the cap, its connection closes another uid's oldest, busy or not
            foreign = [p for p in self.live if not p.trusted] if self.trusted else []
            if not self._make_room(list(self.live), evict_busy=foreign):
                return
        self.live[self] = None
        self._arm()

    def _make_room(self, among: list[_HeadDeadline], evict_busy: list[_HeadDeadline] | None = None) -> bool:
        """Close the oldest of `among` that runs no request, else the oldest
        of `evict_busy`; with neither, refuse this connection with a 503."""
        victim = next((p for p in among if p._idle()), None) or next(iter(evict_busy or ()), None)
        if victim is None:
            self.controller.count(503)
            out = b'{"error": "the controller is at its connection limit; try again"}\n'
            self.transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
                                 b"Content-Length: " + str(len(out)).encode() + b"\r\nConnection: close\r\n\r\n" + out)
            self._close_within(self.head_timeout_s)
            return False
        if victim.transport.get_write_buffer_size():
            victim.transport.abort()  # a close would wait for a client that does not read
        else:
            victim.transport.close()
        self.live.pop(victim, None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        self.live.pop(self, None)
        super().connection_lost(exc)

    def handle_events(self) -> None:
        super().handle_events()
        if self.one_answer and self.cycle is not None and self.cycle.keep_alive:
            # one answer: it says so (Connection: close), and whatever was pipelined behind it is never parsed
            self.cycle.keep_alive = False
            if (b"connection", b"close") not in self.headers:
                self.headers.append((b"connection", b"close"))

    def _idle(self) -> bool:
        """No request of this connection is running (its head is not complete, or it waits for the next)."""
        return self.cycle is None or self.cycle.response_complete

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.transport.is_closing():
            self._close_within(self.head_timeout_s)
        else:
            self._arm()
            if self.transport.get_write_buffer_size():
                self._write_deadline()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._write_deadline()

    def _write_deadline(self) -> None:
        """Within the deadline the client must read (the buffer shrink), or the connection is aborted."""
        self.loop.call_later(self.head_timeout_s, self._abort_if_unwritten, self.transport.get_write_buffer_size())

    def _abort_if_unwritten(self, buffered_then: int) -> None:
        unread = self.transport.get_write_buffer_size()
        if not self.lost and not self.transport.is_closing() and unread and unread >= buffered_then:
            self.controller.count_transport("write_timeouts")
            log.info("shmkv: controller aborted a connection of uid %s that did not read its answer in %g s",
                     self.peer, self.head_timeout_s)
            self.transport.abort()

    def _close_within(self, seconds: float) -> None:
        """Close after the answer is written; abort if it is not written within `seconds`."""
        self.transport.close()
        self.loop.call_later(seconds, self._abort_if_open)

    def _abort_if_open(self) -> None:
        if not self.lost:
            self.controller.count_transport("write_timeouts")
            self.transport.abort()

    def send_400_response(self, msg: str) -> None:
        if self.cycle is None or self.cycle.response_complete:  # else _BodyLimits counts the disconnect
            self.controller.count(400)
        super().send_400_response(msg)

    def _arm(self) -> None:
        self.loop.call_later(self.head_timeout_s, self._head_deadline, self.cycle)

    def _head_deadline(self, cycle_then: Any) -> None:
        if self.cycle is cycle_then and not self.transport.is_closing():  # no new request head since
            self.transport.close()


class _Server(uvicorn.Server):
    """uvicorn's server without its signal handlers: the daemon owns SIGTERM
    and SIGINT and stops the server through stop()."""

    @contextlib.contextmanager
    def capture_signals(self):  # noqa: ANN201 - uvicorn's signature
        yield

    def stop(self) -> None:
        self.should_exit = True


class ControllerServer:
    """A bound controller server: serve() blocks until stop(); close() removes the socket."""

    def __init__(self, listen: str, controller: Controller, token: str | None = None,
                 owner_socket: str | None = None) -> None:
        """`token`: the bearer token TCP clients must send (None: no gate, for
        in-process tests of the transport alone). `owner_socket`: a path for
        the owner's own unix socket (0600; only our uid and root's connections
        are served there), beside `listen`."""
        self.controller = controller
        allow = tuple(controller.cfg.controller_allow_uids) if token is not None else ()
        self.sock, self.url = _bind(listen, allow)
        self.owner_sock: socket.socket | None = None
        self.owner_url = ""
        if owner_socket is not None:
            try:
                self.owner_sock, self.owner_url = _bind(f"unix:{owner_socket}")
            except OSError as e:  # the configured listener still serves; the owner's tools fall back to it
                log.warning("shmkv: controller: cannot serve the owner's socket %s (%s); clients use %s",
                            owner_socket, e, self.url)
        gate = Gate.for_listener(controller.cfg, self.url, token) if token is not None else None
        cap = _connection_cap()
        protocol = type("ControllerProtocol", (_HeadDeadline,),
                        {"controller": controller, "gate": gate, "live": {}, "cap": cap,
                         "budget": _UidBudget()})
        config = uvicorn.Config(make_app(controller, gate), http=protocol, lifespan="off", access_log=False,
                                log_config=None, log_level=logging.WARNING, limit_concurrency=None,  # our cap: above
                                timeout_keep_alive=int(IO_TIMEOUT_S), server_header=False, backlog=BACKLOG,
                                timeout_graceful_shutdown=int(IO_TIMEOUT_S))
        self.server = _Server(config)

    def serve(self) -> None:
        self.server.run(sockets=[self.sock, *([self.owner_sock] if self.owner_sock is not None else [])])

    def stop(self) -> None:
        self.server.stop()

    def close(self) -> None:
        for sock, url in ((self.sock, self.url), (self.owner_sock, self.owner_url)):
            if sock is None:
                continue
            sock.close()
            if url.startswith("unix:"):
                with contextlib.suppress(OSError):
                    os.unlink(url[5:])


def _bind(listen: str, allow_uids: tuple[int, ...] = ()) -> tuple[socket.socket, str]:
    """A listening socket for `listen` and the URL it answers on. A unix
    socket is 0600, or 0666 when `allow_uids` names other uids (connecting
    needs write permission on the file; each connection's uid is then checked
    against ours, root's and those, SO_PEERCRED, before anything is read).
    Those uids must be able to reach the socket's directory: the operator's
    choice of directory is the other half of the grant."""
    kind, where, port = parse_listen(listen)
    if kind == "unix":
        parent = os.path.dirname(where) or "."
        if not os.path.isdir(parent):
            raise OSError(f"directory {parent} of the controller socket does not exist")
        check_trusted_dir(parent)  # nobody else can swap the socket's directory
        if os.path.lexists(where):
            st = os.lstat(where)
            if not (st.st_mode & 0o170000 == 0o140000 and st.st_uid == os.geteuid()):
                raise OSError(f"{where} exists and is not our socket; remove it or pick another path")
            os.unlink(where)  # a socket left by a daemon that died (we hold the daemon lock)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)  # the socket file is born 0600
        try:
            sock.bind(where)
        except OSError:
            sock.close()
            raise
        finally:
            os.umask(old)
        os.chmod(where, 0o666 if allow_uids else 0o600)
        if allow_uids:
            log.info("shmkv: controller socket %s open to uids %s besides ours and root (controller_allow_uids; "
                     "every connection's uid is checked)", where, ",".join(map(str, allow_uids)))
        sock.listen(BACKLOG)
        return sock, f"unix:{where}"
    family = socket.AF_INET6 if ":" in where else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((where, port))
    except OSError:
        sock.close()
        raise
    sock.listen(BACKLOG)
    host, bound_port = sock.getsockname()[:2]
    return sock, f"http://{'[' + host + ']' if family == socket.AF_INET6 else host}:{bound_port}"


def _connection_cap() -> int:
    """MAX_CONNECTIONS, or fewer when the descriptor limit (raised to its hard
    limit first) leaves less room: the cap, not EMFILE, must be what bites."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError):
            pass
    if soft == resource.RLIM_INFINITY:
        return MAX_CONNECTIONS
    return max(4, min(MAX_CONNECTIONS, soft - 64))
