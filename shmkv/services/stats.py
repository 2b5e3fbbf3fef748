"""`python -m shmkv.stats`: what the cache is doing, read from the segment itself.

Works with or without the daemon: it attaches the shared segment (counters
live there, shared by every process) and, when given the disk tier's
directory, counts its files.

    python -m shmkv.stats                      # table for the default cache
    python -m shmkv.stats --cache NAME --json
    python -m shmkv.stats --watch 2            # refresh every 2 s (Ctrl-C ends)
    python -m shmkv.stats --prometheus         # Prometheus text exposition
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from shmkv import _C
from shmkv.errors import SegmentNotFoundError, ShmkvError
from shmkv.names import SEGMENT_DIR_ENV, segments_dir
from shmkv.store import Store, default_cache_name
from shmkv.units import format_bytes


# (metric, help, kind) per tier, from the core's one list (cpp/counters.h);
# kind "counter" gets _total in Prometheus, "info" entries are not exported.
def _tier_metrics(tier: str) -> list[tuple[str, str, str]]:
    return [(name, help_text, kind) for name, help_text, kind, t, _, _ in _C.COUNTERS if t == tier and kind != "info"]


def _families() -> dict[str, tuple[str, str, list[tuple[str, str]]]]:
    """Prometheus family -> (help, kind, [(tier, statistic)]): one metric per
    quantity, the tier a label (cpp/counters.h `family`)."""
    out: dict[str, tuple[str, str, list[tuple[str, str]]]] = {}
    for name, help_text, kind, tier, _, family in _C.COUNTERS:
        if kind == "info":
            continue
        if family not in out:
            out[family] = (_C.METRIC_FAMILIES.get(family, help_text), kind, [])
        out[family][2].append((tier, name))
    return out


_SHM_METRICS = _tier_metrics("shm")
_DISK_METRICS = _tier_metrics("disk")
_REMOTE_METRICS = _tier_metrics("remote")
CONTROLLER_METRICS = [
    ("requests", "Requests the controller answered", "counter"),
    ("bad_requests", "Requests refused with a 4xx (malformed or out of range)", "counter"),
    ("refused_requests", "Requests refused for their credentials, Host or Origin (401, 403)", "counter"),
    ("errors", "Requests that failed inside the daemon (5xx)", "counter"),
    ("throttled_connections", "Other uids' connections closed unanswered, over their per-uid budget", "counter"),
    ("write_timeouts", "Connections aborted because their client did not read an answer in time", "counter"),
    ("uptime_seconds", "Seconds since the daemon started", "gauge"),
]


def collect(cache: str, disk_dir: str | None = None, segment_dir: str | None = None) -> dict[str, Any]:
    """A snapshot of one cache: {"cache", "shm": {...}, "disk": {...}}
    (`segment_dir` as Store.attach's)."""
    from shmkv import engine_registry

    store = Store.attach(cache, populate=False, background_reserve=False,  # a reader: reserves nothing
                         segment_dir=segment_dir)
    try:
        snap = snapshot(store, disk_dir, count_self=False)
    finally:
        store.close()
    snap["engines"] = engine_registry.summary(cache)
    return snap


def snapshot(store: Store, disk_dir: str | None = None, *, count_self: bool = True) -> dict[str, Any]:
    """A snapshot through an attached store; `count_self=False` leaves the
    calling process out of processes_attached (a stats reader is no user)."""
    st = store.stats()
    if not count_self:
        st["processes_attached"] = max(0, st["processes_attached"] - 1)
    shm = {name: st[name] for name, _, _ in _SHM_METRICS}
    shm["hit_rate"] = st["hits"] / st["lookups"] if st["lookups"] else 0.0
    disk: dict[str, Any] = {name: st[name] for name, _, _ in _DISK_METRICS}
    remote = {name: st[name] for name, _, _ in _REMOTE_METRICS}
    if disk_dir:
        path = os.path.join(disk_dir, store.name)
        files = size = 0
        if os.path.isdir(path):
            with os.scandir(path) as it:
                for d in it:
                    if d.name.endswith(".kv") and d.is_file(follow_symlinks=False):
                        files += 1
                        size += d.stat(follow_symlinks=False).st_size
        disk.update({"dir": path, "files": files, "bytes_on_disk": size})
    return {"cache": store.name, "time": time.time(), "shm": shm, "disk": disk, "remote": remote}



def render_table(snap: dict[str, Any]) -> str:
    s, d = snap["shm"], snap["disk"]
    rows = [
        f"shmkv cache '{snap['cache']}'",
        "",
        "shared tier (/dev/shm)",
        f"  capacity          {format_bytes(s['capacity_bytes'])} (payload cap {format_bytes(s['arena_bytes'])}"
        + ("" if s.get("arena_reserved_bytes", s["arena_bytes"]) >= s["arena_bytes"] else
           f"; {format_bytes(s['arena_reserved_bytes'])} reserved so far, the rest being reserved "
           f"({s.get('reserve_errors', 0)} failed attempts)") + ")",
        f"  used              {format_bytes(s['bytes_used'])} "
        f"({100 * s['bytes_used'] / max(1, s['arena_bytes']):.1f}%)",
        f"  entries           {s['entries']} ({s['pinned_entries']} pinned, {s['leases_held']} leases held)",
        f"  hit rate          {100 * s['hit_rate']:.1f}% ({s['hits']} hits / {s['lookups']} lookups)",
        f"  puts              {s['puts']} (full {s['put_full']}, already cached {s['put_exists']}, "
        f"busy {s['put_busy']})",
        f"  tokens            {s['put_tokens']} stored, {s['hit_tokens']} served to vLLM",
        f"  evictions         {s['evictions']} ({s['evicted_unspilled']} not on disk)",
        f"  processes         {s['processes_attached']} attached",
        f"  reclaims          {s['leases_reclaimed']} leases, {s['writes_reclaimed']} writes; "
        f"lock recoveries {s['lock_recoveries']}, resets {s['segment_resets']}",
        "  table lock        " + (f"HELD by pid {s['lock_holder_pid']} for {s['lock_held_ms']} ms"
                                   if s["lock_holder_pid"] else "free")
        + f"; {s['lock_timeouts']} timed-out waits, {s['deferred_ops']} deferred ops, "
        f"{s['metadata_repairs']} metadata repairs, {s['segment_truncated']} truncations",
        "",
        "disk tier",
        f"  spills            {d['spills']} ({format_bytes(d['spill_bytes'])}, {d['spill_tokens']} tokens), "
        f"errors {d['spill_errors']}",
        f"  promotions        {d['disk_hits']} ({format_bytes(d['promote_bytes'])}), errors {d['promote_errors']}; "
        f"{d['disk_hit_tokens']} tokens served to vLLM",
        f"  damaged / capped  {d['disk_damaged']} removed damaged, {d['disk_removed']} removed by the cap",
    ]
    if "files" in d:
        rows.append(f"  on disk           {d['files']} chunks, {format_bytes(d['bytes_on_disk'])} in {d['dir']}")
    e = snap.get("engines")
    if e is not None:
        last = e["last_off"]
        rows += ["", "vLLM engines (connector)",
                 f"  started           {e['on']} with the connector on, {e['off']} with it off"]
        if last is not None:
            when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(last["time"] or 0))
            rows.append(f"  last off          {when}, pid {last['pid']}, model {last['model']}: {last['reason']}")
    r = snap["remote"]
    rows += [
        "",
        "remote tier (Redis/Valkey)",
        f"  writes            {r['remote_puts']} ({format_bytes(r['remote_put_bytes'])}, "
        f"{r['remote_put_tokens']} tokens), errors "
        f"{r['remote_put_errors']}, dropped {r['remote_dropped']}",
        f"  promotions        {r['remote_hits']} ({format_bytes(r['remote_get_bytes'])} fetched), misses "
        f"{r['remote_misses']}; {r['remote_hit_tokens']} tokens served to vLLM",
        f"  faults            {r['remote_errors']} failed calls, {r['remote_damaged']} damaged values rejected, "
        f"{r['remote_foreign']} signed with another secret, {r['remote_expired']} past their signed expiry, "
        f"{r['remote_stale']} signed before a clear",
    ]
    return "\n".join(rows)


def render_prometheus(snap: dict[str, Any]) -> str:
    """Prometheus text: one family per quantity, shmkv_<family>{cache, tier}
    with a sample per tier that has it (shmkv_hits_total{tier="shm|disk|remote"}),
    and the daemon's controller counters (shmkv_controller_<name>{cache})."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    def family(name: str, help_text: str, kind: str, labels: list[str]):  # noqa: ANN202
        return (CounterMetricFamily if kind == "counter" else GaugeMetricFamily)(name, help_text, labels=labels)

    class Collector:
        def collect(self):  # noqa: ANN202 - prometheus_client protocol
            for fam, (help_text, kind, samples) in _families().items():
                f = family(f"shmkv_{fam}", help_text, kind, ["cache", "tier"])
                for tier, name in samples:
                    f.add_metric([snap["cache"], tier], snap[tier][name])
                yield f
            if "engines" in snap:
                f = family("shmkv_connector_engines", "vLLM engines started with the connector on or off (off: "
                           "the engine's log and `shmkv stats` say why)", "gauge", ["cache", "state"])
                for state in ("on", "off"):
                    f.add_metric([snap["cache"], state], snap["engines"][state])
                yield f
            for name, help_text, kind in CONTROLLER_METRICS if "controller" in snap else ():
                f = family(f"shmkv_controller_{name}", help_text, kind, ["cache"])
                f.add_metric([snap["cache"]], snap["controller"][name])
                yield f

    registry = CollectorRegistry()
    registry.register(Collector())
    return generate_latest(registry).decode()


STATS_HELP = """What the cache is doing, read from the segment itself (with or without
the daemon: the counters live in the segment, shared by every process); with
the disk tier's directory, its files counted too.

    shmkv stats                          # a table for the default cache
    shmkv stats --cache NAME --json
    shmkv stats --watch 2                # every 2 s (Ctrl-C ends)
    shmkv stats --prometheus             # Prometheus text exposition
"""


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shmkv stats", description=STATS_HELP,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.environ.get("SHMKV_CACHE_NAME") or default_cache_name(),
                    help="cache name (default: $SHMKV_CACHE_NAME or shmkv-<uid>)")
    ap.add_argument("--disk-dir", default=os.environ.get("SHMKV_DISK_DIR"),
                    help="disk tier directory, to count its files")
    ap.add_argument("--segment-dir", default=None,
                    help=f"the directory segments live in (default: ${SEGMENT_DIR_ENV}, else /dev/shm)")
    fmt = ap.add_mutually_exclusive_group()
    fmt.add_argument("--json", action="store_true", help="one JSON object per snapshot")
    fmt.add_argument("--prometheus", action="store_true", help="Prometheus text exposition")
    ap.add_argument("--watch", type=float, metavar="SECONDS", help="refresh every SECONDS")
    ap.add_argument("--count", type=int, default=0, help="with --watch: stop after this many snapshots")
    args = ap.parse_args(argv)
    if args.watch is not None and args.watch <= 0:
        ap.error("--watch needs a positive number of seconds")
    if args.disk_dir:
        where = os.path.join(args.disk_dir, args.cache)
        if not os.path.isdir(args.disk_dir):
            ap.error(f"--disk-dir {args.disk_dir}: not a directory (the disk tier's directory: disk_dir)")
        if os.path.lexists(where) and not (os.path.isdir(where) and not os.path.islink(where)):
            ap.error(f"--disk-dir {args.disk_dir}: {where} is not a directory of disk-tier chunks")

    shown = 0
    try:
        while True:
            try:
                snap = collect(args.cache, args.disk_dir, args.segment_dir)
            except SegmentNotFoundError:
                where = os.path.join(segments_dir(args.segment_dir), args.cache)
                print(f"shmkv: no cache named '{args.cache}' (looked for {where}).\n"
                      "Start one with `shmkv daemon` (scripts/start_shm_daemon.sh in a checkout), or start vLLM with "
                      "the shmkv connector (the first process creates it); pick another name with --cache NAME.",
                      file=sys.stderr)
                return 1
            except (ShmkvError, OSError) as e:
                print(f"shmkv: cannot read cache '{args.cache}': {e}", file=sys.stderr)
                return 1
            if args.json:
                print(json.dumps(snap, sort_keys=True), flush=True)
            elif args.prometheus:
                sys.stdout.write(render_prometheus(snap))
                sys.stdout.flush()
            else:
                if args.watch and sys.stdout.isatty():
                    sys.stdout.write("\x1b[2J\x1b[H")
                print(render_table(snap), flush=True)
            shown += 1
            if args.watch is None or (args.count and shown >= args.count):
                return 0
            time.sleep(args.watch)
    except KeyboardInterrupt:
        return 0


if __name__ == "__main__":
    sys.exit(main())
