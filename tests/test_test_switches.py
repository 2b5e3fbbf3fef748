"""The faults only the suite switches on (shmkv/testing.py): read from
SHMKV_TEST_* variables, off when unset, a bad value refused naming its
variable, and a switch that is on said in a WARNING naming it."""

from __future__ import annotations

import logging

import pytest

from shmkv.errors import ConfigError
from shmkv.testing import EVICT_BEFORE_LOAD, SKIP_LOAD_LAYERS, WORKER_OFF, switches


def test_unset_means_off():
    got = switches({})
    assert (got.skip_load_layers, got.evict_before_load, got.worker_off) == ("", False, "")


def test_each_switch_is_read_and_said(caplog, monkeypatch):
    import shmkv.testing

    monkeypatch.setattr(shmkv.testing, "_warned", set())  # said once per process: this test's process too
    with caplog.at_level(logging.WARNING, logger="shmkv"):
        got = switches({SKIP_LOAD_LAYERS: "linear_attn", EVICT_BEFORE_LOAD: "1", WORKER_OFF: "why"})
    assert (got.skip_load_layers, got.evict_before_load, got.worker_off) == ("linear_attn", True, "why")
    said = " ".join(r.getMessage() for r in caplog.records)
    assert all(name in said for name in (SKIP_LOAD_LAYERS, EVICT_BEFORE_LOAD, WORKER_OFF)), said


@pytest.mark.parametrize("env,named", [({SKIP_LOAD_LAYERS: "("}, SKIP_LOAD_LAYERS),
                                       ({EVICT_BEFORE_LOAD: "yes please"}, EVICT_BEFORE_LOAD)])
def test_a_bad_value_is_refused_naming_its_variable(env, named):
    with pytest.raises(ConfigError, match=named):
        switches(env)


def test_an_eviction_can_be_one_ranks():
    got = switches({EVICT_BEFORE_LOAD: "rank:1"})
    assert (got.evict_before_load, got.evict_rank) == (True, 1)
    assert switches({EVICT_BEFORE_LOAD: "1"}).evict_rank is None
    with pytest.raises(ConfigError, match=EVICT_BEFORE_LOAD):
        switches({EVICT_BEFORE_LOAD: "rank:x"})
