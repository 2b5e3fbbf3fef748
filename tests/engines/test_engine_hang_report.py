"""An engine that stops answering names where it is stuck: the harness's
error carries each of its processes' stacks (py-spy) and its log's tail, so a
hang on a CI machine (a rank stuck in a collective, a wait that never ends) is
diagnosed from the failure alone. The engine here is a stand-in that answers
"ready" as an engine does and then never answers again."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from shmkv.engines.engine import EngineProcess, EngineSpec

STUCK = r'''
import sys, time
print("SHMKV-JSON {\"ready\": true, \"block_size\": 16, \"attention_backends\": []}", flush=True)
print("the stand-in engine is serving", file=sys.stderr, flush=True)

def stuck_in_a_collective():
    time.sleep(600)

sys.stdin.readline()
stuck_in_a_collective()
'''


def test_a_silent_engine_reports_its_stacks_and_log(tmp_path):
    assert shutil.which("py-spy"), "py-spy is part of the test tools (scripts/setup.sh installs it)"

    def launch(spec_json, env, log_fd):
        return subprocess.Popen([sys.executable, "-c", STUCK], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=log_fd, env=env, start_new_session=True)

    engine = EngineProcess(EngineSpec(model_dir=str(tmp_path), in_process=True), str(tmp_path / "engine.log"),
                           start_timeout=60, launch=launch)
    try:
        with pytest.raises(TimeoutError) as err:
            engine.call(cmd="generate", prompts=[[1, 2, 3]], timeout=3)
    finally:
        engine.kill()
    text = str(err.value)
    assert f"py-spy dump of pid {engine.pid}" in text
    assert "stuck_in_a_collective" in text, "the stuck frame is named"
    assert "the stand-in engine is serving" in text, "the log's tail is included"
