#!/usr/bin/env python3
"""Coverage-guided fuzzing with atheris (libFuzzer) of shmkv's input parsers.

    python3 scripts/fuzz.py disk_format [libFuzzer flags, e.g. -runs=100000 -max_len=4096]
    python3 scripts/fuzz.py controller  [...]

  disk_format   shmkv.tiers.format.decode on arbitrary bytes (chunk files and
                remote values): it returns the checked payload or raises
                DamagedChunk, nothing else
  controller    shmkv.controller.Controller.handle on an arbitrary method,
                path and body against a small cache: 200 or 4xx, never 5xx

Any other exception, a crash or a hang is a finding (libFuzzer writes the input
to crash-*). The hypothesis tests in tests/test_fuzz_inputs.py cover the same
targets (and segment files) in the regular test run.
"""

from __future__ import annotations

import os
import sys
import uuid

import atheris

with atheris.instrument_imports():
    from shmkv.tiers import format as fmt


def disk_format(data: bytes) -> None:
    try:
        fmt.decode(data)
    except fmt.DamagedChunk:
        pass


_controller = None


def controller(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    method = fdp.PickValueInList(["GET", "POST", "PUT", "DELETE"])
    path = fdp.PickValueInList(["/health", "/stats", "/metrics", "/namespaces", "/lookup", "/clear", "/pin",
                                "/unpin", "/move", "/flush", fdp.ConsumeUnicodeNoSurrogates(20)])
    body = fdp.ConsumeBytes(fdp.remaining_bytes())
    status, _, out = _controller.handle(method, path, body)
    if status >= 500:
        raise AssertionError(f"{method} {path} {body[:200]!r} -> {status} {out[:300]!r}")


def main() -> None:
    global _controller
    if len(sys.argv) < 2 or sys.argv[1] not in ("disk_format", "controller"):
        sys.exit(__doc__)
    target = sys.argv.pop(1)
    if target == "controller":
        from shmkv import Store
        from shmkv.config import load_config
        from shmkv.services.controller import Controller

        name = f"shmkv-fuzz-{uuid.uuid4().hex[:8]}"
        store = Store.create(name, 8 << 20, populate=False)
        Store.unlink(name)  # the mapping stays ours; nothing is left behind
        for _ in range(8):
            store.put(os.urandom(16), b"x" * 1000)
        _controller = Controller(load_config({"cache_name": name, "chunk_size": 32}), store, None)
    atheris.Setup(sys.argv, {"disk_format": disk_format, "controller": controller}[target])
    atheris.Fuzz()


if __name__ == "__main__":
    main()
