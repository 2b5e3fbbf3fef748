"""Which vLLM engines the connector serves, and which it turned off for, and why.

Each engine's scheduler half records its decision once, when it is final
(at start, after every worker has reported; vLLM's handshake), in

    <runtime dir>/<cache>.engines.jsonl     0600, one JSON object per line

{"time", "pid", "model", "on", "reason"}, appended with O_APPEND (one line is
one write(2)). `python -m shmkv.stats` counts them and shows the last engine
the connector turned off, so an operator sees an engine that started without
the cache without reading its log. Only the file's last MAX_READ bytes are
read: a host restarting engines for years keeps a bounded read.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import time
from typing import Any

from shmkv.paths import runtime_dir

log = logging.getLogger("shmkv.engines")

MAX_READ = 1 << 20  # bytes of the registry's tail that a reader looks at


def _name(cache_name: str) -> str:
    return f"{cache_name}.engines.jsonl"


def record(cache_name: str, model: str, on: bool, reason: str | None = None) -> None:
    """Append this engine's decision (never raises: the registry is for operators)."""
    line = json.dumps({"time": round(time.time(), 3), "pid": os.getpid(), "model": model, "on": on,
                       "reason": reason}, sort_keys=True) + "\n"
    try:
        fd = runtime_dir().open(_name(cache_name), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except Exception as e:  # noqa: BLE001 - never a reason for vLLM not to start
        log.warning("shmkv: cannot record this engine's connector state in %s: %s", _name(cache_name), e)


def summary(cache_name: str) -> dict[str, Any]:
    """{"on": engines started with the connector on, "off": ... off,
    "last_off": the last off record or None} over the registry's tail."""
    out: dict[str, Any] = {"on": 0, "off": 0, "last_off": None}
    try:
        fd = runtime_dir().open(_name(cache_name), os.O_RDONLY | os.O_NONBLOCK)
    except (FileNotFoundError, OSError):
        return out
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            return out  # a FIFO or device planted at the name: nothing to read
        size = st.st_size
        f.seek(max(0, size - MAX_READ))
        lines = f.read(MAX_READ).splitlines()
    if size > MAX_READ:
        lines = lines[1:]  # the first may be cut
    for raw in lines:
        try:
            rec = json.loads(raw)
            on = bool(rec["on"])
        except (ValueError, KeyError, TypeError):
            continue  # a torn or foreign line
        out["on" if on else "off"] += 1
        if not on:
            out["last_off"] = {k: rec.get(k) for k in ("time", "pid", "model", "reason")}
    return out
