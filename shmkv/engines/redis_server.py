"""Throwaway redis-servers (or valkey-servers) on free loopback ports, for
the remote tier's tests and benchmark: one server (PrivateRedis; kill() and
start() again reuse the port: a server that died and came back), or a
cluster (PrivateRedisCluster). Nothing is persisted."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import time
from collections.abc import Callable

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


class PrivateRedisCluster:
    """A throwaway Redis Cluster on loopback: `masters` primaries (each with
    `replicas` replicas), slots spread by redis-cli, nothing persisted."""

    def __init__(self, workdir: str, masters: int = 3, replicas: int = 0, node_timeout_ms: int = 1000) -> None:
        binary = shutil.which("redis-server") or shutil.which("valkey-server")
        cli = shutil.which("redis-cli") or shutil.which("valkey-cli")
        if binary is None or cli is None:
            raise FileNotFoundError("redis-server and redis-cli are needed: scripts/setup.sh installs them")
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}
        rng = random.Random()
        while len(self.ports) < masters * (1 + replicas):  # a node needs its port and its bus port (+10000) free
            port = rng.randrange(20000, 30000)
            try:
                with socket.socket() as a, socket.socket() as b:
                    a.bind(("127.0.0.1", port))
                    b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
            if port not in self.ports:
                self.ports.append(port)
        for port in self.ports:
            d = os.path.join(workdir, str(port))
            os.makedirs(d, exist_ok=True)
            self.procs[port] = subprocess.Popen(
                [binary, "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
                 "--cluster-config-file", "nodes.conf", "--cluster-node-timeout", str(node_timeout_ms),
                 "--save", "", "--appendonly", "no", "--dir", d],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for port in self.ports:
            self._wait(lambda p=port: subprocess.run([cli, "-p", str(p), "ping"], capture_output=True,
                                                     text=True).stdout.strip() == "PONG")
        r = subprocess.run([cli, "--cluster", "create", *[f"127.0.0.1:{p}" for p in self.ports],
                            "--cluster-replicas", str(replicas), "--cluster-yes"],
                           capture_output=True, text=True, timeout=120)
        if r.returncode:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-2000:]}{r.stderr[-2000:]}")
        self.cli = cli
        self._wait(lambda: all("cluster_state:ok" in self.info(p) for p in self.ports))
        self.url = f"redis://127.0.0.1:{self.ports[0]}/0"

    def info(self, port: int) -> str:
        return subprocess.run([self.cli, "-p", str(port), "cluster", "info"], capture_output=True, text=True).stdout

    @staticmethod
    def _wait(ok: Callable[[], bool], timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not ok():
            if time.monotonic() > deadline:
                raise RuntimeError("the cluster did not come up")
            time.sleep(0.1)  # polling a server process that is starting: bounded above

    def keys_per_node(self) -> dict[int, int]:
        return {p: redis.Redis(port=p, socket_timeout=5).dbsize() for p in self.ports}

    def masters(self) -> list[int]:
        """Ports of the primaries that hold slots."""
        out = subprocess.run([self.cli, "-p", str(self.alive()[0]), "cluster", "nodes"], capture_output=True,
                             text=True).stdout
        return sorted(int(line.split()[1].split(":")[1].split("@")[0]) for line in out.splitlines()
                      if "master" in line.split()[2] and "fail" not in line.split()[2] and len(line.split()) > 8)

    def alive(self) -> list[int]:
        return [p for p, proc in self.procs.items() if proc.poll() is None]

    def kill_node(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait(timeout=30)

    def promote_replica_of(self, dead: int) -> int:
        """Make the dead primary's replica take its slots now (CLUSTER FAILOVER TAKEOVER: no
        waiting for the node timeout); its port."""
        out = subprocess.run([self.cli, "-p", str(self.alive()[0]), "cluster", "nodes"], capture_output=True,
                             text=True).stdout.splitlines()
        node_id = next(line.split()[0] for line in out if f":{dead}@" in line.split()[1])
        replica = next(int(line.split()[1].split(":")[1].split("@")[0]) for line in out if line.split()[3] == node_id)
        r = subprocess.run([self.cli, "-p", str(replica), "cluster", "failover", "takeover"], capture_output=True,
                           text=True)
        if r.stdout.strip() != "OK":
            raise RuntimeError(f"CLUSTER FAILOVER TAKEOVER: {r.stdout}{r.stderr}")
        self.wait_for_failover(dead)
        return replica

    def wait_for_failover(self, dead: int, timeout_s: float = 60.0) -> None:
        """Until a replica has taken over the dead primary's slots (cluster_state ok again);
        masters() counts only primaries that hold slots."""
        self._wait(lambda: dead not in self.masters() and len(self.masters()) == 3
                   and all("cluster_state:ok" in self.info(p) for p in self.alive()), timeout_s)

    def kill(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
