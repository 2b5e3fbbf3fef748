"""bench churn's reducer of a failing history (ddmin): the events a wrong
answer needs are kept, the rest removed, within the replay budget."""

from __future__ import annotations

from shmkv.bench.churn_bench import ddmin


def needs(*culprits):
    calls = []

    def fails(events):
        calls.append(list(events))
        return all(c in events for c in culprits)

    return fails, calls


def test_the_events_a_failure_needs_are_all_that_is_left():
    fails, calls = needs(7, 31)
    assert ddmin(list(range(40)), fails) == [7, 31]
    assert calls and all(len(c) < 40 for c in calls), "the full history is never replayed again"


def test_order_is_kept_and_one_culprit_alone_is_found():
    fails, _ = needs(12)
    assert ddmin(list(range(25)), fails) == [12]
    fails, _ = needs(3, 9, 17)
    assert ddmin([17, 3, 9, 1, 2], fails) == [17, 3, 9]


def test_a_failure_that_needs_nothing_before_it_leaves_nothing():
    fails, _ = needs()
    assert ddmin(list(range(10)), fails) == []


def test_a_failure_that_does_not_reproduce_leaves_the_history_whole():
    calls = []

    def never(events):
        calls.append(events)
        return False

    assert ddmin(list(range(16)), never) == list(range(16))
    assert len(calls) <= 16 + 8 + 4 + 2


def test_the_budget_bounds_the_replays():
    fails, calls = needs(5, 6, 30, 31, 50)
    out = ddmin(list(range(64)), fails, budget=5)
    assert len(calls) == 5
    assert all(c in out for c in (5, 6, 30, 31, 50)), "what is returned still fails"
