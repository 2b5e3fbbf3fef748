"""Two vLLM engines in two containers' PID namespaces and the daemon in a
third share one segment (`unshare --pid --fork --mount-proc` each: /dev/shm
shared, /proc and pids not): engine 2 loads what engine 1 stored, with the
output of a run without the connector at the same split, and no store or
load of either is reclaimed under it by the other namespaces' maintenance
(the daemon's maintainer reclaims every pass)."""

from __future__ import annotations

import os

import pytest
from helpers import E2E_TOKENS, check_loaded_bytes_equal_stored, random_prompt

from shmkv import Store

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(os.geteuid() != 0, reason="PID namespaces need root (unshare), as in CI")]

P = random_prompt(3000, seed=41)


def test_engines_in_two_pid_namespaces_share_with_the_daemon_in_a_third(cache_name, start_engine, reference,
                                                                        daemon, tmp_path):
    digests = str(tmp_path / "digests.txt")
    daemon(cache_name, "--capacity", "256MiB", pid_namespace=True)
    cfg = {"cache_name": cache_name, "capacity": "256MiB", "debug_digest_file": digests}
    a = start_engine("ns-a", shmkv=cfg, pid_namespace=True)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0] and first["outputs"][0] == reference.output(P, 0)
    b = start_engine("ns-b", shmkv=cfg, pid_namespace=True)
    r = b.generate([P])
    assert r["num_cached_tokens"] == [2944], "11 chunks and the 128-token tail piece, from the other namespace"
    assert len(r["outputs"][0]) == E2E_TOKENS and r["outputs"][0] == reference.output(P, 2944)
    assert check_loaded_bytes_equal_stored(digests) == 12
    with Store.attach(cache_name) as s:
        st = s.stats()
    # the daemon reclaimed every pass and took nothing from the live engines
    assert st["leases_reclaimed"] == 0 and st["writes_reclaimed"] == 0, st
    assert st["processes_attached"] >= 3, "both engines and the daemon, seen from this namespace"
