"""A rate-limited TCP link for the benchmarks: a loopback proxy in front of
a server that carries at most `rate_bytes_per_s` in each direction, shared
by every connection it carries (as one host's network link is), so a remote
tier can be measured over a slower wire than loopback. Threads of its own;
closing it closes every connection it carries."""

from __future__ import annotations

import socket
import threading
import time

CHUNK = 64 << 10  # bytes moved per step (the bucket's granularity)


class SlowLink:
    """Listen on 127.0.0.1:<port>, forward to (host, port) at the given rate."""

    def __init__(self, host: str, port: int, rate_bytes_per_s: float) -> None:
        if rate_bytes_per_s <= 0:
            raise ValueError(f"rate {rate_bytes_per_s!r}: expected bytes per second > 0")
        self.target = (host, port)
        self.rate = float(rate_bytes_per_s)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._lock = threading.Lock()
        # per direction: when the link is next free (monotonic s); a step of n bytes occupies n / rate of it
        self._free_at = {"up": 0.0, "down": 0.0}
        self._closed = False
        threading.Thread(target=self._accept, name="shmkv-slow-link", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            try:
                server = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            for s in (client, server):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    client.close()
                    server.close()
                    return
                self._sockets += [client, server]
            for src, dst, way in ((client, server, "up"), (server, client, "down")):
                threading.Thread(target=self._pump, args=(src, dst, way), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, way: str) -> None:
        """Copy src -> dst, each step after the link's direction has carried the steps before it."""
        try:
            while True:
                data = src.recv(CHUNK)
                if not data:
                    break
                with self._lock:
                    start = max(self._free_at[way], time.monotonic())
                    done = self._free_at[way] = start + len(data) / self.rate
                wait = done - time.monotonic()
                if wait > 0:
                    time.sleep(wait)  # the link is busy carrying these bytes
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        with self._lock:
            self._closed = True
            sockets, self._sockets = self._sockets, []
        self._listener.close()
        for s in sockets:
            s.close()
