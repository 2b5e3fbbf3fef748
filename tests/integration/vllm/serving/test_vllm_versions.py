"""The vLLM versions shmkv supports: one range, which pip sees (the `vllm`
extra) and the connector and native tier check at start; outside it they
refuse in one line naming the version, unless SHMKV_UNTESTED_VLLM=1."""

from __future__ import annotations

import logging
import os

import pytest
import tomllib
from helpers import REPO

from shmkv.errors import ConfigError
from shmkv.integration.vllm import versions
from shmkv.integration.vllm.versions import SUPPORTED_VLLM, check_vllm_version, supported


@pytest.mark.parametrize("version,ok", [
    ("0.32.0", True), ("0.32.0+cpu", True), ("0.33.0", True), ("0.33.2+cu130", True),
    ("0.33.1.dev12+g1234abc", False), ("0.33.0rc1", False), ("0.32.1.dev0", False),
    ("0.34.0", False), ("0.34.0rc1", False), ("0.34.0.dev3", False),
    ("0.31.9", False), ("1.0.0", False), ("not a version", False),
])
def test_the_range(version, ok):
    assert supported(version) is ok


def test_the_installed_vllm_is_supported():
    import vllm

    assert supported(vllm.__version__), vllm.__version__
    check_vllm_version()


def test_pip_sees_the_same_range():
    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    assert extras["vllm"] == [f"vllm{SUPPORTED_VLLM}"]


def test_an_unknown_version_is_refused_in_one_line_naming_it():
    with pytest.raises(ConfigError) as e:
        check_vllm_version("0.35.1", env={})
    text = str(e.value)
    assert "\n" not in text and "vLLM 0.35.1" in text and SUPPORTED_VLLM.split(",")[0] in text
    assert "SHMKV_UNTESTED_VLLM=1" in text


def test_the_override_runs_it_with_one_warning(caplog, monkeypatch):
    monkeypatch.setattr(versions, "_warned", set())
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        for _ in range(3):
            check_vllm_version("0.35.1", env={"SHMKV_UNTESTED_VLLM": "1"})
    assert [r.getMessage().count("0.35.1") for r in caplog.records] == [1]


def test_the_connector_and_the_native_tier_refuse_before_anything_else(monkeypatch):
    import vllm

    from shmkv.integration.vllm.connector import ShmKVConnector
    from shmkv.integration.vllm.native_tier import ShmkvSecondaryTier

    monkeypatch.setattr(vllm, "__version__", "0.40.0")
    monkeypatch.delenv("SHMKV_UNTESTED_VLLM", raising=False)
    with pytest.raises(ConfigError, match=r"this is vLLM 0\.40\.0"):
        ShmKVConnector(None, None)
    with pytest.raises(ConfigError, match=r"this is vLLM 0\.40\.0"):
        ShmkvSecondaryTier(None, memoryview(b""), "shmkv")
