"""bench churn's per-kind table counts a change as recovered when a request
between it and the next change hit (the cache served again after it), the
requests of a rolling restart's steps included."""

from __future__ import annotations

from shmkv.bench.churn_bench import recovered_changes


def test_a_change_recovers_only_by_a_hit_before_the_next_change():
    first = {"type": "change", "kind": "restart"}
    second = {"type": "change", "kind": "weights_rewrite"}
    third = {"type": "change", "kind": "eviction_storm"}
    history = [
        {"type": "run"},
        {"type": "request", "hit": 512},  # before any change: nobody's recovery
        first, {"type": "request", "hit": 0}, {"type": "request", "hit": 256},
        second, {"type": "step", "engine": 0}, {"type": "request", "hit": 0}, {"type": "request"},
        third, {"type": "request", "hit": 0, "verdict": "miss"},
    ]
    got = recovered_changes(history)
    assert [got[id(c)] for c in (first, second, third)] == [True, False, False]


def test_a_hit_after_a_rolling_restarts_steps_counts_for_that_change():
    change = {"type": "change", "kind": "config_edit"}
    history = [change, {"type": "step", "engine": 0}, {"type": "request", "hit": 0},
               {"type": "step", "engine": 1}, {"type": "request", "hit": 768}]
    assert recovered_changes(history) == {id(change): True}
