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


def test_a_differing_answer_is_a_tie_only_within_the_truths_margin():
    from shmkv.bench.churn_bench import NEAR_TIE, near_tie

    truth, tied = [5, 6, 7], [{"5": -1.0}, {"6": -2.0, "9": -2.0}, {"7": -0.5}]
    assert near_tie([5, 9, 1], truth, tied) == 1, "an exact tie taken the other way; what follows is not compared"
    assert near_tie([5, 6, 7], truth, tied) is None, "equal answers are not a tie"
    apart = [{"5": -1.0, "8": -1.0 - 2 * NEAR_TIE}, {"6": -2.0}, {"7": -0.5}]
    assert near_tie([8, 6, 7], truth, apart) is None, "a clear divergence is wrong, not a tie"
    assert near_tie([4, 6, 7], truth, tied) is None, "a token outside the truth's top is wrong"
