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
import re
from dataclasses import dataclass, field
from typing import Any

from shmkv.errors import ConfigError
from shmkv.names import CODEC_SETTINGS, LOSSY_FORMS, segments_dir

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
               "tib": 1 << 40}


MAX_SIZE = 1 << 62
# SHMKV_* variables that are not settings: directories (shmkv.paths reads the runtime one, the core the segments' one)
ENV_NOT_SETTINGS = frozenset({"SHMKV_RUNTIME_DIR", "SHMKV_SEGMENT_DIR", "SHMKV_UNTESTED_VLLM"})


def parse_size(key: str, value: Any) -> int:
    """Bytes from an int or a string like '8GiB', '512 MiB', '2g'."""
    if isinstance(value, bool):
        raise ConfigError(f"{key}={value!r}: expected a byte size such as 8GiB or 1073741824")
    if isinstance(value, int):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-zA-Z]*)\s*", str(value))
        if not m or m.group(2).lower() not in _SIZE_UNITS:
            raise ConfigError(f"{key}={value!r}: expected a byte size such as 8GiB, 512MiB or 1073741824")
        exact = float(m.group(1)) * _SIZE_UNITS[m.group(2).lower()]
        if not exact.is_integer() and exact < (1 << 20):  # 1.5 bytes; 1.5GiB is a size, 1.7 KB rounds
            raise ConfigError(f"{key}={value!r}: not a whole number of bytes; expected a size such as 8GiB, "
                              "512MiB or 1073741824")
        n = int(exact)
    if n <= 0:
        raise ConfigError(f"{key}={value!r}: must be positive")
    if n > MAX_SIZE:
        raise ConfigError(f"{key}={value!r}: more than {MAX_SIZE >> 40} TiB is not a size shmkv can use")
    return n


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={value!r}: expected true or false")


def _parse_int(key: str, value: Any, lo: int, hi: int) -> int:
    """An integer setting: an int, or a string of one (never 32.7 -> 32, nor True -> 1)."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        n = int(value)
    if n is None or not lo <= n <= hi:
        raise ConfigError(f"{key}={value!r}: expected an integer in [{lo}, {hi}]")
    return n


def _parse_float(key: str, value: Any, ok: Any, expected: str) -> float:
    """float(value) if ok(it), else ConfigError saying what was `expected`."""
    try:
        x = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        x = None
    if x is None or not ok(x):
        raise ConfigError(f"{key}={value!r}: expected {expected}")
    return x


def _parse_fraction(key: str, value: Any) -> float:
    return _parse_float(key, value, lambda x: 0.0 <= x < 1.0, "a fraction in [0, 1)")


def _parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    s = str(value).strip().lower()
    if s not in choices:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(choices)}")
    return s


def default_capacity() -> int:
    """The capacity of a segment created with no explicit `capacity`: a
    quarter of the size of /dev/shm (or of SHMKV_SEGMENT_DIR: segments_dir),
    not of what is free in it, which the segment itself changes; between
    256 MiB and 16 GiB, in whole MiB. Used only when no segment of the name
    exists: then the existing one's size wins."""
    try:
        st = os.statvfs(segments_dir())
        total = st.f_blocks * st.f_frsize
    except OSError:
        total = 4 << 30
    return max(256 << 20, min(16 << 30, total // 4 // (1 << 20) * (1 << 20)))


@dataclass(frozen=True)
class ShmkvConfig:
    """Every setting, with its default. See README "Configuration"."""

    cache_name: str = field(default_factory=lambda: f"shmkv-{os.getuid()}")
    capacity: int = 0  # bytes of the shared segment; 0: the existing segment's, else default_capacity()
    chunk_size: int = 256  # tokens per chunk
    store_tail: bool = True  # cache the block-aligned tail of each prompt as a piece
    max_payload: int = 0  # bytes; 0 = a quarter of the segment's arena
    populate: bool = True  # pre-fault the mapping at attach
    lock_timeout: float = 0.3  # seconds any wait for the segment's table lock may take
    load_failure_policy: str = "recompute"  # what vLLM does if a planned load misses
    lossy_form: str = ""  # "fp8": this engine reads and writes the lossy form of chunks only; "": exact
    disk_dir: str = ""  # empty: no disk tier
    disk_capacity: int = 64 << 30  # byte cap of the disk tier
    disk_level: int = 1  # zstd level
    disk_codec: str = "auto"  # auto (measured: raw where zstd would be slower than the disk), zstd, none
    disk_shuffle_bytes: int = 0  # byte-plane shuffle element size; 0 = the KV dtype's size
    remote_url: str = ""  # redis://, rediss:// or unix:// (Redis or Valkey); empty: no remote tier
    remote_timeout: float = 0.5  # seconds: bound of every remote call (connect, each read)
    remote_ttl: int = 0  # seconds a chunk lives in the remote; 0 = no expiry
    remote_capacity: int = 0  # byte budget in the remote (oldest writes dropped); 0 = none
    remote_write_through: bool = False  # also write each chunk when committed, not only when spilled
    remote_codec: str = "auto"  # as disk_codec, measured against the remote's link
    remote_secret_file: str = ""  # a 0600 file of shared secret: remote chunks carry its MAC; "": unauthenticated
    low_watermark: float = 0.10  # keep this fraction of the shared tier free (spilled chunks evicted)
    spill_ahead: float = 0.20  # keep this fraction of the coldest chunks already on disk
    maintainer: bool = True  # without a daemon, a vLLM scheduler process maintains the cache
    cuda_store_copy: str = "auto"  # GPU->segment copies: "auto" (by run size), "dma" (copy engines) or "kernel"
    cuda_load_copy: str = "auto"  # segment->GPU copies: "auto", "kernel" or "dma"
    sync_load_max: int = 256 << 20  # bytes per rank a load may copy synchronously; above: asynchronously
    io_threads: int = 0  # threads encoding/decoding chunks for spill and promotion; 0: the CPUs we may use (max 8)
    log_level: str = "info"
    log_summary_s: float = 60.0  # one INFO line of activity per this many seconds (requests: DEBUG); 0: none
    listen: str = "127.0.0.1:7470"  # daemon controller: loopback HOST:PORT or unix:/path (socket 0600)
    controller_token_file: str = ""  # the controller's bearer token (0600); "": <runtime dir>/<cache>.controller-token
    controller_open_metrics: bool = False  # serve /metrics without the token (a Prometheus scraper on this host)
    controller_allow_uids: tuple[int, ...] = ()  # other uids a unix-socket controller accepts (besides ours, root)
    debug_digest_file: str = ""  # append per-chunk KV digests (tests prove byte equality)
    config_file: str = ""

    # metadata: how to parse each key
    @staticmethod
    def parsers() -> dict[str, Any]:
        return {
            "cache_name": lambda k, v: _check_name(k, v),
            "capacity": parse_size,
            "chunk_size": lambda k, v: _parse_int(k, v, 16, 1 << 16),
            "store_tail": _parse_bool,
            "max_payload": lambda k, v: 0 if str(v) == "0" else parse_size(k, v),
            "populate": _parse_bool,
            "lock_timeout": lambda k, v: _parse_float(k, v, lambda x: 0.001 <= x <= 60, "seconds in [0.001, 60]"),
            "load_failure_policy": lambda k, v: _parse_choice(k, v, ("recompute", "fail")),
            "lossy_form": lambda k, v: "" if v in (None, "") else _parse_choice(k, v, LOSSY_FORMS),
            "log_level": lambda k, v: _parse_choice(k, v, ("debug", "info", "warning", "error")),
            "log_summary_s": lambda k, v: _parse_float(k, v, lambda x: 0 <= x <= 86400, "seconds in [0, 86400]"),
            "disk_dir": _parse_path,
            "disk_capacity": parse_size,
            "disk_level": lambda k, v: _parse_int(k, v, 1, 22),
            "disk_codec": lambda k, v: _parse_choice(k, v, CODEC_SETTINGS),
            "remote_codec": lambda k, v: _parse_choice(k, v, CODEC_SETTINGS),
            "disk_shuffle_bytes": lambda k, v: _parse_int(k, v, 0, 8),
            "remote_url": _parse_remote_url,
            "remote_timeout": _parse_seconds,
            "remote_ttl": lambda k, v: _parse_int(k, v, 0, 1 << 31),
            "remote_capacity": lambda k, v: 0 if str(v) == "0" else parse_size(k, v),
            "remote_write_through": _parse_bool,
            "remote_secret_file": _parse_path,
            "low_watermark": lambda k, v: _parse_fraction(k, v),
            "spill_ahead": lambda k, v: _parse_fraction(k, v),
            "maintainer": _parse_bool,
            "io_threads": lambda k, v: _parse_int(k, v, 0, 64),
            "cuda_store_copy": lambda k, v: _parse_choice(k, v, ("auto", "dma", "kernel")),
            "cuda_load_copy": lambda k, v: _parse_choice(k, v, ("auto", "kernel", "dma")),
            "sync_load_max": lambda k, v: 0 if str(v) == "0" else parse_size(k, v),
            "listen": _parse_listen,
            "controller_token_file": _parse_path,
            "controller_open_metrics": _parse_bool,
            "controller_allow_uids": _parse_uids,
            "debug_digest_file": lambda k, v: str(v),
            "config_file": lambda k, v: str(v),
        }


def _parse_path(key: str, value: Any) -> str:
    """An absolute path (~ expanded), or empty: a relative one would depend
    on the directory each process happens to start in."""
    s = os.path.expanduser(str(value).strip()) if value is not None else ""
    if not s:
        return ""
    if "\0" in s or not os.path.isabs(s):
        raise ConfigError(f"{key}={value!r}: expected an absolute path (or empty), not one relative to the "
                          "directory a process starts in")
    return s


def _parse_remote_url(key: str, value: Any) -> str:
    s = str(value).strip()
    bad = next((i for i, c in enumerate(s) if c.isspace() or not c.isprintable()), None)
    if bad is not None:
        raise ConfigError(f"{key}: {s[bad]!r} at character {bad} of the URL; a URL holds no space, newline or "
                          "control character")
    parts = [p.strip() for p in s.split(",")] if s else []
    if any(not p.startswith(("redis://", "rediss://", "unix://")) for p in parts):
        raise ConfigError(f"{redact_url(s)!r} for {key}: expected a redis://, rediss:// or unix:// URL, or a "
                          "comma-separated list of a cluster's redis:// / rediss:// seed URLs (or empty)")
    if len(parts) > 1 and (any(p.startswith("unix://") for p in parts)
                           or len({p.partition("://")[0] for p in parts}) > 1):
        raise ConfigError(f"{key}: the seed URLs of a cluster are all redis:// or all rediss://")
    return ",".join(parts)


def _parse_seconds(key: str, value: Any) -> float:
    return _parse_float(key, value, lambda x: 0.001 <= x <= 600, "seconds in [0.001, 600]")


def parse_listen(value: str) -> tuple[str, str, int]:
    """("unix", path, 0) or ("tcp", address, port) of a controller address;
    the host must be a loopback address. A name (localhost) comes back as the
    one address both the daemon binds and clients connect to: its first IPv4
    address, else its first address (a client that tried ::1 first while the
    daemon bound 127.0.0.1 could reach whoever listens on [::1]:PORT)."""
    import ipaddress
    import socket

    s = str(value).strip()
    if "\x00" in s:
        raise ConfigError(f"listen={value!r}: holds a NUL character")
    if s.startswith("unix:"):
        path = s[5:]
        if not path.startswith("/"):
            raise ConfigError(f"listen={value!r}: a unix socket needs an absolute path (unix:/run/...)")
        return "unix", path, 0
    host, sep, port_s = s.rpartition(":")
    host = host.strip("[]")
    if not sep or not port_s.isdigit() or not 0 <= int(port_s) <= 65535 or not host:
        raise ConfigError(f"listen={value!r}: expected HOST:PORT (loopback) or unix:/absolute/path")
    try:
        addrs = [ipaddress.ip_address(a[4][0].split("%")[0])
                 for a in socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)]
    except (OSError, ValueError) as e:
        raise ConfigError(f"listen={value!r}: cannot resolve {host!r}: {e}") from e
    if not addrs or not all(a.is_loopback for a in addrs):
        raise ConfigError(f"listen={value!r}: the controller listens on loopback only (127.0.0.1, ::1, "
                          "localhost) or on a unix socket; it has no authentication")
    chosen = next((a for a in addrs if a.version == 4), addrs[0])
    return "tcp", str(chosen), int(port_s)


def _parse_listen(key: str, value: Any) -> str:
    parse_listen(value)
    return str(value).strip()


def _parse_uids(key: str, value: Any) -> tuple[int, ...]:
    """uids as a list or a comma-separated string ("1000,1001")."""
    items = value if isinstance(value, (list, tuple)) else [x for x in str(value).split(",") if x.strip()]
    return tuple(_parse_int(key, x.strip() if isinstance(x, str) else x, 0, (1 << 32) - 2) for x in items)


# a query parameter whose name holds one of these carries a credential (redis-py: password,
# ssl_password, ssl_keyfile_password; and any token, secret or key a client may take)
_SECRET_PARAMS = ("pass", "pwd", "secret", "token", "auth", "cred", "key")


def redact_url(url: str) -> str:
    """A URL without any credential, for logs and answers: the password of
    its userinfo and the value of every query parameter whose name speaks of
    a credential (`password`, `ssl_password`, `ssl_keyfile_password`, a
    token, a secret, a key) become ***."""
    from urllib.parse import parse_qsl, urlencode, urlsplit

    if "," in url:  # a cluster's seed list: each URL on its own
        return ",".join(redact_url(u) for u in url.split(","))
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<unparseable URL>"
    netloc = parts.netloc
    if "@" in netloc:
        creds, _, hostport = netloc.rpartition("@")
        user = creds.split(":", 1)[0]
        netloc = f"{user}:***@{hostport}" if ":" in creds else f"{user}@{hostport}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, "***" if any(w in k.lower() for w in _SECRET_PARAMS) else v) for k, v in pairs],
                          safe="*")
    return (f"{parts.scheme}://{netloc}{parts.path}" + (f"?{query}" if query else "")
            + (f"#{parts.fragment}" if parts.fragment else ""))


def _check_name(key: str, value: Any) -> str:
    s = str(value)
    if not re.fullmatch(r"[A-Za-z0-9_-][A-Za-z0-9._-]{0,199}", s):
        raise ConfigError(f"{key}={value!r}: expected 1-200 characters from [A-Za-z0-9._-], not starting with '.'")
    return s


def load_config(explicit: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> ShmkvConfig:
    """Merge explicit settings, SHMKV_* environment variables and the YAML file."""
    parsers = ShmkvConfig.parsers()
    merged: dict[str, Any] = {}
    for _where, values in _layers(explicit, env):
        for k, v in values.items():
            merged[k] = parsers[k](k, v)
    return dataclasses.replace(ShmkvConfig(), **merged)


def config_sources(explicit: dict[str, Any] | None = None, env: dict[str, str] | None = None) -> dict[str, str]:
    """Where each setting's effective value comes from: "default", "file
    PATH", "environment SHMKV_KEY" or "explicit" (what load_config with the
    same arguments merges)."""
    out = {k: "default" for k in ShmkvConfig.parsers()}
    for where, values in _layers(explicit, env):
        for k in values:
            out[k] = f"environment SHMKV_{k.upper()}" if where == "environment" else where
    return out


def _layers(explicit: dict[str, Any] | None, env: dict[str, str] | None) -> list[tuple[str, dict[str, Any]]]:
    """The sources of settings, lowest precedence first: ("file PATH", the
    YAML file's), ("environment", SHMKV_* variables'), ("explicit", ...)."""
    explicit = dict(explicit or {})
    env = dict(os.environ if env is None else env)
    known = set(ShmkvConfig.parsers())

    unknown = sorted(set(explicit) - known)
    if unknown:
        raise ConfigError(f"unknown shmkv setting(s) {unknown}; known: {', '.join(sorted(known))}")
    env_values = {k: env[f"SHMKV_{k.upper()}"] for k in known if f"SHMKV_{k.upper()}" in env}
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
        raise ConfigError(f"config_file={path!r}: unknown setting(s) {bad}; known: {', '.join(sorted(known))}")
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

    names = {f"SHMKV_{k.upper()}" for k in known} | ENV_NOT_SETTINGS
    for var in sorted(v for v in env if v.startswith("SHMKV_") and v not in names and v not in _warned_env):
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
