"""Two vLLM engines in two containers' PID namespaces and the daemon in a
third share one segment (`unshare --pid --fork --mount-proc` each: /proc and
pids not shared): engine 2 loads what engine 1 stored, with the output of a
run without the connector at the same split, and no store or load of either
is reclaimed under it by the other namespaces' maintenance (the daemon's
maintainer reclaims every pass). Two grants: the host's /dev/shm shared
(--ipc=host), or each container with a /dev/shm of its own and only the
segment directory shared (SHMKV_SEGMENT_DIR, a dedicated tmpfs)."""

from __future__ import annotations

import os
import subprocess

import pytest
from helpers import E2E_TOKENS, check_loaded_bytes_equal_stored, random_prompt

from shmkv import Store

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root (unshare), as in CI")]

P = random_prompt(3000, seed=41)


@pytest.fixture(params=["host-dev-shm", "segment-dir"])
def grant(request, tmp_path, monkeypatch):
    """What the containers share: {} (the host's /dev/shm), or the spec and
    environment of a segment directory (each container's /dev/shm its own)."""
    if request.param == "host-dev-shm":
        yield {}, {}
        return
    d = tmp_path / "segments"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512m,mode=0700", "shmkv-segments", str(d)], check=True)
    monkeypatch.setenv("SHMKV_SEGMENT_DIR", str(d))
    env = {"SHMKV_SEGMENT_DIR": str(d)}
    yield {"private_shm": True}, env
    subprocess.run(["umount", "-l", str(d)], check=False)


def test_engines_in_two_pid_namespaces_share_with_the_daemon_in_a_third(cache_name, start_engine, reference,
                                                                        daemon, tmp_path, grant):
    container, env = grant
    digests = str(tmp_path / "digests.txt")
    daemon(cache_name, "--capacity", "256MiB", pid_namespace=True, env=env, **container)
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    spec = {"pid_namespace": True, "env": env, **container}
    which = "own-shm" if container else "host-shm"
    a = start_engine(f"ns-a-{which}", shmkv=cfg, **spec)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0] and first["outputs"][0] == reference.output(P, 0)
    b = start_engine(f"ns-b-{which}", shmkv=cfg, **spec)
    r = b.generate([P])
    assert r["num_cached_tokens"] == [2944], "11 chunks and the 128-token tail piece, from the other namespace"
    assert len(r["outputs"][0]) == E2E_TOKENS and r["outputs"][0] == reference.output(P, 2944)
    assert check_loaded_bytes_equal_stored(digests) == 12
    with Store.attach(cache_name) as s:
        st = s.stats()
    # the daemon reclaimed every pass and took nothing from the live engines
    assert st["leases_reclaimed"] == 0 and st["writes_reclaimed"] == 0, st
    assert st["processes_attached"] >= 3, "both engines and the daemon, seen from this namespace"
