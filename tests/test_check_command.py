"""`shmkv check`, the operator's command before serving: the settings in
force with where each came from, and one line per check; every failure it
names comes with its fix and makes the exit status 1 (each failure is made
here: a segment directory that is not memory or under a parent others can
change, a capacity that does not fit, a runtime directory others can
write, a segment of another user, a model directory that is not one), and a
host without a GPU says why the GPU checks are skipped."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import REPO, SETPRIV

from shmkv import Store

ROOT = pytest.mark.skipif(os.geteuid() != 0, reason="mounts and other users' files need root, as in CI")


def check(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith("SHMKV_")}
    return subprocess.run([sys.executable, "-m", "shmkv.cli", "check", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=300, env={**e, **(env or {})})


def by_name(out: str) -> dict:
    r = json.loads(out)
    return {c["check"]: c for c in r["checks"]} | {"_": r}


@pytest.fixture
def cache(cache_name):
    yield cache_name
    Store.unlink(cache_name)


def test_a_host_ready_to_serve(cache, tmp_path):
    cfg = tmp_path / "shmkv.yaml"
    cfg.write_text("chunk_size: 128\n")
    os.chmod(cfg, 0o600)
    r = check("--cache", cache, "--config", str(cfg), "--json", env={"SHMKV_CAPACITY": "64MiB"})
    assert r.returncode == 0, r.stdout + r.stderr
    got = by_name(r.stdout)
    settings = got["_"]["settings"]
    assert settings["capacity"] == {"value": 64 << 20, "source": "environment SHMKV_CAPACITY"}
    assert settings["chunk_size"] == {"value": 128, "source": f"file {cfg}"}
    assert settings["cache_name"] == {"value": cache, "source": "explicit"}
    assert settings["lock_timeout"]["source"] == "default"
    seg = got["segment"]
    assert seg["status"] == "ok" and seg["data"]["existed"] is False
    assert seg["data"]["outcome"] == "created for the check and removed" and seg["data"]["segment"] != cache
    assert seg["data"]["capacity_bytes"] == 64 << 20, "the geometry the daemon would create"
    assert not os.path.exists(f"/dev/shm/{cache}") and not os.path.exists(f"/dev/shm/{seg['data']['segment']}")
    assert got["_"]["left"] == []
    assert {got[k]["status"] for k in ("segment directory", "capacity", "other users")} == {"ok"}
    assert got["huge pages"]["status"] in ("ok", "warn")
    if got["huge pages"]["status"] == "warn":
        assert "huge=within_size" in got["huge pages"]["fix"]
    gpu = [c for k, c in got.items() if k.startswith("gpu")]
    assert gpu and all(c["status"] in ("ok", "skip") for c in gpu)
    text = check("--cache", cache, env={"SHMKV_CAPACITY": "64MiB"})
    assert text.returncode == 0 and "ready to serve" in text.stdout
    assert "capacity" in text.stdout and "environment SHMKV_CAPACITY" in text.stdout


def test_an_existing_segment_is_attached_as_it_is_and_keeps_its_chunks(cache):
    with Store.create(cache, 32 << 20, populate=False) as s:
        s.put(b"k" * 16, b"kept" * 1000)
        got = by_name(check("--cache", cache, "--json").stdout)
        seg = got["segment"]
        assert seg["status"] == "ok" and seg["data"]["existed"] is True and seg["data"]["segment"] == cache
        assert seg["data"]["outcome"] == "attached" and seg["data"]["capacity_bytes"] == 32 << 20
        assert bytes(s.get(b"k" * 16)) == b"kept" * 1000 and s.stats()["ready_entries"] == 1, "the probe chunk gone"


@pytest.mark.skipif(os.path.exists("/proc/driver/nvidia") or os.path.exists("/dev/nvidiactl"),
                    reason="an NVIDIA driver is here: the GPU checks run instead")
def test_without_a_gpu_the_gpu_checks_say_why(cache):
    got = by_name(check("--cache", cache, "--json", env={"SHMKV_CAPACITY": "64MiB"}).stdout)
    assert got["gpu"]["status"] == "skip" and got["gpu"]["detail"].startswith("no NVIDIA driver on this host")


def test_a_capacity_that_does_not_fit_fails_with_its_fix(cache):
    r = check("--cache", cache, "--json", env={"SHMKV_CAPACITY": "1000TiB"})
    assert r.returncode == 1
    c = by_name(r.stdout)["capacity"]
    assert c["status"] == "fail" and "does not fit" in c["detail"] and c["fix"].startswith("set capacity at most")


def test_a_segment_directory_that_is_not_memory_fails(cache, tmp_path):
    d = tmp_path / "segments"
    d.mkdir(mode=0o700)
    r = check("--cache", cache, "--json", env={"SHMKV_SEGMENT_DIR": str(d), "SHMKV_CAPACITY": "64MiB"})
    assert r.returncode == 1
    got = by_name(r.stdout)
    assert got["segment directory"]["status"] == "fail" and "not memory" in got["segment directory"]["detail"]
    assert got["segment directory"]["fix"].startswith("mount a tmpfs there")
    assert got["segment"]["status"] == "skip"
    text = check("--cache", cache, env={"SHMKV_SEGMENT_DIR": str(d), "SHMKV_CAPACITY": "64MiB"}).stdout
    assert "[fail] segment directory" in text and "fix: mount a tmpfs there" in text and "FAILED" in text


@ROOT
def test_a_segment_directory_under_a_parent_others_can_change_fails(cache, tmp_path):
    parent = tmp_path / "open"
    parent.mkdir()
    os.chmod(parent, 0o777)
    d = parent / "segments"
    d.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "shmkv-segments", str(d)], check=True)
    try:
        r = check("--cache", cache, "--json", env={"SHMKV_SEGMENT_DIR": str(d), "SHMKV_CAPACITY": "8MiB"})
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False)
    assert r.returncode == 1
    c = by_name(r.stdout)["segment directory"]
    assert c["status"] == "fail" and str(parent) in c["detail"] and "below ones only root" in c["fix"]


def test_a_runtime_directory_others_can_write_fails(cache, tmp_path):
    rt = tmp_path / "runtime"
    rt.mkdir()
    os.chmod(rt, 0o777)
    r = check("--cache", cache, "--json", env={"SHMKV_RUNTIME_DIR": str(rt), "SHMKV_CAPACITY": "64MiB"})
    assert r.returncode == 1
    c = by_name(r.stdout)["other users"]
    assert c["status"] == "fail" and "runtime directory" in c["detail"] and "mode 0700" in c["fix"]


@ROOT
@pytest.mark.skipif(SETPRIV is None, reason="another user needs setpriv")
def test_a_segment_another_user_planted_fails(cache):
    path = f"/dev/shm/{cache}"
    with open(path, "wb") as f:
        f.truncate(1 << 20)
    os.chown(path, 65534, 65534)
    try:
        r = check("--cache", cache, "--json", env={"SHMKV_CAPACITY": "64MiB"})
    finally:
        os.unlink(path)
    assert r.returncode == 1
    got = by_name(r.stdout)
    assert got["other users"]["status"] == "fail" and "uid 65534" in got["other users"]["detail"]
    assert got["segment"]["status"] == "fail" and "uid" in got["segment"]["fix"]


def test_a_vllm_model_that_is_not_a_directory_fails_with_its_fix(cache, tmp_path):
    r = check("--cache", cache, "--json", "--vllm", str(tmp_path / "nothing"), env={"SHMKV_CAPACITY": "64MiB"})
    assert r.returncode == 1
    c = by_name(r.stdout)["vllm"]
    assert c["status"] == "fail" and "not a model directory" in c["detail"] and "`tiny`" in c["fix"]


def _check_files(cache: str) -> set[str]:
    """The files a check of `cache` could make: its segments, runtime files and work directory."""
    from shmkv.paths import runtime_dir_path

    out = set()
    for d in ("/dev/shm", runtime_dir_path(), "/tmp"):
        if os.path.isdir(d):
            out |= {os.path.join(d, n) for n in os.listdir(d) if n.startswith((cache, "shmkv-check-"))}
    return out


@pytest.mark.slow
def test_two_engines_on_a_tiny_model_share_the_prompt_and_leave_nothing(cache):
    """As an operator runs it on a host with no segment, the settings left at
    their defaults (the default capacity: a quarter of /dev/shm): the engines
    share the prompt, and the host holds what it held before (#67: the check
    left a populated default-size segment behind)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    assert not os.path.exists(f"/dev/shm/{cache}")
    before = _check_files(cache)
    r = check("--cache", cache, "--json", "--vllm", "tiny")
    got = by_name(r.stdout)
    assert r.returncode == 0, (got.get("vllm"), r.stderr[-2000:])
    assert got["vllm"]["data"]["hit_tokens"] > 0 and got["vllm"]["data"]["outputs_equal"] is True
    assert got["segment"]["data"]["existed"] is False
    assert got["_"]["left"] == []
    assert _check_files(cache) == before, "the check left its segment, runtime files or work directory"
