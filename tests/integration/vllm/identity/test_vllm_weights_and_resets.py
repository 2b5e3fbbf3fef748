"""What one engine does to itself never removes what others share, and new
weights never get old KV. Two engines of one model on one cache (vLLM's own
prefix cache off, so every hit comes through shmkv), given the same
kv_transfer_config, engine_id included, as a deployment template gives every
replica (#63 item 5: their weights boards are per engine instance; on
b7fe4e6 B read A's board and followed A's weights generation in case 2):

  * A's pause with cache clearing (the first half of vLLM's sleep(level>=1):
    its connector reset) removes nothing: B still hits, and so does A;
  * A's weights changed in memory through the model's load_weights (how
    reload_weights, the weight-transfer engines and RLHF loaders update
    weights): A loads nothing computed under the old weights, then its own
    new generation's chunks; B still hits the old ones with its old tokens;
  * A's weights put back in place (no loader) then vLLM's default
    reset_prefix_cache(): A is on its starting weights again and hits B's
    chunks with B's tokens;
  * A's weights changed in place by a collective_rpc function, no loader and
    no reset (#63 item 2): A loads none of B's chunks (on b7fe4e6 it loaded
    all 2,944 tokens of them and computed its last tokens on them).
"""

from __future__ import annotations

import pytest
from helpers import random_prompt

pytestmark = pytest.mark.slow

P = random_prompt(3000, seed=49)
HIT = 2944  # 11 whole chunks of 256 and the block-aligned part of the 12th that leaves a token to compute
NORM = "model.layers.0.input_layernorm.weight"
NORM_2 = "model.layers.1.input_layernorm.weight"


def test_resets_and_weight_changes_keep_what_others_share(cache_name, start_engine):
    cfg = {"cache_name": cache_name, "capacity": "256MiB"}  # defaults otherwise
    a = start_engine("weights-a", shmkv=cfg, engine_id="one-template")
    b = start_engine("weights-b", shmkv=cfg, engine_id="one-template")
    first = a.generate([P])
    assert first["num_cached_tokens"] == [0]
    base = first["outputs"][0]
    got = b.generate([P])
    assert got["num_cached_tokens"] == [HIT] and got["outputs"][0] == base, "B hits A's chunks"

    # 1. A's connector reset (pause with clear_cache: what sleep does first) removes nothing
    a.pause_and_resume()
    got = b.generate([P])
    assert got["num_cached_tokens"] == [HIT] and got["outputs"][0] == base, "B still hits after A's reset"
    got = a.generate([P])
    assert got["num_cached_tokens"] == [HIT] and got["outputs"][0] == base, "A hits again after its reset"

    # 2. A's weights change in memory through the loader: nothing old is loaded into them
    a.negate_weight(NORM, through_loader=True)
    changed = a.generate([P])
    assert changed["num_cached_tokens"] == [0], "no chunk of the old weights is loaded into the new ones"
    assert changed["outputs"][0] != base, "the change moves the output (else this case proves nothing)"
    again = a.generate([P])
    assert again["num_cached_tokens"] == [HIT] and again["outputs"][0] == changed["outputs"][0], \
        "A's new generation hits its own chunks"
    got = b.generate([P])
    assert got["num_cached_tokens"] == [HIT] and got["outputs"][0] == base, "B still hits the old weights' chunks"

    # 3. A's weights put back in place (no loader) and vLLM's default reset_prefix_cache()
    a.negate_weight(NORM, through_loader=False)
    got = a.generate([P])
    assert got["num_cached_tokens"] == [HIT] and got["outputs"][0] == base, \
        "A is on its starting weights again: B's chunks, B's tokens"

    # 4. A's weights changed in place by a user's function (collective_rpc), no loader, no reset
    a.negate_weight(NORM_2, through_loader=False, reset=False)
    got = a.generate([P])
    assert got["num_cached_tokens"] == [0], "a worker call that may write the weights moves A's keys"
    assert got["outputs"][0] != base, "the change moves the output (else this case proves nothing)"
    again = a.generate([P])
    assert again["num_cached_tokens"] == [HIT] and again["outputs"][0] == got["outputs"][0], "its own chunks hit"
