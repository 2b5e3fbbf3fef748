"""Which kv_load_failure_policy the user gave on vLLM's command line: vLLM
0.32 does not record set fields, so shmkv reads the argv the engine
processes inherit from `vllm serve`; a value given there is kept."""

from __future__ import annotations

import json

import pytest

from shmkv.integration.vllm.engine_inputs import explicit_load_failure_policy

KTC = {"kv_connector": "ShmKVConnector", "kv_role": "kv_both"}


@pytest.mark.parametrize("argv,policy", [
    (["vllm", "serve", "m", "--kv-transfer-config", json.dumps({**KTC, "kv_load_failure_policy": "fail"})], "fail"),
    (["serve", "--kv-transfer-config=" + json.dumps({**KTC, "kv_load_failure_policy": "recompute"})], "recompute"),
    (["serve", "--kv_transfer_config", json.dumps({**KTC, "kv_load_failure_policy": "fail"})], "fail"),
    (["serve", "--kv-transfer-config", json.dumps(KTC), "--kv-transfer-config.kv_load_failure_policy", "fail"],
     "fail"),
    (["serve", "--kv-transfer-config.kv-load-failure-policy=fail"], "fail"),
    (["serve", "--kv-transfer-config", json.dumps(KTC)], None),  # not given: shmkv's default applies
    (["serve", "--kv-transfer-config", "{not json"], None),
    (["serve", "--kv-transfer-config"], None),
    (["serve", "--model", "kv_load_failure_policy"], None),
    (["python", "script.py"], None),
])
def test_explicit_policy_from_argv(argv, policy):
    assert explicit_load_failure_policy(argv) == policy
