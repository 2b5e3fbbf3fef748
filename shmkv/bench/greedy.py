"""Comparing a greedy answer with the truth (the same request recomputed
without shmkv's KV), for bench churn and the test suite alike.

Two answers that differ are not always a wrong KV: where the truth's own
logprobs put the two tokens at its first difference within NEAR_TIE of each
other, KV computed in another batch shape rounds differently in bf16 and can
order that near tie either way. What follows another choice is another
continuation and is not compared."""

from __future__ import annotations

from dataclasses import dataclass

NEAR_TIE = 0.02  # logprob: two tokens this close are a tie that bf16 rounding may order either way


@dataclass(frozen=True)
class Difference:
    position: int  # the first token that differs (or the shorter answer's length)
    tie: bool  # a near tie in the truth's own logprobs: not a wrong answer
    why: str


def first_difference(got: list[int], truth: list[int], truth_logprobs: list[dict[str, float]],
                     margin: float = NEAR_TIE) -> Difference | None:
    """None where `got` is `truth`; else where and how it first differs
    (`truth_logprobs`: per position, the truth's top tokens as {str(token): logprob})."""
    for i, (g, t) in enumerate(zip(got, truth)):
        if g == t:
            continue
        top = truth_logprobs[i] if i < len(truth_logprobs) else {}
        if str(g) not in top or str(t) not in top:
            return Difference(i, False, f"token {i}: {g} against {t}, not among the truth's top {len(top)} ({top})")
        gap = top[str(t)] - top[str(g)]
        if gap <= margin:
            return Difference(i, True, f"token {i}: {g} against {t}, a near tie ({gap:.4f})")
        return Difference(i, False, f"token {i}: {g} against {t}, {gap:.4f} below the truth's choice")
    if len(got) != len(truth):
        return Difference(min(len(got), len(truth)), False, f"{len(got)} tokens against {len(truth)}")
    return None
