"""How each kind of setting value is read: sizes ("8GiB"), booleans,
bounded numbers, choices, absolute paths, Redis URLs (and their redaction for
logs), controller addresses (loopback or a unix socket only), uids and cache
names (the core's rule). Each parser takes the setting's key for its error:
a bad value raises ConfigError naming the key, the value and what is
accepted. shmkv.config builds its table of settings from these."""

from __future__ import annotations

import os
import re
from typing import Any

from shmkv import _C
from shmkv.errors import ConfigError

CACHE_NAME_RULE = f"1-{_C.LIMITS['cache_name_max']} characters from [A-Za-z0-9._-], not starting with '.'"

_SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1000, "kib": 1 << 10, "m": 1 << 20, "mb": 10**6,
               "mib": 1 << 20, "g": 1 << 30, "gb": 10**9, "gib": 1 << 30, "t": 1 << 40, "tb": 10**12,
               "tib": 1 << 40}


MAX_SIZE = 1 << 62


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


def parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    s = str(value).strip().lower()
    if s in ("1", "true", "yes", "on"):
        return True
    if s in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{key}={value!r}: expected true or false")


def parse_int(key: str, value: Any, lo: int, hi: int) -> int:
    """An integer setting: an int, or a string of one (never 32.7 -> 32, nor True -> 1)."""
    n: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and re.fullmatch(r"\s*[+-]?\d+\s*", value):
        n = int(value)
    if n is None or not lo <= n <= hi:
        raise ConfigError(f"{key}={value!r}: expected an integer in [{lo}, {hi}]")
    return n


def parse_float(key: str, value: Any, ok: Any, expected: str) -> float:
    """float(value) if ok(it), else ConfigError saying what was `expected`."""
    try:
        x = float(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        x = None
    if x is None or not ok(x):
        raise ConfigError(f"{key}={value!r}: expected {expected}")
    return x


def parse_fraction(key: str, value: Any) -> float:
    return parse_float(key, value, lambda x: 0.0 <= x < 1.0, "a fraction in [0, 1)")


def parse_choice(key: str, value: Any, choices: tuple[str, ...]) -> str:
    s = str(value).strip().lower()
    if s not in choices:
        raise ConfigError(f"{key}={value!r}: expected one of {', '.join(choices)}")
    return s


def parse_path(key: str, value: Any) -> str:
    """An absolute path (~ expanded), or empty: a relative one would depend
    on the directory each process happens to start in."""
    s = os.path.expanduser(str(value).strip()) if value is not None else ""
    if not s:
        return ""
    if "\0" in s or not os.path.isabs(s):
        raise ConfigError(f"{key}={value!r}: expected an absolute path (or empty), not one relative to the "
                          "directory a process starts in")
    return s


def parse_remote_url(key: str, value: Any) -> str:
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


def parse_listen_setting(key: str, value: Any) -> str:
    parse_listen(value)
    return str(value).strip()


def parse_uids(key: str, value: Any) -> tuple[int, ...]:
    """uids as a list or a comma-separated string ("1000,1001")."""
    items = value if isinstance(value, (list, tuple)) else [x for x in str(value).split(",") if x.strip()]
    return tuple(parse_int(key, x.strip() if isinstance(x, str) else x, 0, (1 << 32) - 2) for x in items)


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


def check_cache_name(key: str, value: Any) -> str:
    s = str(value)
    if not _C.valid_cache_name(s):  # the core's rule, the one every open checks
        raise ConfigError(f"{key}={value!r}: expected {CACHE_NAME_RULE}")
    return s
