"""A greedy answer against the truth (shmkv.bench.greedy.first_difference),
as bench churn and the suite's equality tests compare them: equal tokens are
no difference; a first difference is a near tie only where the truth's own
logprobs put both tokens within NEAR_TIE; what follows it is not compared."""

from shmkv.bench.greedy import NEAR_TIE, first_difference

TRUTH = [5, 6, 7]
TIED = [{"5": -1.0}, {"6": -2.0, "9": -2.0}, {"7": -0.5}]


def test_equal_answers_are_no_difference():
    assert first_difference([5, 6, 7], TRUTH, TIED) is None


def test_an_exact_tie_taken_the_other_way_is_a_tie_and_what_follows_is_not_compared():
    d = first_difference([5, 9, 1], TRUTH, TIED)
    assert d is not None and d.tie and d.position == 1


def test_a_gap_beyond_the_margin_is_a_wrong_answer_and_one_within_it_a_tie():
    apart = [{"5": -1.0, "8": -1.0 - 2 * NEAR_TIE}, {"6": -2.0}, {"7": -0.5}]
    d = first_difference([8, 6, 7], TRUTH, apart)
    assert d is not None and not d.tie and "below the truth's choice" in d.why
    near = [{"5": -1.0, "8": -1.0 - NEAR_TIE / 2}, {"6": -2.0}, {"7": -0.5}]
    assert first_difference([8, 6, 7], TRUTH, near).tie


def test_a_token_outside_the_truths_top_or_a_short_answer_is_wrong():
    d = first_difference([4, 6, 7], TRUTH, TIED)
    assert d is not None and not d.tie and "not among" in d.why
    d = first_difference([5, 6], TRUTH, TIED)
    assert d is not None and not d.tie and d.position == 2 and "tokens against" in d.why
