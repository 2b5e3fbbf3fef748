"""Chaos soak: processes put, get, pin and delete concurrently while a
supervisor kill -9's a random one every few hundred milliseconds and starts a
replacement. Then, with every worker gone, the segment is audited.

  ops              operations the workers reported (a killed worker's last
                   unreported batch is not counted)
  kills            workers killed with SIGKILL
  corrupt_reads    reads whose bytes did not match their key (through a lease
                   that was still valid at release)
  corrupt_entries  chunks whose bytes do not match their key at the end
  leaked_leases    leases still held once every worker is gone and dead
                   processes are reclaimed
  leaked_writes    half-written chunks left in the same state
  live_holders_reclaimed  commits (STALE) and lease releases (False) of
                   workers still alive whose write or lease was reclaimed under
                   them: a liveness mistake (--pid-namespaces: each worker in a
                   PID namespace of its own, as containers run)
  daemon_maintained  with --daemon: a shmkv daemon (in a PID namespace of
                   its own with --pid-namespaces) held the maintainer role for
                   the whole run, reclaiming dead processes' leases and writes
                   every pass (50 ms) while the workers run
  consistency_ok   the table's own consistency check passes
  bytes_ok         bytes_used equals the sum of the live entries' allocations
  pins_left        pins held by killed workers (pins belong to no process by
                   design: an operator's pin outlives its client)
  ok               all of the above as they must be

Every payload is a function of its key (size and bytes), so any reader can
check any chunk without coordination.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import threading
import time

import xxhash

from shmkv.bench import drop_cache
from shmkv.engines.engine import container_argv, signal_container, start_daemon

KEYSPACE = 3000


def key_of(i: int) -> bytes:
    return xxhash.xxh3_128_digest(f"soak-{i}".encode())


def payload_of(key: bytes) -> bytes:
    n = 512 + (xxhash.xxh3_64_intdigest(key) % 32) * 1024
    block = xxhash.xxh3_128_digest(key) * 4
    return (block * (n // 64 + 1))[:n]


# ------------------------------------------------------------------ worker --
def worker(cache: str, seed: int) -> int:
    from shmkv import PutResult, Store

    store = Store.attach(cache, populate=False)
    rng = random.Random(seed)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda s, f: stop.set())
    ops = corrupt = stale = 0  # stale: this live process's write or lease was reclaimed under it

    def check(k: bytes, view) -> bool:  # noqa: ANN001
        return bytes(view) == payload_of(k)

    print("ready", flush=True)
    while not stop.is_set():
        k = key_of(rng.randrange(KEYSPACE))
        op = rng.random()
        if op < 0.35:  # put, in two steps so that a kill can land mid-write
            r = store.reserve(k, len(payload_of(k)))
            if not isinstance(r, PutResult):
                r.view()[:] = payload_of(k)
                stale += r.commit() is PutResult.STALE
        elif op < 0.75:  # read through a lease
            lease = store.acquire(k)
            if lease is not None:
                good = check(k, lease.view())
                held = lease.release()
                stale += not held
                if held and not good:  # a stale lease's bytes are void, not corrupt
                    corrupt += 1
                    print(f"corrupt {k.hex()}", flush=True)
        elif op < 0.85:  # copy out
            buf = bytearray(33 * 1024)
            n = store.get_into(k, buf)
            if n is not None and bytes(buf[:n]) != payload_of(k):
                corrupt += 1
                print(f"corrupt {k.hex()}", flush=True)
        elif op < 0.93:  # pin, read, unpin
            if store.pin(k):
                got = store.get(k)
                if got is not None and got != payload_of(k):
                    corrupt += 1
                    print(f"corrupt {k.hex()}", flush=True)
                store.unpin(k)
        elif op < 0.98:
            store.delete(k)
        else:
            store.lookup_prefix([key_of(rng.randrange(KEYSPACE)) for _ in range(16)])
        ops += 1
        if ops % 200 == 0:
            print(f"ops {ops} {corrupt} {stale}", flush=True)
    print(f"ops {ops} {corrupt} {stale}", flush=True)
    store.close()
    return 0


# ------------------------------------------------------------------- audit --
def audit(store) -> dict:  # noqa: ANN001 - a shmkv.Store
    """Reclaim what dead processes left, then check the segment: its own
    consistency check, every live chunk's bytes against its key, leases and
    half-written chunks left, and bytes_used against the live entries."""
    reclaimed = store.reclaim()
    problems = store.check_consistency()
    entries = store.entries()
    st = store.stats()
    corrupt = 0
    for e in entries:
        if e["state"] == "ready":
            got = store.get(e["key"])
            corrupt += got is not None and got != payload_of(e["key"])
    return {
        "corrupt_entries": corrupt,
        # lease records (stats) and the entries' counts of them: both must be zero
        "leaked_leases": max(sum(e["leases"] for e in entries), st["leases_held"]),
        "leaked_writes": sum(e["state"] == "writing" for e in entries),
        "consistency_ok": not problems, "consistency_problems": problems[:10],
        "bytes_used": st["bytes_used"], "bytes_ok": st["bytes_used"] == sum(e["alloc_size"] for e in entries),
        "entries": len(entries), "pins_left": sum(e["pins"] for e in entries),
        "leases_reclaimed": st["leases_reclaimed"], "writes_reclaimed": st["writes_reclaimed"],
        "lock_recoveries": st["lock_recoveries"], "segment_resets": st["segment_resets"],
        "reclaimed_at_end": reclaimed,
    }


# -------------------------------------------------------------- supervisor --
class _Worker:
    def __init__(self, cache: str, seed: int, tally: dict, lock: threading.Lock, *, pid_namespace: bool) -> None:
        # NOTE: in a PID namespace of its own (a container's), unshare's child dies with unshare
        ns = container_argv(pid_namespace)
        self.proc = subprocess.Popen([*ns, sys.executable, "-m", "shmkv.bench.soak_bench", "--worker", cache,
                                      str(seed)], stdout=subprocess.PIPE, text=True)
        self.ops = self.stale = 0
        self.pid_namespace = pid_namespace
        self.tally, self.lock = tally, lock
        self.ready = threading.Event()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def terminate(self) -> None:
        """SIGTERM to the worker (in a namespace: unshare's child; unshare does not pass it on)."""
        if not self.pid_namespace:
            self.proc.send_signal(signal.SIGTERM)
            return
        # NOTE: the worker is its namespace's init, which ignores SIGTERM until it has a handler
        self.ready.wait(60)
        signal_container(self.proc, signal.SIGTERM)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            parts = line.split()
            if not parts:
                continue
            if parts[0] == "ready":
                self.ready.set()
            elif parts[0] == "ops":
                with self.lock:
                    self.tally["ops"] += int(parts[1]) - self.ops
                    self.ops = int(parts[1])
                    self.tally["live_holders_reclaimed"] += int(parts[3]) - self.stale
                    self.stale = int(parts[3])
            elif parts[0] == "corrupt":
                with self.lock:
                    self.tally["corrupt_reads"] += 1
        self.ready.set()


def _stop_daemon(proc: subprocess.Popen, pid_namespace: bool) -> None:
    if pid_namespace:
        signal_container(proc, signal.SIGTERM)
    else:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(argv: list[str]) -> dict:
    ap = argparse.ArgumentParser(prog="shmkv bench soak", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--kill-every-ms", type=float, default=300.0, help="mean interval between kills")
    ap.add_argument("--capacity-mib", type=int, default=32, help="small, so that puts evict all the time")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--pid-namespaces", action="store_true",
                    help="each worker in a PID namespace of its own, as containers run (unshare; needs root)")
    ap.add_argument("--daemon", action="store_true",
                    help="a shmkv daemon maintains the segment meanwhile (in a PID namespace of its own with "
                         "--pid-namespaces): its maintainer reclaims dead processes' holders every pass")
    a = ap.parse_args(argv)

    from shmkv.store import Role, Store

    cache = f"shmkv-soak-{os.getpid()}"
    store = Store.create(cache, a.capacity_mib << 20, populate=False, max_entries=1024)
    rng = random.Random(a.seed)
    tally = {"ops": 0, "corrupt_reads": 0, "live_holders_reclaimed": 0}
    lock = threading.Lock()
    seeds = iter(range(a.seed * 1_000_000, 1 << 62))
    daemon = start_daemon(cache, pid_namespace=a.pid_namespaces)[0] if a.daemon else None
    workers = [_Worker(cache, next(seeds), tally, lock, pid_namespace=a.pid_namespaces) for _ in range(a.workers)]
    for w in workers:
        w.ready.wait(60)
    kills = 0
    daemon_maintained = None
    t_end = time.monotonic() + a.seconds
    try:
        while time.monotonic() < t_end:
            time.sleep(rng.uniform(0.5, 1.5) * a.kill_every_ms / 1000)  # the pace of the chaos itself
            i = rng.randrange(len(workers))
            victim = workers[i]
            victim.proc.kill()
            victim.proc.wait()
            victim.reader.join(10)
            kills += 1
            workers[i] = _Worker(cache, next(seeds), tally, lock, pid_namespace=a.pid_namespaces)
        if daemon is not None:  # still the maintainer, and alive, at the end of the chaos
            daemon_maintained = daemon.poll() is None and store.role_held_elsewhere(Role.MAINTAINER)
        for w in workers:
            w.terminate()
        for w in workers:
            w.proc.wait(60)
            w.reader.join(10)
        if daemon is not None:
            _stop_daemon(daemon, a.pid_namespaces)
            daemon = None
        result = {"seconds": a.seconds, "workers": a.workers, "pid_namespaces": a.pid_namespaces,
                  "daemon": a.daemon, "daemon_maintained": daemon_maintained,
                  "ops": tally["ops"], "kills": kills, "corrupt_reads": tally["corrupt_reads"],
                  "live_holders_reclaimed": tally["live_holders_reclaimed"], **audit(store)}
        result["ok"] = (result["corrupt_reads"] == 0 and result["corrupt_entries"] == 0
                        and daemon_maintained is not False
                        and result["live_holders_reclaimed"] == 0
                        and result["leaked_leases"] == 0 and result["leaked_writes"] == 0
                        and result["consistency_ok"] and result["bytes_ok"] and kills > 0 and result["ops"] > 0)
        return result
    finally:
        for w in workers:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        if daemon is not None:
            daemon.kill()
            daemon.wait()
        store.close()
        drop_cache(cache)


def report(r: dict) -> None:
    where = " in PID namespaces of their own" if r["pid_namespaces"] else ""
    print(f"soak {r['seconds']:.0f} s, {r['workers']} workers{where}: {r['ops']} ops, {r['kills']} kill -9's "
          f"({r['lock_recoveries']} while holding the table lock)")
    if r["daemon"]:
        print(f"  a daemon{where and ' (its own PID namespace)'} maintained the segment meanwhile: "
              f"{'yes' if r['daemon_maintained'] else 'NO'}")
    print(f"  writes or leases of live workers reclaimed under them: {r['live_holders_reclaimed']}")
    print(f"  corrupt reads {r['corrupt_reads']}, corrupt chunks at the end {r['corrupt_entries']}")
    print(f"  leaked leases {r['leaked_leases']}, leaked writes {r['leaked_writes']} (reclaimed during the run: "
          f"{r['leases_reclaimed']} leases, {r['writes_reclaimed']} writes)")
    print(f"  consistency {'ok' if r['consistency_ok'] else r['consistency_problems']}, bytes_used "
          f"{'matches' if r['bytes_ok'] else 'DOES NOT match'} the live entries ({r['entries']} entries, "
          f"{r['pins_left']} pins left by killed workers)")
    print("  OK" if r["ok"] else "  FAILED")


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2], int(sys.argv[3])))
    print("use: shmkv bench soak [--seconds N] [--json]", file=sys.stderr)
    sys.exit(2)
