"""Controller latency under many clients, against a daemon process on loopback.

  concurrent_*_ms   p50 / p99 / max latency of POST /lookup from --clients
                    concurrent clients (a new connection per request)
  idle_health_ms    p50 / p99 / max of GET /health while --idle connections
                    are held open and silent
  all_answered      every request got a 200
  attack            with --attack-uids N (root, setpriv): N other uids (as one
                    user's subuid range gives) each keep 16 connections sending
                    bodies nobody authenticated (a declared 16 MiB, trickled) for
                    --attack-seconds, reconnecting as they are closed; with
                    --attack-kind pipeline instead each keeps 16 connections
                    pipelining GET /health (no token needed) as fast as it can,
                    reading every answer; meanwhile the owner's GET /stats and
                    /health latency (ms) as `shmkv ctl` asks them (its own
                    socket) and /health on TCP, the daemon's RSS growth (MiB,
                    peak over before) and its CPU seconds over the attack

The daemon is `python -m shmkv.daemon` with a private cache name, started and
stopped by the benchmark (its segment is unlinked afterwards).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

from shmkv.bench import drop_cache
from shmkv.config import load_config
from shmkv.engines.engine import start_daemon
from shmkv.services.controller_auth import read_token
from shmkv.services.controller_client import request, url_of


def _percentiles(xs: list[float]) -> dict[str, float]:
    xs = sorted(xs)
    pick = lambda q: xs[min(len(xs) - 1, int(q * len(xs)))]  # noqa: E731
    return {"p50": round(pick(0.50) * 1e3, 3), "p99": round(pick(0.99) * 1e3, 3), "max": round(xs[-1] * 1e3, 3)}


def _request(url: str, token: str, method: str, path: str, body: bytes | None) -> tuple[int, float]:
    t0 = time.perf_counter()
    status, _ = request(url, token, method, path, body, timeout=30)
    return status, time.perf_counter() - t0


ATTACKER = r"""
import json, socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
head = f"POST /health HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Length: 16777216\r\n\r\n".encode()
conns, opened, end = [], 0, time.monotonic() + seconds
while time.monotonic() < end:
    while len(conns) < 16:
        try:
            s = socket.create_connection((host, port), timeout=2)
            s.sendall(head)
            s.setblocking(False)
            conns.append(s)
            opened += 1
        except OSError:
            break
    for s in list(conns):
        try:
            s.send(b"x")
            if s.recv(1, socket.MSG_PEEK) == b"":
                raise OSError
        except BlockingIOError:
            pass
        except OSError:
            conns.remove(s)
            s.close()
    time.sleep(0.2)
print(json.dumps({"opened": opened, "answers": 0}))
"""

PIPELINER = r"""
import json, selectors, socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
conns = int(sys.argv[4]) if len(sys.argv) > 4 else 16
burst = f"GET /health HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode() * 64
sel, opened, answers = selectors.DefaultSelector(), 0, 0
t0 = time.monotonic()
while time.monotonic() - t0 < seconds:
    while len(sel.get_map()) < conns:
        try:
            s = socket.create_connection((host, port), timeout=2)
        except OSError:
            break
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ | selectors.EVENT_WRITE)
        opened += 1
    for key, events in sel.select(0.05):
        s = key.fileobj
        try:
            if events & selectors.EVENT_READ:
                data = s.recv(1 << 16)
                if not data:
                    raise OSError
                answers += data.count(b"HTTP/1.1 200")
            if events & selectors.EVENT_WRITE:
                s.send(burst)
        except BlockingIOError:
            pass
        except OSError:
            sel.unregister(s)
            s.close()
print(json.dumps({"opened": opened, "answers": answers, "seconds": time.monotonic() - t0}))
"""


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


def _attack(url: str, owner_url: str, token: str, pid: int, uids: int, seconds: float, kind: str = "bodies") -> dict:
    """Other uids' unauthenticated bodies, or pipelined /health, against the owner's requests (module doc)."""
    import shutil

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        raise SystemExit("--attack-uids needs root and setpriv (other uids)")
    host, port = url.removeprefix("http://").rsplit(":", 1)
    before = peak = _rss_mib(pid)
    cpu_before, t_before = _cpu_s(pid), time.monotonic()
    script = PIPELINER if kind == "pipeline" else ATTACKER
    attackers = [subprocess.Popen([setpriv, f"--reuid={u}", f"--regid={u}", "--clear-groups", sys.executable, "-c",
                                   script, host, port, str(seconds)], stdout=subprocess.PIPE, text=True, cwd="/")
                 for u in range(300001, 300001 + uids)]
    stats, health, tcp_health = [], [], []
    end = time.monotonic() + seconds
    time.sleep(min(1.0, seconds / 4))  # the attack under way first (pacing of the benchmark itself)
    while time.monotonic() < end - 0.5:
        stats.append(_request(owner_url, token, "GET", "/stats", None))
        health.append(_request(owner_url, token, "GET", "/health", None))
        tcp_health.append(_request(url, token, "GET", "/health", None))
        peak = max(peak, _rss_mib(pid))
        time.sleep(0.1)
    outs = [json.loads((a.communicate(timeout=seconds + 30)[0] or "{}").strip() or "{}") for a in attackers]
    cpu, wall = _cpu_s(pid) - cpu_before, time.monotonic() - t_before
    return {"kind": kind, "uids": uids, "seconds": seconds,
            "attacker_connections": sum(o.get("opened", 0) for o in outs),
            "attacker_answers": sum(o.get("answers", 0) for o in outs),
            "daemon_cpu_s": round(cpu, 2), "daemon_cpu_fraction": round(cpu / wall, 3),
            "owner_stats_ms": _percentiles([t for _, t in stats]),
            "owner_health_ms": _percentiles([t for _, t in health]),
            "owner_url": owner_url,
            "owner_tcp_health_ms": _percentiles([t for _, t in tcp_health]),
            "owner_all_answered": all(st == 200 for st, _ in stats + health + tcp_health),
            "daemon_rss_growth_mib": round(peak - before, 1)}


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench controller", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", type=int, default=64)
    ap.add_argument("--requests", type=int, default=20, help="requests per client")
    ap.add_argument("--idle", type=int, default=200, help="silent connections held open")
    ap.add_argument("--attack-uids", type=int, default=0, help="other uids sending unauthenticated bodies (root)")
    ap.add_argument("--attack-seconds", type=float, default=20.0)
    ap.add_argument("--attack-kind", choices=("bodies", "pipeline"), default="bodies",
                    help="bodies: unauthenticated bodies trickled; pipeline: GET /health pipelined as fast as possible")
    args = ap.parse_args(argv)

    cache = f"shmkv-bench-ctl-{uuid.uuid4().hex[:8]}"
    proc, url = start_daemon(cache, "--capacity", "64MiB")
    try:
        host, port_s = url.removeprefix("http://").rsplit(":", 1)
        port = int(port_s)
        cfg = load_config({"cache_name": cache})
        token, owner_url = read_token(cfg), url_of(cfg)
        body = json.dumps({"tokens": list(range(4096)), "namespace": {
            "model_id": "bench", "dtype": "bfloat16", "num_layers": 2, "num_kv_heads": 2, "head_size": 64,
            "chunk_size": 256, "block_size": 128}}).encode()

        def client(_i: int) -> list[tuple[int, float]]:
            return [_request(url, token, "POST", "/lookup", body) for _ in range(args.requests)]

        with ThreadPoolExecutor(args.clients) as ex:
            results = [r for batch in ex.map(client, range(args.clients)) for r in batch]
        idle = [socket.create_connection((host, port), timeout=30) for _ in range(args.idle)]
        try:
            health = [_request(url, token, "GET", "/health", None) for _ in range(50)]
        finally:
            for s in idle:
                s.close()
        attack = _attack(url, owner_url, token, proc.pid, args.attack_uids, args.attack_seconds,
                         args.attack_kind) if args.attack_uids else None
        return {
            "attack": attack,
            "clients": args.clients, "requests": len(results), "idle_connections": args.idle,
            "concurrent_lookup_ms": _percentiles([t for _, t in results]),
            "idle_health_ms": _percentiles([t for _, t in health]),
            "all_answered": all(st == 200 for st, _ in results + health),
            "cpus": os.cpu_count(),
        }
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        drop_cache(cache)


def report(r: dict) -> None:
    c, h = r["concurrent_lookup_ms"], r["idle_health_ms"]
    print(f"{r['requests']} lookups from {r['clients']} concurrent clients: p50 {c['p50']} ms, p99 {c['p99']} ms, "
          f"max {c['max']} ms")
    print(f"/health with {r['idle_connections']} idle connections open: p50 {h['p50']} ms, p99 {h['p99']} ms, "
          f"max {h['max']} ms")
    print(f"all answered: {r['all_answered']}")
    a = r.get("attack")
    if a:
        what = "pipelining /health" if a.get("kind") == "pipeline" else "with unauthenticated bodies"
        print(f"attack: {a['uids']} other uids, {a['attacker_connections']} connections {what} "
              f"({a.get('attacker_answers', 0)} answers) in {a['seconds']:g} s, daemon CPU "
              f"{a.get('daemon_cpu_fraction')} of a core; owner /stats p50 {a['owner_stats_ms']['p50']} ms, p99 "
              f"{a['owner_stats_ms']['p99']} ms, max {a['owner_stats_ms']['max']} ms; /health max "
              f"{a['owner_health_ms']['max']} ms; all answered: {a['owner_all_answered']}; daemon RSS "
              f"+{a['daemon_rss_growth_mib']} MiB")
