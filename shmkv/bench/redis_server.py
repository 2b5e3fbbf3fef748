"""A throwaway redis-server (or valkey-server) on a free loopback port, for
the remote tier's tests and benchmark. Nothing is persisted; kill() and
start() again reuse the port (a server that died and came back)."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time

import redis


class PrivateRedis:
    def __init__(self, workdir: str) -> None:
        self.binary = shutil.which("redis-server") or shutil.which("valkey-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed: scripts/setup.sh installs Debian's package")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.workdir = workdir
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None
        self.start()

    def start(self, timeout_s: float = 30.0) -> None:
        """Start the server and return once it answers PING."""
        self.proc = subprocess.Popen(
            [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.workdir], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_timeout=1, socket_connect_timeout=1)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.RedisError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise RuntimeError(f"{self.binary} did not start on port {self.port}") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, socket_timeout=5)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)
