"""With default settings (kv_connector_extra_config={}), engines that do not
overlap in time share the cache: engine 1 stores and exits, engine 2 starts
afterwards and hits, whether engine 1 was shut down with time for its
teardown (its connectors' shutdown runs to its end with no error in the log;
the connector used to shadow vLLM's own `_role` attribute and fail there) or
killed outright, as `vllm serve` does with its default --shutdown-timeout 0."""

from __future__ import annotations

import os
import re
import subprocess

import pytest
from helpers import random_prompt

from shmkv import Store
from shmkv.config import default_capacity

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=11)
ERROR_LINE = re.compile(r"Traceback|AttributeError| ERROR |\bError\b.*shutdown", re.IGNORECASE)


@pytest.fixture
def env(cache_name, tmp_path, monkeypatch):
    """The test's own segment, every other setting the default. As root (CI),
    in a 2 GiB tmpfs of its own (SHMKV_SEGMENT_DIR): the default capacity is
    then a quarter of that (512 MiB), still computed as for /dev/shm, and the
    populated segment does not take a quarter of the host's memory while
    other tests' engines run."""
    env = {"SHMKV_CACHE_NAME": cache_name}
    if os.geteuid() == 0:
        d = tmp_path / "segments"
        d.mkdir(mode=0o700)
        subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2g,mode=0700", "shmkv-segments", str(d)], check=True)
        monkeypatch.setenv("SHMKV_SEGMENT_DIR", str(d))
        env["SHMKV_SEGMENT_DIR"] = str(d)
    yield env
    if "SHMKV_SEGMENT_DIR" in env:
        subprocess.run(["umount", "-l", env["SHMKV_SEGMENT_DIR"]], check=False)


def _second_engine_hits(label, cache_name, start_engine, reference, env) -> None:
    b = start_engine(label, shmkv={}, env=env)
    r = b.generate([P])
    assert r["num_cached_tokens"][0] == 2944, "11 chunks and the 128-token tail piece, from engine 1"
    assert r["outputs"][0] == reference.output(P, 2944)
    st = Store.attach(cache_name, populate=False).stats()
    assert st["capacity_bytes"] == default_capacity() and st["segment_resets"] == 0


def test_default_settings_survive_a_restart(cache_name, start_engine, reference, env):
    # vLLM's own process split: EngineCore's teardown (and its 5 s limit) is what this checks
    a = start_engine("defaults-a", shmkv={}, env=env, in_process=False)
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]
    a.close()
    log = open(a.log_path, errors="replace").read()
    assert "[shutdown]" in log, "vLLM logged its teardown"
    # the teardown: from vLLM's first [shutdown] line (before it, vLLM's own start-up warnings,
    # e.g. its chat-template warmup traceback when there is no tokenizer, are not shmkv's)
    teardown = log[log.index("[shutdown]"):]
    bad = [line for line in teardown.splitlines() if ERROR_LINE.search(line)]
    assert not bad, "errors in engine 1's teardown:\n" + "\n".join(bad[:20])
    assert "exists with other settings" not in log
    assert "worker connector shut down" in log and "scheduler connector shut down" in log, "shutdown ran to its end"
    _second_engine_hits("defaults-b", cache_name, start_engine, reference, env)


def test_a_killed_engine_leaves_its_chunks(cache_name, start_engine, reference, env):
    a = start_engine("killed-a", shmkv={}, env=env)  # one process: SIGKILL ends engine and EngineCore at once
    assert a.generate([P])["num_cached_tokens"] == [0]
    a.kill()
    log = open(a.log_path, errors="replace").read()
    assert "connector shut down" not in log, "killed: no teardown ran"
    _second_engine_hits("killed-b", cache_name, start_engine, reference, env)
