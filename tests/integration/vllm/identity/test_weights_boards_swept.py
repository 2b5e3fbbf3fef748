"""The weights boards and bells of engines that are gone do not pile up in
the runtime directory: each engine start removes those no live process
holds (an engine killed before its shutdown leaves them), keeps every live
engine's, and removes boards without a bell only once they are old."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from shmkv.integration.vllm import weights_boards as weights
from shmkv.paths import runtime_dir


@pytest.fixture(autouse=True)
def _private_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SHMKV_RUNTIME_DIR", str(tmp_path / "runtime"))


def names() -> set[str]:
    return {e.name for e in runtime_dir().scandir() if e.name.startswith("weights-")}


def test_a_gone_engines_files_are_swept_and_a_live_ones_kept(tmp_path):
    weights.write_board("live", 0, {"fingerprint": "a"})  # this process holds the live engine's bell
    # an engine that was killed: its process held the bell and is gone
    code = ("from shmkv.integration.vllm import weights_boards as w; "
            "w.write_board('killed', 0, {'fingerprint': 'b'}); w.write_board('killed', 1, {'fingerprint': 'c'})")
    subprocess.run([sys.executable, "-c", code], check=True, env=dict(os.environ))
    assert {"weights-bell.killed", "weights-board.killed.0", "weights-board.killed.1"} <= names()
    removed = weights.sweep_stale("starting")
    assert removed == 3
    assert names() == {"weights-bell.live", "weights-board.live.0"}, "the live engine's files stay"
    weights.remove_boards("live", 1)
    assert names() == set()


def test_a_bell_held_by_another_live_process_is_kept():
    code = ("import sys; from shmkv.integration.vllm import weights_boards as w; "
            "w.write_board('other', 0, {}); print('held', flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=dict(os.environ))
    try:
        assert p.stdout.readline().strip() == "held"
        assert weights.sweep_stale("starting") == 0
        assert {"weights-bell.other", "weights-board.other.0"} <= names()
    finally:
        p.stdin.close()
        p.wait(30)
    assert weights.sweep_stale("starting") == 2, "gone now: swept"


def test_boards_without_a_bell_go_only_once_old():
    rd = runtime_dir()
    for name in ("weights-board.old.0", "weights-board.young.0"):
        os.close(rd.open(name, os.O_WRONLY | os.O_CREAT, 0o600))
    past = time.time() - weights.ORPHAN_BOARD_S - 60
    os.utime(rd.join("weights-board.old.0"), (past, past))
    assert weights.sweep_stale("starting") == 1
    assert names() == {"weights-board.young.0"}
