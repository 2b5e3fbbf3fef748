"""shmkv configuration: one set of keys, three sources.

Precedence, highest first:
  1. vLLM's kv_connector_extra_config (or the dict given to load_config)
  2. environment variables SHMKV_<KEY> (e.g. SHMKV_CAPACITY=8GiB)
  3. a YAML file named by the key `config_file` / SHMKV_CONFIG_FILE
  4. the defaults below

A bad value raises ConfigError naming the key, the value and what is
accepted; unknown keys are errors too (a typo must not be silently ignored).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shmkv.config_values import (
    CACHE_NAME_RULE,
    check_cache_name,
    parse_bool,
    parse_choice,
    parse_float,
    parse_fraction,
    parse_int,
    parse_listen_setting,
    parse_path,
    parse_remote_url,
    parse_size,
    parse_uids,
)
from shmkv.errors import ConfigError
from shmkv.keys import CHUNK_SIZE_MAX, CHUNK_SIZE_MIN
from shmkv.names import CODEC_SETTINGS, LOSSY_FORMS, segments_dir
from shmkv.testing import EVICT_BEFORE_LOAD, SKIP_LOAD_LAYERS, WORKER_OFF
from shmkv.testing import PREFIX as TEST_PREFIX

# SHMKV_* variables that are not settings (shmkv.paths reads the runtime directory's; the other allows an untested vLLM)
ENV_NOT_SETTINGS = frozenset({"SHMKV_RUNTIME_DIR", "SHMKV_UNTESTED_VLLM"})

def default_capacity(segment_dir: str | None = None) -> int:
    """The capacity of a segment created with no explicit `capacity`: a
    quarter of the size of /dev/shm (or of the segment directory: segments_dir),
    not of what is free in it, which the segment itself changes; between
    256 MiB and 16 GiB, in whole MiB. Used only when no segment of the name
    exists: then the existing one's size wins."""
    try:
        st = os.statvfs(segments_dir(segment_dir))
        total = st.f_blocks * st.f_frsize
    except OSError:
        total = 4 << 30
    return max(256 << 20, min(16 << 30, total // 4 // (1 << 20) * (1 << 20)))


# ------------------------------------------------------------ the table ---
# Each setting is defined once, below: its type and default (the dataclass
# field), how a value is read and what is accepted (its Kind), and its help.
# The parser, the checks, `shmkv config` and the settings table of the docs
# (`shmkv config --markdown`, kept current by a test) all come from here.
# The bounds the C++ core checks too come from the core (_C.LIMITS).


@dataclass(frozen=True)
class Kind:
    """How a setting's value is read (`parse(key, value)` -> the value, or
    ConfigError naming the key) and, in words, what it accepts."""

    parse: Callable[[str, Any], Any]
    accepted: str


def _limits() -> dict[str, Any]:
    from shmkv import _C

    return dict(_C.LIMITS)


LIMITS = _limits()
LOCK_TIMEOUT_S: tuple[float, float] = tuple(LIMITS["lock_timeout_s"])  # type: ignore[assignment]
CACHE_NAME_MAX: int = LIMITS["cache_name_max"]


def _num(x: float) -> str:
    return f"{x:g}"


def size_kind(zero: str = "") -> Kind:
    """A byte size (8GiB, 512MiB, 1073741824); `zero`: what 0 means, if it is allowed."""
    if zero:
        return Kind(lambda k, v: 0 if str(v).strip() == "0" else parse_size(k, v),
                    f"a byte size (8GiB, 512MiB, bytes); 0: {zero}")
    return Kind(parse_size, "a byte size (8GiB, 512MiB, bytes)")


def int_kind(lo: int, hi: int) -> Kind:
    return Kind(lambda k, v: parse_int(k, v, lo, hi), f"an integer in [{lo}, {hi}]")


def seconds_kind(lo: float, hi: float) -> Kind:
    return Kind(lambda k, v: parse_float(k, v, lambda x: lo <= x <= hi, f"seconds in [{_num(lo)}, {_num(hi)}]"),
                f"seconds in [{_num(lo)}, {_num(hi)}]")


def choice_kind(*choices: str, empty: str = "") -> Kind:
    """One of `choices`; `empty`: what the empty value means, if it is allowed."""
    if empty:
        return Kind(lambda k, v: "" if v in (None, "") else parse_choice(k, v, choices),
                    f"{', '.join(choices)}, or empty ({empty})")
    return Kind(lambda k, v: parse_choice(k, v, choices), ", ".join(choices))


BOOL = Kind(lambda k, v: parse_bool(k, v), "true or false (1/0, yes/no, on/off)")
FRACTION = Kind(lambda k, v: parse_fraction(k, v), "a fraction in [0, 1)")
PATH = Kind(lambda k, v: parse_path(k, v), "an absolute path, or empty")
TEXT = Kind(lambda k, v: str(v), "text")
NAME = Kind(lambda k, v: check_cache_name(k, v), CACHE_NAME_RULE)
LISTEN = Kind(lambda k, v: parse_listen_setting(k, v), "a loopback HOST:PORT (port 0 picks one) or unix:/absolute/path")
REMOTE_URL = Kind(lambda k, v: parse_remote_url(k, v),
                  "redis://, rediss:// or unix:// URL, a comma-separated list of a cluster's seed URLs, or empty")
UIDS = Kind(lambda k, v: parse_uids(k, v), "uids, as a list or comma-separated (1000,1001)")
SEGMENT_DIR = Kind(lambda k, v: parse_path(k, v),
                   "an absolute path of a directory of this uid, mode 0700, on a tmpfs; or empty (/dev/shm)")


def setting(default: Any, kind: Kind, help: str, *, shown: str = "", factory: Callable[[], Any] | None = None) -> Any:
    """A field of ShmkvConfig: its default, Kind and help; `shown`: the
    default in words where the value alone does not say it. Its environment
    variable is SHMKV_<NAME>."""
    meta = {"kind": kind, "help": help, "shown": shown}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass(frozen=True)
class ShmkvConfig:
    """Every setting: see the table above, or `shmkv config --markdown`."""

    cache_name: str = setting(None, NAME, "the cache: the segment `<segment_dir>/<cache_name>` every engine and "
                              "the daemon that share it name", shown="`shmkv-<uid>`",
                              factory=lambda: f"shmkv-{os.getuid()}")
    capacity: int = setting(0, size_kind(), "bytes of the shared segment (a live segment keeps its size: "
                            "\"Restarts and sizes\")", shown="the existing segment's size; for a new one a quarter "
                            "of the segment directory's size, 256 MiB..16 GiB")
    segment_dir: str = setting("", SEGMENT_DIR, "where segments live: a tmpfs directory of this uid (a container's "
                               "own mount) instead of POSIX shared memory; every process of a cache names the same",
                               shown="empty (`/dev/shm`)")
    chunk_size: int = setting(256, int_kind(CHUNK_SIZE_MIN, CHUNK_SIZE_MAX),
                              "tokens per chunk (a multiple of vLLM's block size)")
    store_tail: bool = setting(True, BOOL, "also cache the block-aligned tail of each prompt (hits as fine as "
                               "vLLM's block)")
    max_payload: int = setting(0, size_kind("a quarter of the segment's arena"), "largest chunk in bytes")
    populate: bool = setting(True, BOOL, "map the segment's reserved pages at attach, and the rest once reserved "
                             "(no page faults on the hot path)")
    lock_timeout: float = setting(LIMITS["lock_timeout_default_s"], seconds_kind(*LOCK_TIMEOUT_S),
                                  "seconds any wait for the segment's table lock may take (then: miss, busy or "
                                  "deferred)")
    load_failure_policy: str = setting(
        "recompute", choice_kind("recompute", "fail"),
        "sets vLLM's `kv_load_failure_policy`: a chunk evicted between lookup and load is recomputed, never a "
        "failed request; a `kv_load_failure_policy` given on vLLM's command line is kept (from `LLM(...)` set "
        "this to `fail` to keep vLLM's `fail`)")
    lossy_form: str = setting("", choice_kind(*LOSSY_FORMS, empty="exact"),
                              "`fp8`: this engine reads and stores only the lossy (float8) form of chunks; never "
                              "on an engine whose outputs must be exact", shown="empty (exact)")
    disk_dir: str = setting("", PATH, "directory of the disk tier; chunks go to `<disk_dir>/<cache_name>/`",
                            shown="empty (no disk tier)")
    disk_capacity: int = setting(64 << 30, size_kind(), "byte cap of the disk tier (least recently used files "
                                 "removed)", shown="`64GiB`")
    disk_level: int = setting(1, int_kind(1, 22), "zstd level of the disk tier")
    disk_codec: str = setting("auto", choice_kind(*CODEC_SETTINGS),
                              "`auto`: each write zstd (byte-shuffled) or raw, whichever the tier's own "
                              "measurements say is faster, zstd when the disk is over 90% of its cap; `zstd`, "
                              "`none`: always that")
    disk_shuffle_bytes: int = setting(0, int_kind(0, 8), "element size of the byte-plane shuffle",
                                      shown="0 (the KV dtype's size)")
    remote_url: str = setting("", REMOTE_URL, "the remote tier (Redis or Valkey): `redis://[user:pass@]host:port/db`, "
                              "`rediss://...` (TLS), `unix:///path`; a cluster: any node's URL or a list of seeds",
                              shown="empty (no remote tier)")
    remote_timeout: float = setting(0.5, seconds_kind(0.001, 600), "bound of every remote call in total (connect "
                                    "and every read); a failure is a miss")
    remote_ttl: int = setting(0, int_kind(0, 1 << 31), "seconds a chunk lives in the remote", shown="0 (no expiry)")
    remote_capacity: int = setting(0, size_kind("no budget"), "byte budget in the remote (oldest writes dropped "
                                   "first)", shown="0 (none)")
    remote_write_through: bool = setting(False, BOOL, "also write each chunk to the remote when it is committed, "
                                         "not only when it is spilled")
    remote_codec: str = setting("auto", choice_kind(*CODEC_SETTINGS), "as `disk_codec`, measured against the "
                                "remote's link")
    remote_secret_file: str = setting("", PATH, "a file of ours, 0600, of at least 16 bytes shared by the hosts: "
                                      "remote chunks carry its HMAC; one whose MAC fails is a miss",
                                      shown="empty (unauthenticated)")
    low_watermark: float = setting(0.10, FRACTION, "fraction of the shared tier the maintainer keeps free (by "
                                   "evicting spilled chunks)")
    spill_ahead: float = setting(0.20, FRACTION, "fraction of the coldest chunks the maintainer keeps already "
                                 "written to disk")
    maintainer: bool = setting(True, BOOL, "without a daemon, a vLLM scheduler process takes the maintainer role")
    cuda_store_copy: str = setting("auto", choice_kind("auto", "dma", "kernel"),
                                   "GPU engines: how a store copies KV out: `dma` (the copy engines, no SMs held), "
                                   "`kernel` (the gather kernel) or `auto` (by the merged run size)")
    cuda_load_copy: str = setting("auto", choice_kind("auto", "kernel", "dma"), "GPU engines: how a load copies KV "
                                  "in, one launch per layer for all chunks: `auto`, `kernel` or `dma`")
    sync_load_max: int = setting(256 << 20, size_kind("no limit"),
                                 "bytes per TP rank a load may copy while the batch waits (V1, one KV-cache "
                                 "group); a larger hit loads asynchronously (V2 and hybrids always do)",
                                 shown="`256MiB`")
    io_threads: int = setting(0, int_kind(0, 64), "chunks encoded (spill) or fetched and decoded (promotion) at "
                              "once; 0: the CPUs the process may use, at most 8")
    log_level: str = setting("info", choice_kind("debug", "info", "warning", "error"), "shmkv's log level")
    log_summary_s: float = setting(60.0, seconds_kind(0, 86400), "one INFO line of activity per this many seconds "
                                   "(the per-request lines are DEBUG); 0: none")
    listen: str = setting("127.0.0.1:7470", LISTEN, "the daemon's controller (a unix socket is made 0600)")
    controller_token_file: str = setting("", PATH, "the controller's bearer token (0600, written by the daemon at "
                                         "its first start)", shown="`<runtime dir>/<cache_name>.controller-token`")
    controller_open_metrics: bool = setting(False, BOOL, "serve `GET /metrics` without the token (a Prometheus "
                                            "scraper on this host)")
    controller_allow_uids: tuple[int, ...] = setting((), UIDS, "other uids a unix-socket controller accepts, "
                                                     "besides ours and root", shown="empty")
    debug_digest_file: str = setting("", TEXT, "append a digest of every unit stored and loaded (byte equality "
                                     "across engines can be checked from it)", shown="empty")
    config_file: str = setting("", TEXT, "a YAML file with any of these keys", shown="empty")

    @staticmethod
    def parsers() -> dict[str, Any]:
        """{setting: parse(key, value)}."""
        return {f.name: f.metadata["kind"].parse for f in dataclasses.fields(ShmkvConfig)}


SETTINGS: tuple[dataclasses.Field, ...] = dataclasses.fields(ShmkvConfig)


def env_name(name: str) -> str:
    """The environment variable of a setting."""
    return f"SHMKV_{name.upper()}"


def shown_default(f: dataclasses.Field) -> str:
    if f.metadata["shown"]:
        return f.metadata["shown"]
    v = f.default
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, str):
        return f"`{v}`" if v else "empty"
    return f"{v:g}" if isinstance(v, float) else str(v)


def settings_markdown() -> str:
    """The settings table of the docs (docs/configuration.md), made from the table above."""
    rows = ["| setting | environment | default | accepted | what it does |", "|---|---|---|---|---|"]
    for f in SETTINGS:
        rows.append(f"| `{f.name}` | `{env_name(f.name)}` | {shown_default(f)} | {f.metadata['kind'].accepted} | "
                    f"{f.metadata['help']} |")
    return "\n".join(rows) + "\n"


# Settings that existed once: what a configuration still naming one is told instead of "unknown"
RETIRED = {
    f"debug_{v[len(TEST_PREFIX):].lower()}": f"a test-only fault, now the environment variable {v} (shmkv/testing.py); "
                                             "remove it from the configuration"
    for v in (SKIP_LOAD_LAYERS, EVICT_BEFORE_LOAD, WORKER_OFF)
}


def _unknown_settings_error(where: str, unknown: list[str], known: set[str]) -> ConfigError:
    """The error for settings nobody defines: a retired one says what replaced it, a typo its closest name."""
    import difflib

    said = []
    for k in unknown:
        if k in RETIRED:
            said.append(f"{k!r} is retired: {RETIRED[k]}")
        else:
            close = difflib.get_close_matches(str(k), sorted(known), n=1)
            said.append(f"{k!r} is not a setting" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return ConfigError(f"{where}{'; '.join(said)}; known: {', '.join(sorted(known))}")


def load_config(explicit: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> ShmkvConfig:
    """Merge explicit settings, SHMKV_* environment variables and the YAML file."""
    parsers = ShmkvConfig.parsers()
    merged: dict[str, Any] = {}
    for _where, values in _layers(explicit, env):
        for k, v in values.items():
            merged[k] = parsers[k](k, v)
    return dataclasses.replace(ShmkvConfig(), **merged)


def config_sources(explicit: dict[str, Any] | None = None, env: dict[str, str] | None = None,
                   explicit_label: str = "explicit") -> dict[str, str]:
    """Where each setting's effective value comes from: "default", "file
    PATH", "environment SHMKV_KEY" or `explicit_label` (what load_config with
    the same arguments merges)."""
    out = {k: "default" for k in ShmkvConfig.parsers()}
    for where, values in _layers(explicit, env):
        for k in values:
            out[k] = (f"environment {env_name(k)}" if where == "environment" else
                      explicit_label if where == "explicit" else where)
    return out


def _layers(explicit: dict[str, Any] | None, env: dict[str, str] | None) -> list[tuple[str, dict[str, Any]]]:
    """The sources of settings, lowest precedence first: ("file PATH", the
    YAML file's), ("environment", SHMKV_* variables'), ("explicit", ...)."""
    explicit = dict(explicit or {})
    env = dict(os.environ if env is None else env)
    known = set(ShmkvConfig.parsers())

    unknown = sorted(set(explicit) - known)
    if unknown:
        raise _unknown_settings_error("unknown shmkv setting(s): ", unknown, known)
    env_values = {k: env[env_name(k)] for k in known if env_name(k) in env}
    _warn_unknown_env(env, known)

    layers: list[tuple[str, dict[str, Any]]] = []
    path = explicit.get("config_file") or env_values.get("config_file")
    if path:
        layers.append((f"file {path}", _read_config_file(path, known)))
    return layers + [("environment", env_values), ("explicit", explicit)]


def _read_config_file(path: str, known: set[str]) -> dict[str, Any]:
    import yaml

    from shmkv.paths import check_private_file

    try:
        check_private_file(path, "config_file")
    except PermissionError as e:
        raise ConfigError(str(e)) from None
    try:
        with open(path) as f:
            loaded = yaml.load(f, Loader=_unique_key_loader()) or {}
    except OSError as e:
        raise ConfigError(f"config_file={path!r}: cannot read it: {e}") from e
    except yaml.YAMLError as e:
        raise ConfigError(f"config_file={path!r}: not valid YAML: {e}") from e
    if not isinstance(loaded, dict):
        raise ConfigError(f"config_file={path!r}: expected a mapping of settings at the top level")
    bad = sorted(set(loaded) - known)
    if bad:
        raise _unknown_settings_error(f"config_file={path!r}: unknown setting(s): ", bad, known)
    return loaded


def _unique_mapping(loader: Any, node: Any, deep: bool = False) -> dict:
    """A YAML mapping whose keys are all different: a key given twice is an
    error naming it and both lines (YAML's own loader keeps the last one)."""
    import yaml

    seen: dict[Any, int] = {}
    for key_node, _value in node.value:
        k = loader.construct_object(key_node, deep=deep)
        try:
            first = seen.setdefault(k, key_node.start_mark.line + 1)
        except TypeError:  # an unhashable key: the settings check names it
            continue
        if first != key_node.start_mark.line + 1:
            raise yaml.constructor.ConstructorError(
                None, None, f"setting {k!r} is given twice (lines {first} and {key_node.start_mark.line + 1})",
                key_node.start_mark)
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


def _unique_key_loader() -> type:
    import yaml

    class UniqueKeyLoader(yaml.SafeLoader):
        pass

    UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_mapping)
    return UniqueKeyLoader


_warned_env: set[str] = set()


def _warn_unknown_env(env: dict[str, str], known: set[str]) -> None:
    """One warning per process for each SHMKV_* variable that names no setting
    (a typo would otherwise leave the default in force, silently)."""
    import difflib

    names = {env_name(k) for k in known} | ENV_NOT_SETTINGS
    for var in sorted(v for v in env if v.startswith("SHMKV_") and not v.startswith(TEST_PREFIX) and v not in names
                      and v not in _warned_env):
        _warned_env.add(var)
        close = difflib.get_close_matches(var, sorted(names), n=1)
        logging.getLogger("shmkv.config").warning(
            "shmkv: environment variable %s is not a shmkv setting (ignored)%s", var,
            f"; did you mean {close[0]}?" if close else "")


def io_threads(cfg: ShmkvConfig) -> int:
    """Threads for chunk codec work: cfg.io_threads, or the CPUs this process
    may run on (at most 8) when it is 0."""
    if cfg.io_threads:
        return cfg.io_threads
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(8, n))


def main(argv: list[str] | None = None) -> int:
    """`shmkv config`: the effective settings and where each came from."""
    import argparse
    import json
    import sys

    ap = argparse.ArgumentParser(
        prog="shmkv config",
        description="The settings in force for this environment, and where each came from: an argument (--set), "
                    "the environment (SHMKV_<KEY>), the file (--config or SHMKV_CONFIG_FILE) or the default.")
    ap.add_argument("--config", help="YAML file of shmkv settings")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="a setting (repeatable)")
    ap.add_argument("--json", action="store_true", help="one JSON object: {key: {value, source, env}}")
    ap.add_argument("--markdown", action="store_true", help="the settings table of the docs, made from the code")
    args = ap.parse_args(argv)
    if args.markdown:
        sys.stdout.write(settings_markdown())
        return 0
    explicit: dict[str, Any] = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep:
            ap.error(f"--set {item!r}: expected KEY=VALUE")
        explicit[key.strip()] = value
    if args.config:
        explicit["config_file"] = args.config
    try:
        cfg = load_config(explicit)
        sources = config_sources(explicit, explicit_label="argument")
    except ConfigError as e:
        print(f"shmkv config: {e}", file=sys.stderr)
        return 2
    out = {f.name: {"value": list(v) if isinstance(v := getattr(cfg, f.name), tuple) else v,
                    "source": sources[f.name], "env": env_name(f.name)} for f in SETTINGS}
    if args.json:
        print(json.dumps(out, sort_keys=True))
        return 0
    width = max(len(k) for k in out)
    for k, v in out.items():
        print(f"{k:<{width}}  {v['value']!r:<32} {v['source']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
