"""The `shmkv` command dispatches to the same tools as `python -m`, and the
optional dependencies stay optional: nothing imports redis unless a remote
tier is configured."""

from __future__ import annotations

import subprocess
import sys

import pytest
from helpers import REPO

from shmkv.cli import main
from shmkv.config import load_config
from shmkv.errors import ConfigError


def test_help_lists_the_subcommands(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in ("daemon", "stats", "bench"))
    assert main(["frobnicate"]) == 2


def test_stats_subcommand_is_python_m_shmkv_stats(cache_name, capsys):
    assert main(["stats", "--cache", cache_name]) == 1  # no such cache: the same message and status
    assert f"no cache named '{cache_name}'" in capsys.readouterr().err


def test_daemon_and_connector_modules_do_not_import_redis():
    code = ("import sys; import shmkv.services.daemon, shmkv.services.controller, shmkv.services.maintainer, "
            "shmkv.services.stats; assert 'redis' not in sys.modules, 'redis imported without a remote tier'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert r.returncode == 0, r.stderr


def test_a_remote_url_without_redis_names_the_extra(monkeypatch):
    from shmkv.tiers.remote import open_remote

    monkeypatch.setitem(sys.modules, "redis", None)  # as if redis-py were not installed
    monkeypatch.delitem(sys.modules, "shmkv.tiers.remote.tier", raising=False)
    with pytest.raises(ConfigError, match=r"shmkv\[remote\]"):
        open_remote(load_config({"remote_url": "redis://127.0.0.1:1"}, env={}))


def test_one_version_and_the_vllm_plugin_entry_point():
    from importlib.metadata import entry_points, version

    import shmkv

    assert version("shmkv") == shmkv.__version__, "pyproject takes the version from shmkv/__init__.py"
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("shmkv") == "shmkv.integration.vllm:register"


def test_bench_gpu_without_a_gpu_says_so_on_one_line():
    from helpers import cuda_missing

    if cuda_missing() is None:
        pytest.skip("a CUDA GPU is here: `python -m shmkv.bench gpu` measures instead")
    for extra in ([], ["--json"]):
        r = subprocess.run([sys.executable, "-m", "shmkv.bench", "gpu", *extra], capture_output=True, text=True,
                           timeout=120, cwd=REPO)
        assert r.returncode == 0, r.stderr[-2000:]
        lines = r.stdout.strip().splitlines()
        assert len(lines) == 1 and "no CUDA GPU" in lines[0], r.stdout


def test_the_build_leaves_nothing_at_the_repository_root():
    """CMake builds in a temporary directory (pyproject.toml): after
    scripts/setup.sh the root holds what git tracks, and no build output."""
    import os

    import shmkv

    leftovers = {"CMakeCache.txt", "CMakeFiles", "build.ninja", "build", "_skbuild", "cmake_install.cmake",
                 ".ninja_deps", ".ninja_log"} & set(os.listdir(REPO))
    assert not leftovers, f"build output at {REPO}: {sorted(leftovers)}"
    assert shmkv._C.__name__ == "shmkv._C", "and the extension is installed"


def test_ctl_sends_the_token_by_itself(cache_name, daemon, capsys):
    d = daemon(cache_name, "--capacity", "16MiB", "--listen", "127.0.0.1:0")
    rc = main(["ctl", "--cache", cache_name, "--listen", d.url.removeprefix("http://"), "GET", "/stats"])
    out = capsys.readouterr().out
    assert rc == 0 and f'"cache": "{cache_name}"' in out, out
    rc = main(["ctl", "--cache", "shmkv-no-such-cache", "--listen", d.url.removeprefix("http://"), "GET", "/stats"])
    assert rc == 2 and "no controller token at" in capsys.readouterr().err
