"""The suite's comparison of a greedy continuation with its truth
(helpers.greedy_agrees): equal tokens agree; a first difference agrees only
where the truth's own logprobs make it a near tie; a clear divergence, a
token outside the truth's top ones or another length does not."""

from __future__ import annotations

from helpers import NEAR_TIE, greedy_agrees

TRUTH = [5, 6, 7]
TIED = [{"5": -1.0}, {"6": -2.0, "9": -2.0}, {"7": -0.5}]  # at position 1, 6 and 9 tie exactly


def test_the_same_tokens_agree():
    assert greedy_agrees([5, 6, 7], TRUTH, TIED) is None


def test_a_tie_taken_the_other_way_agrees_and_what_follows_is_not_compared():
    assert greedy_agrees([5, 9, 1], TRUTH, TIED) is None


def test_a_clear_divergence_does_not_agree():
    apart = [{"5": -1.0, "8": -3.0}, {"6": -2.0}, {"7": -0.5}]
    assert "below the truth's choice" in greedy_agrees([8, 6, 7], TRUTH, apart)
    near = [{"5": -1.0, "8": -1.0 - NEAR_TIE / 2}, {"6": -2.0}, {"7": -0.5}]
    assert greedy_agrees([8, 6, 7], TRUTH, near) is None


def test_a_token_outside_the_truths_top_or_another_length_does_not_agree():
    assert "not among" in greedy_agrees([4, 6, 7], TRUTH, TIED)
    assert "tokens against" in greedy_agrees([5, 6], TRUTH, TIED)
