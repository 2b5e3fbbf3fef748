"""README's recipes are safe to copy on a shared host: no credential on a
command line (every user reads /proc/PID/cmdline), the systemd unit's
runtime directory made by systemd (at /tmp/shmkv-<uid> any user could make it
first), and KV events (prompt token ids) published on loopback or a local
socket only."""

from __future__ import annotations

import os
import re

from helpers import REPO


def readme() -> str:
    """README and every page of docs/: the recipes a user copies."""
    paths = [os.path.join(REPO, "README.md")] + sorted(
        os.path.join(REPO, "docs", f) for f in os.listdir(os.path.join(REPO, "docs")) if f.endswith(".md"))
    return "\n".join(open(p).read() for p in paths)


def code_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", readme(), re.M | re.S)


def test_no_recipe_puts_the_controller_token_on_a_command_line():
    lines = [line for block in code_blocks("bash") for line in block.splitlines() if "Authorization" in line]
    assert lines, "README shows how to send the token with curl"
    for line in lines:
        # a header given as an argument (-H "Authorization: Bearer ...") is in argv; -H @FILE is not
        assert not re.search(r"""-H\s+["']Authorization""", line), line
        assert "-H @" in line, line


def test_the_systemd_unit_has_systemd_make_the_runtime_directory():
    (unit,) = [b for b in code_blocks("ini") if "ExecStart=" in b and "shmkv daemon" in b]
    settings = dict(line.split("=", 1) for line in unit.splitlines() if "=" in line and not line.startswith("#"))
    assert settings["RuntimeDirectory"] == "shmkv" and settings["RuntimeDirectoryMode"] == "0700"
    assert settings["Environment"] == "SHMKV_RUNTIME_DIR=/run/shmkv"  # %t/shmkv of a system unit


def test_kv_events_are_published_on_loopback_only():
    endpoints = re.findall(r'"endpoint":\s*"([^"]+)"', readme())
    assert endpoints, "README shows a KV events configuration"
    for endpoint in endpoints:
        assert endpoint.startswith(("tcp://127.0.0.1:", "tcp://[::1]:", "ipc://")), endpoint
