"""A Mooncake-format trace, scaled and sliced for this machine: hash ids
expand to the same tokens wherever they are expanded, shared ids give shared
prefixes, and the reuse ceilings count what a cache could serve (unlimited,
and an LRU cache of a budget), never a prompt's last token."""

from __future__ import annotations

import json
import os

import pytest

from shmkv.bench import trace

SHARED_TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "..", "shared", "traces",
                            "mooncake_conversation_trace.jsonl")


def write(tmp_path, rows) -> str:
    path = tmp_path / "t.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_shared_ids_give_shared_prefixes_and_the_same_tokens_everywhere(tmp_path):
    reqs = trace.load(write(tmp_path, [
        {"timestamp": 10, "input_length": 1500, "output_length": 40, "hash_ids": [0, 7, 8]},
        {"timestamp": 0, "input_length": 1100, "output_length": 30, "hash_ids": [0, 7, 9]},
    ]))
    assert [r.timestamp_ms for r in reqs] == [0, 10], "timestamp order"
    s = trace.scaled(reqs, 16)
    assert [(r.input_length, r.output_length) for r in s] == [(69, 1), (94, 2)]
    a, b = (trace.prompt_tokens(r, 32, 4096, seed=3) for r in s)
    assert len(a) == 69 and len(b) == 94
    assert a[:64] == b[:64] and a[64:69] != b[64:69], "ids 0 and 7 shared, then 9 vs 8"
    assert trace.prompt_tokens(s[0], 32, 4096, seed=3) == a, "deterministic"
    assert trace.prompt_tokens(s[0], 32, 4096, seed=4) != a, "the run's seed changes them"
    assert s[0].conversation == s[1].conversation == 7


def test_a_bad_line_or_scale_is_named(tmp_path):
    with pytest.raises(ValueError, match=":2: not a Mooncake trace line"):
        trace.load(write(tmp_path, [{"timestamp": 0, "input_length": 5, "output_length": 1, "hash_ids": [0]},
                                    {"timestamp": 1}]))
    with pytest.raises(ValueError, match="scale=7"):
        trace.scaled([], 7)


def test_the_ceilings_count_whole_units_seen_before_and_never_the_last_token():
    u = 4
    p1 = list(range(10, 22))  # 3 units
    p2 = p1[:8] + [99, 98, 97, 96, 95]  # shares 2 units
    p3 = list(p1)  # all 3 units seen, but its last token is computed: 2 units reusable
    assert trace.ceiling([p1, p2, p3], u) == 0 + 8 + 8
    assert trace.lru_ceiling([p1, p2, p3], u, capacity_units=100) == 16
    # a cache of 2 units holds only the last two units written: never a first unit when asked
    assert trace.lru_ceiling([p1, p2, p3], u, capacity_units=2) == 0
    p4 = p1 + [1, 2, 3, 4, 5]  # p1's three units reusable
    assert trace.ceiling([p1, p2, p4], u) == 8 + 12
    # 3 units: p2's own third unit evicts p1's third, so p4 finds only two
    assert trace.lru_ceiling([p1, p2, p4], u, capacity_units=3) == 8 + 8
    assert trace.working_set_units([p1, p2, p3], u) == 4


def test_conversations_are_sampled_with_all_their_turns():
    reqs = [trace.TraceRequest(float(i), 100, 10, (0, c, 100 + i)) for i, c in enumerate([1, 2, 1, 3, 2, 1])]
    got = trace.sample_conversations(reqs, 2, seed=1)
    convs = {r.conversation for r in got}
    assert len(convs) == 2
    assert got == [r for r in reqs if r.conversation in convs]
    assert trace.first_minutes(reqs, 0.00005) == reqs[:3]


@pytest.mark.skipif(not os.path.exists(SHARED_TRACE), reason="the shared trace is not beside the repository")
def test_the_shared_trace_loads_with_its_published_ceiling():
    reqs = trace.load(SHARED_TRACE)
    assert len(reqs) == 12031
    seen: set[tuple[int, ...]] = set()
    reused = blocks = 0
    for r in reqs:  # the README's figure: blocks whose whole prefix was seen before
        for k in range(1, len(r.hash_ids) + 1):
            blocks += 1
            reused += r.hash_ids[:k] in seen
        seen.update(r.hash_ids[:k] for k in range(1, len(r.hash_ids) + 1))
    assert (blocks, reused) == (288500, 105710)


def test_a_slice_is_written_for_vllms_timed_trace_from_time_zero(tmp_path):
    reqs = trace.scaled(trace.load(write(tmp_path, [
        {"timestamp": 5000, "input_length": 1500, "output_length": 400, "hash_ids": [0, 7, 8]},
        {"timestamp": 6500, "input_length": 1100, "output_length": 300, "hash_ids": [0, 7]},
    ])), 16)
    path = tmp_path / "slice.jsonl"
    trace.write_slice(reqs, [4, 5], str(path))
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows == [{"timestamp": 0.0, "input_length": 94, "output_length": 4, "hash_ids": [0, 7, 8]},
                    {"timestamp": 1500.0, "input_length": 69, "output_length": 5, "hash_ids": [0, 7]}]
    assert trace.load(str(path))[1].timestamp_ms == 1500.0, "a Mooncake-format file again"
