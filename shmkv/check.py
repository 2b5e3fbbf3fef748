"""`shmkv check`: what an operator runs on a host before serving.

    shmkv check                      the configuration in force and the host's checks
    shmkv check --json               the same as one JSON object
    shmkv check --vllm MODEL_DIR     also two vLLM engines: the second must hit the first's prompt
    shmkv check --vllm tiny          ... on a random-weight model it writes (nothing downloaded)

It prints the effective configuration with where each value came from (the
same settings the daemon and the engines read: --config, SHMKV_* variables),
then one line per check: ok, warn, fail or skip, and for each warning or
failure the fix. Checks: the segment directory (a memory filesystem of ours,
its parents nobody else can change), the capacity against the memory the
host can give it, huge pages, what other users can reach (segment, runtime
directory, disk directory), the segment itself (an existing one attached as
the daemon would; where there is none, one of the check's own with the same
directory and capacity, removed after; a timed put/get of one chunk under a
namespace of the check's own, removed after), and each visible GPU (the CUDA
part against the driver, pinning of host memory, host<->device copies;
skipped with the reason where there is none). --vllm runs its engines on a
small cache of its own, shared memory only, removed after. The last line but
one says what the check left on the host: nothing, unless --vllm failed
(its logs are kept) or --workdir was given. Exit status: 1 when a check
failed, else 0.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import shutil
import stat
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from shmkv.config import ShmkvConfig, config_sources, default_capacity, load_config
from shmkv.errors import ShmkvError
from shmkv.units import format_bytes

OK, WARN, FAIL, SKIP = "ok", "warn", "fail", "skip"
PROBE_BYTES = 4 << 20  # the timed put/get's chunk
VLLM_CHECK_CAPACITY = "256MiB"  # the --vllm check's own cache (two engines' 1,200-token prompt)


@dataclass
class Finding:
    """One check's outcome: what was looked at, how it went, and the fix."""

    check: str
    status: str  # ok / warn / fail / skip
    detail: str
    fix: str = ""
    data: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------ the checks --
def check_segment_dir(cfg: ShmkvConfig) -> Finding:
    """The directory segments live in: a memory filesystem; with segment_dir
    set, ours with mode 0700 below parents nobody else can change."""
    from shmkv.names import segments_dir
    from shmkv.paths import check_trusted_dir

    where = segments_dir(cfg.segment_dir)
    try:
        st, fs = os.stat(where), os.statvfs(where)
    except OSError as e:
        return Finding("segment directory", FAIL, f"{where}: {e.strerror}",
                       "create it: a tmpfs of this uid, mode 0700 (docs/deployment.md \"Containers\"), or unset "
                       "segment_dir (SHMKV_SEGMENT_DIR, --segment-dir)")
    data = {"path": where, "size_bytes": fs.f_blocks * fs.f_frsize, "free_bytes": fs.f_bavail * fs.f_frsize}
    fs_type = _fs_type(where)
    if fs_type not in ("tmpfs", "hugetlbfs"):
        return Finding("segment directory", FAIL, f"{where} is on {fs_type or 'an unknown filesystem'}, not memory",
                       f"mount a tmpfs there (mount -t tmpfs -o mode=0700,uid={os.geteuid()} shmkv {where})", data)
    if where != "/dev/shm":
        if st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            return Finding("segment directory", FAIL,
                           f"{where} is owned by uid {st.st_uid} with mode {stat.S_IMODE(st.st_mode):04o}",
                           f"chown {os.geteuid()} {where} && chmod 700 {where}", data)
        try:
            check_trusted_dir(os.path.dirname(os.path.normpath(where)) or "/")
        except (ShmkvError, OSError) as e:
            return Finding("segment directory", FAIL, str(e),
                           "move the directory below ones only root or this uid can change", data)
    return Finding("segment directory", OK, f"{where}: {fs_type}, {format_bytes(data['size_bytes'])} "
                   f"({format_bytes(data['free_bytes'])} free)", data=data)


def check_capacity(cfg: ShmkvConfig) -> Finding:
    """The segment's size against what the host can give it: free space in
    the segment directory (an existing segment's bytes count as its own) and
    the memory available."""
    from shmkv.names import segments_dir

    where = segments_dir(cfg.segment_dir)
    path = os.path.join(where, cfg.cache_name)
    existing = os.stat(path).st_size if os.path.exists(path) else 0
    capacity = cfg.capacity or existing or default_capacity(cfg.segment_dir)
    source = "capacity" if cfg.capacity else ("the existing segment" if existing else "the default capacity")
    try:
        fs = os.statvfs(where)
        room = fs.f_bavail * fs.f_frsize + existing
    except OSError:
        room = 0
    available = _meminfo().get("MemAvailable", 0) + existing
    data = {"capacity_bytes": capacity, "source": source, "room_bytes": room, "mem_available_bytes": available}
    if room and capacity > room:
        return Finding("capacity", FAIL,
                       f"{format_bytes(capacity)} ({source}) does not fit: {format_bytes(room)} free in {where}",
                       f"set capacity at most {format_bytes(room)}, or mount {where} larger (size=)", data)
    if available and capacity > available:
        return Finding("capacity", WARN,
                       f"{format_bytes(capacity)} ({source}) is more than the {format_bytes(available)} of "
                       "memory available now: filling it would push the host into swap or the OOM killer",
                       f"set capacity below {format_bytes(available)}, or free memory", data)
    return Finding("capacity", OK, f"{format_bytes(capacity)} ({source}); {format_bytes(room)} free for it, "
                   f"{format_bytes(available)} of memory available", data=data)


def check_huge_pages(cfg: ShmkvConfig) -> Finding:
    """Whether the segment's pages can be huge (shmkv.hostmem)."""
    from shmkv.hostmem import segment_pages, shmem_enabled
    from shmkv.names import segments_dir

    where = segments_dir(cfg.segment_dir)
    pages = segment_pages(where)
    data = {"huge": pages.huge, "how": pages.how, "mount_options": [o for o in pages.options if
                                                                    o.startswith(("huge=", "size="))],
            "shmem_enabled": shmem_enabled()}
    if pages.huge:
        return Finding("huge pages", OK, f"the segment gets huge pages: {pages.how}", data=data)
    return Finding("huge pages", WARN, f"the segment gets 4 KiB pages ({pages.how}): pinning it for a GPU "
                   "costs more per GiB",
                   f"mount -o remount,huge=within_size {where} (or a tmpfs of its own for segment_dir, "
                   "mounted with huge=within_size)", data)


def check_access(cfg: ShmkvConfig) -> Finding:
    """What other users can reach: the segment file, the runtime directory
    and the disk tier's directory must be this uid's alone."""
    from shmkv.names import segments_dir
    from shmkv.paths import open_private_dir, runtime_dir

    problems, fixes = [], []
    seg = os.path.join(segments_dir(cfg.segment_dir), cfg.cache_name)
    if os.path.lexists(seg):
        st = os.lstat(seg)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or stat.S_IMODE(st.st_mode) & 0o077:
            problems.append(f"segment {seg}: uid {st.st_uid}, mode {stat.S_IMODE(st.st_mode):04o}")
            fixes.append(f"remove {seg} once nothing uses it (shmkv makes its segments 0600)")
    checked = []
    for what, opener in (("runtime directory", runtime_dir),
                         ("disk directory", (lambda: open_private_dir(cfg.disk_dir, create=False))
                          if cfg.disk_dir and os.path.exists(cfg.disk_dir) else None)):
        if opener is None:
            continue
        try:
            checked.append(opener().path)
        except (ShmkvError, OSError) as e:
            problems.append(f"{what}: {e}")
            fixes.append(f"give shmkv a {what} of this uid, mode 0700")
    if problems:
        return Finding("other users", FAIL, "; ".join(problems), "; ".join(fixes))
    seen = [f"segment {seg} 0600" if os.path.lexists(seg) else "no segment yet"] + [f"{p} 0700" for p in checked]
    return Finding("other users", OK, "this uid's alone: " + ", ".join(seen))


def check_segment(cfg: ShmkvConfig) -> Finding:
    """The segment as the daemon opens it, and one timed put and get of a
    chunk under a namespace of the check's own. A segment that exists is
    attached as it is (the probe chunk deleted after); where there is none,
    the check creates one of its own in the same directory with the same
    capacity and removes it after: a check leaves no segment behind."""
    from shmkv.keys import KEY_BYTES
    from shmkv.names import segments_dir
    from shmkv.store.opening import open_store

    existed = os.path.lexists(os.path.join(segments_dir(cfg.segment_dir), cfg.cache_name))
    probe_cfg = cfg if existed else dataclasses.replace(cfg, cache_name=_own_cache_name())
    try:
        t0 = time.perf_counter()
        store = open_store(probe_cfg, populate=False)
        opened_s = time.perf_counter() - t0
    except (ShmkvError, OSError) as e:
        if not existed:
            _drop_own_cache(probe_cfg.cache_name, cfg.segment_dir)
        return Finding("segment", FAIL, f"cannot open '{cfg.cache_name}': {e}", _fix_for(e))
    key = os.urandom(KEY_BYTES)
    payload = os.urandom(PROBE_BYTES)
    try:
        t0 = time.perf_counter()
        put = store.put(key, payload, namespace=b"shmkv-check\0\0\0\0\0")
        put_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = store.get(key)
        get_s = time.perf_counter() - t0
        store.delete(key)
        st = store.stats()
        outcome = store.outcome.name.lower() if existed else "created for the check and removed"
        data = {"outcome": outcome, "segment": probe_cfg.cache_name, "existed": existed,
                "open_s": round(opened_s, 4), "put": put.name.lower(),
                "put_gbps": round(PROBE_BYTES / put_s / 1e9, 2), "get_gbps": round(PROBE_BYTES / get_s / 1e9, 2),
                "capacity_bytes": st["capacity_bytes"], "ready_entries": st["ready_entries"]}
    finally:
        store.close()
        if not existed:
            _drop_own_cache(probe_cfg.cache_name, cfg.segment_dir)
    if got is None or bytes(got) != payload:
        return Finding("segment", FAIL, f"the probe chunk did not come back ({put.name.lower()})",
                       "the segment is full of pinned or leased chunks, or damaged: `shmkv stats`, then "
                       "`shmkv ctl POST /clear`", data)
    what = (f"'{cfg.cache_name}' {data['outcome']}" if existed else
            f"no segment '{cfg.cache_name}' yet: one of the check's own ('{probe_cfg.cache_name}') created and "
            "removed")
    return Finding("segment", OK,
                   f"{what} ({format_bytes(data['capacity_bytes'])}); a {PROBE_BYTES >> 20} MiB chunk put at "
                   f"{data['put_gbps']} GB/s, read at {data['get_gbps']} GB/s", data=data)


def _own_cache_name() -> str:
    """A cache name of this check's own, beside the configured one."""
    return f"shmkv-check-{os.getpid()}-{os.urandom(3).hex()}"


def _drop_own_cache(name: str, segment_dir: str) -> None:
    """The check's own segment and runtime files, gone (never the configured cache's)."""
    from shmkv import Store
    from shmkv.paths import remove_cache_files

    with contextlib.suppress(FileNotFoundError, ShmkvError):
        Store.unlink(name, segment_dir=segment_dir)
    with contextlib.suppress(OSError, ShmkvError):  # a runtime directory the check refuses has nothing of ours
        remove_cache_files(name)


def check_gpus(cfg: ShmkvConfig) -> list[Finding]:
    """Each visible GPU: the CUDA part against the GPU (machine code or PTX for
    its architecture) and the driver (as new as the runtime it was built
    for); on the first, pinning the segment (cudaHostRegister, s/GiB) and
    shmkv's own store and load copies against cudaMemcpy of the same bytes
    (bench gpu's measurements)."""
    if not any(os.path.exists(p) for p in ("/proc/driver/nvidia", "/dev/nvidiactl")):
        return [Finding("gpu", SKIP, "no NVIDIA driver on this host (neither /proc/driver/nvidia nor "
                        "/dev/nvidiactl)")]
    try:
        import torch
    except ImportError:
        return [Finding("gpu", SKIP, "PyTorch is not installed")]
    if not torch.cuda.is_available():
        return [Finding("gpu", SKIP, "no GPU visible (torch.cuda.is_available() is False)")]
    try:
        from shmkv import _C_cuda
    except ImportError as e:
        return [Finding("gpu", FAIL, f"GPUs are visible but shmkv's CUDA part is not built ({e})",
                        "install the wheel (scripts/build_wheel.sh) or reinstall where nvcc is found "
                        "(docs/install.md \"GPU hosts\")")]
    driver = _driver_version()
    out = [_check_gpu_build(torch, _C_cuda, i, driver) for i in range(torch.cuda.device_count())]
    if all(f.status == OK for f in out):
        out.append(_measure_gpu())
    return out


def _driver_version() -> int:
    """The CUDA version the driver supports (12080: 12.8), or 0 when it cannot be read."""
    import ctypes

    for lib in ("libcuda.so.1", "libcuda.so"):
        try:
            v = ctypes.c_int(0)
            if ctypes.CDLL(lib).cuDriverGetVersion(ctypes.byref(v)) == 0:
                return v.value
        except OSError:
            continue
    return 0


def _check_gpu_build(torch: Any, cuda_part: Any, index: int, driver: int) -> Finding:
    name = torch.cuda.get_device_name(index)
    major, minor = torch.cuda.get_device_capability(index)
    arch = major * 10 + minor
    archs = getattr(cuda_part, "ARCHITECTURES", "").split()
    real = {int(a.split("-")[0]) for a in archs if a.endswith("-real")}
    ptx = [int(a.split("-")[0]) for a in archs if a.endswith("-virtual")]
    built = int(getattr(cuda_part, "CUDA_RUNTIME_BUILT", 0))
    data = {"name": name, "sm": arch, "architectures": archs, "driver_cuda": driver, "runtime_built": built}
    if arch not in real and not any(p <= arch for p in ptx):
        return Finding(f"gpu {index}", FAIL, f"{name} (sm_{arch}): shmkv's CUDA part carries {' '.join(archs)}",
                       f"build it for this GPU: CMAKE_ARGS=\"-DCMAKE_CUDA_ARCHITECTURES={arch}-real\" pip install "
                       "--no-build-isolation .", data)
    if driver and built and driver < built:
        return Finding(f"gpu {index}", FAIL, f"{name}: the driver supports CUDA {driver // 1000}.{driver % 1000 // 10}"
                       f", shmkv's CUDA part was built for {built // 1000}.{built % 1000 // 10}",
                       "update the NVIDIA driver, or build shmkv from source with the toolkit this driver supports",
                       data)
    how = "machine code" if arch in real else "PTX, compiled by the driver at first use"
    return Finding(f"gpu {index}", OK, f"{name} (sm_{arch}): {how}; driver CUDA "
                   f"{driver // 1000}.{driver % 1000 // 10}" if driver else f"{name} (sm_{arch}): {how}", data=data)


def _measure_gpu() -> Finding:
    """On the first GPU: pinning a 1 GiB segment, and shmkv's store and load
    copies against cudaMemcpy (bench gpu's measurements, fewer repeats)."""
    from shmkv.bench.gpu_bench import segment_figures, worker_figures

    try:
        seg = segment_figures(1)
        w = worker_figures(2, 2048)
    except Exception as e:  # noqa: BLE001 - the measurement failing is the finding
        return Finding("gpu copies", FAIL, f"{type(e).__name__}: {e}", "run `shmkv bench gpu` for the "
                       "whole picture, and report it")
    data = {"register_s_per_gib": round(seg["register_s_per_gib"], 3),
            **{k: round(w[k], 1) for k in ("store_gbps", "load_gbps", "h2d_gbps", "d2h_gbps")}}
    return Finding("gpu copies", OK, f"pinning {data['register_s_per_gib']} s/GiB; store {data['store_gbps']} GB/s "
                   f"(cudaMemcpy device->host {data['d2h_gbps']}), load {data['load_gbps']} GB/s (host->device "
                   f"{data['h2d_gbps']})", data=data)


def check_vllm(cfg: ShmkvConfig, model: str, workdir: str) -> Finding:
    """Two vLLM engines, one after the other: the second must load the
    first's prompt from the cache and give the same greedy output."""
    import random

    try:
        from shmkv.engines.engine import EngineProcess, EngineSpec
        from shmkv.engines.models import TEST_MODEL, write_llama
    except ImportError as e:
        return Finding("vllm", FAIL, f"the engine harness cannot load ({e})", "pip install 'shmkv[vllm,bench]'")
    if model == "tiny":
        model = write_llama(os.path.join(workdir, "model-tiny"), TEST_MODEL)
    elif not os.path.isdir(model):
        return Finding("vllm", FAIL, f"--vllm {model}: not a model directory", "give a local model directory "
                       "(config.json and weights) or `tiny` for a random-weight model")
    settings = {k: v for k, v in dataclasses.asdict(cfg).items() if v != getattr(ShmkvConfig(), k)}
    # a cache of the check's own, small, shared memory only: the engines' chunks go nowhere the
    # configured cache or its tiers keep them, and it is removed after (a check leaves nothing)
    own = _own_cache_name()
    settings.update(cache_name=own, capacity=VLLM_CHECK_CAPACITY)
    for tier in ("disk_dir", "remote_url"):
        settings.pop(tier, None)
    prompt = [random.Random(0).randrange(3, 500) for _ in range(1200)]
    rows = []
    try:
        for i in (1, 2):
            spec = EngineSpec(model, shmkv=settings, in_process=True)  # each engine one process: a faster start
            with EngineProcess(spec, os.path.join(workdir, f"engine{i}.log")) as e:
                r = e.generate([prompt], max_tokens=8)
                rows.append((r["outputs"][0], r["num_cached_tokens"][0]))
    except (RuntimeError, OSError, TimeoutError) as e:
        return Finding("vllm", FAIL, f"an engine did not serve: {str(e)[-500:]}",
                       f"read the engine logs in {workdir}")
    finally:
        _drop_own_cache(own, cfg.segment_dir)
    (out1, _), (out2, hit) = rows
    data = {"model": model, "hit_tokens": hit, "outputs_equal": out1 == out2, "segment": own}
    if hit <= 0:
        return Finding("vllm", FAIL, "the second engine found nothing of the first's prompt in the cache",
                       f"read {workdir}/engine2.log (shmkv logs why it is off, if it is)", data)
    if out1 != out2:
        return Finding("vllm", FAIL, f"the second engine loaded {hit} tokens but its output differs",
                       "report it with both engine logs: a loaded prefix must give the same greedy output", data)
    return Finding("vllm", OK, f"engine 2 loaded {hit} of {len(prompt)} prompt tokens; outputs equal (a "
                   f"{VLLM_CHECK_CAPACITY} cache of the check's own, removed after)", data=data)


# --------------------------------------------------------------- helpers --
def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


def _meminfo() -> dict[str, int]:
    out = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            out[name] = int(parts[0]) * 1024
    return out


def _fs_type(path: str) -> str:
    from shmkv.hostmem import mount_of

    return mount_of(path)[1]


def _fix_for(e: BaseException) -> str:
    from shmkv.errors import PermissionDeniedError, SegmentMismatchError

    if isinstance(e, PermissionDeniedError):
        return ("every process sharing a cache runs as the uid that owns it (docs/deployment.md \"Containers of "
                "different uids\")")
    if isinstance(e, SegmentMismatchError):
        return "leave capacity unset to use the live segment as it is, or stop its users first"
    return "see the message; `shmkv stats` shows the segment's state"


def run_checks(cfg: ShmkvConfig, *, vllm: str | None = None, workdir: str | None = None) -> list[Finding]:
    findings = [check_segment_dir(cfg), check_capacity(cfg), check_huge_pages(cfg), check_access(cfg)]
    findings.append(check_segment(cfg) if findings[0].status != FAIL else
                    Finding("segment", SKIP, "the segment directory failed its check"))
    findings += check_gpus(cfg)
    if vllm:
        import tempfile

        own = workdir is None
        workdir = workdir or tempfile.mkdtemp(prefix="shmkv-check-")
        finding = check_vllm(cfg, vllm, workdir)
        if own and (finding.status == OK or not os.listdir(workdir)):  # its own: kept only for a failure's logs
            shutil.rmtree(workdir, ignore_errors=True)
        finding.data.setdefault("workdir", workdir)
        findings.append(finding)
    return findings


def left_behind(findings: list[Finding]) -> list[str]:
    """What the checks left on the host: nothing but a --vllm work directory
    kept for a failure's logs, or one the caller named (--workdir)."""
    return [f"{f.data['workdir']} (the engine logs and model)" for f in findings
            if f.check == "vllm" and os.path.isdir(f.data.get("workdir", ""))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="shmkv check", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", help="YAML file of shmkv settings (the daemon's)")
    ap.add_argument("--cache", help="cache name (default shmkv-<uid>)")
    ap.add_argument("--segment-dir", help="the directory segments live in (default /dev/shm: POSIX shared memory)")
    ap.add_argument("--json", action="store_true", help="one JSON object")
    ap.add_argument("--vllm", metavar="MODEL_DIR", help="also run two vLLM engines on this model (`tiny`: a "
                    "random-weight model written here)")
    ap.add_argument("--workdir", help="where --vllm writes its model and logs")
    args = ap.parse_args(argv)
    explicit = {k: v for k, v in (("config_file", args.config), ("cache_name", args.cache),
                                  ("segment_dir", args.segment_dir)) if v is not None}
    try:
        cfg = load_config(explicit)
        sources = config_sources(explicit)
    except ShmkvError as e:
        print(f"shmkv check: {e}", file=sys.stderr)
        return 2
    findings = run_checks(cfg, vllm=args.vllm, workdir=args.workdir)
    failed = any(f.status == FAIL for f in findings)
    left = left_behind(findings)
    settings = {k: {"value": _plain(getattr(cfg, k)), "source": sources[k]} for k in sources}
    if args.json:
        print(json.dumps({"ok": not failed, "settings": settings, "left": left,
                          "checks": [dataclasses.asdict(f) for f in findings]}, sort_keys=True))
        return 1 if failed else 0
    width = max(len(k) for k in settings)
    print("settings (value, from):")
    for k, v in settings.items():
        print(f"  {k:<{width}}  {v['value']!r:<40} {v['source']}")
    print("\nchecks:")
    for f in findings:
        print(f"  [{f.status:4}] {f.check}: {f.detail}")
        if f.fix and f.status in (WARN, FAIL):
            print(f"         fix: {f.fix}")
    print(f"\nleft on this host: {', '.join(left) if left else 'nothing (no segment, no files)'}")
    print("\n" + ("FAILED: fix the lines marked fail before serving" if failed else "ready to serve"))
    return 1 if failed else 0


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


if __name__ == "__main__":
    sys.exit(main())
