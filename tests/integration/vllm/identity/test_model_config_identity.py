"""The KV's identity covers the model's configuration as the engine computes
with it (#63): two engines of one checkpoint directory whose configs differ
only in config.json or in vLLM's overrides (rope_theta, a YaRN rope scaling
given as hf_overrides, the norm epsilon, the activation) never share keys;
the same configuration gives the same field in every process; bookkeeping
keys (token ids, transformers' version) do not move it. Checked on vLLM's
own ModelConfig, no engine started (the two-engine case is
test_vllm_model_config.py)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("vllm")

from shmkv.integration.vllm.engine_inputs import model_config_field  # noqa: E402


def field_of(model_dir: str, **kw) -> str:
    from vllm.config import ModelConfig, VllmConfig

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=1024, **kw)
    ((name, value),) = model_config_field(VllmConfig(model_config=mc))
    assert name == "model_config"
    return value


@pytest.fixture
def edited(model_dir, tmp_path):
    """edited(**changes) -> a copy of the test model whose config.json has these changes (weights untouched)."""
    def make(**changes) -> str:
        d = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"
        shutil.copytree(model_dir, d)
        cfg = json.loads((d / "config.json").read_text())
        assert all(cfg.get(k) != v for k, v in changes.items()), f"{changes} changes nothing in {cfg}"
        cfg.update(changes)
        (d / "config.json").write_text(json.dumps(cfg))
        return str(d)
    return make


def test_the_same_configuration_gives_the_same_field_in_every_process(model_dir):
    code = ("import sys; sys.path[:0] = sys.argv[2:]; from test_model_config_identity import field_of; "
            "print(field_of(sys.argv[1]))")
    here = __import__("os").path.dirname(__file__)
    other = subprocess.run([sys.executable, "-c", code, model_dir, here], capture_output=True, text=True, timeout=300)
    assert other.returncode == 0, other.stderr[-2000:]
    assert other.stdout.strip().splitlines()[-1] == field_of(model_dir)


@pytest.mark.parametrize("change", [{"rope_theta": 1_000_000.0}, {"rms_norm_eps": 1e-3}, {"hidden_act": "gelu"}],
                         ids=["rope_theta", "rms_norm_eps", "hidden_act"])
def test_a_config_json_edit_that_shapes_kv_moves_the_field(model_dir, edited, change):
    copy_same, copy_changed = edited(), edited(**change)
    assert field_of(copy_same) == field_of(model_dir), "a copy of the same files keeps its field"
    assert field_of(copy_changed) != field_of(model_dir), f"{change} shapes K and V"


def test_a_rope_scaling_override_moves_the_field(model_dir):
    yarn = {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024,
                                "rope_theta": 10000.0}}
    assert field_of(model_dir, hf_overrides=yarn) != field_of(model_dir)


def test_bookkeeping_keys_do_not_move_it(model_dir, edited):
    assert field_of(edited(eos_token_id=7, bos_token_id=5, transformers_version="0.0.1")) == field_of(model_dir)
