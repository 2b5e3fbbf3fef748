"""The suite's schedule (tests/conftest.py sorts the collected items with
longest_first; pyproject's addopts turn off xdist's own reordering): xdist
--dist loadfile hands files out in collection order, so the longest go first."""

from __future__ import annotations

# The files that take longest (seconds of a full run on 2 cores, --durations: the benchmark runs, the
# suites of several engine pairs), run first: xdist hands files out in collection order, and a long
# file started last keeps one worker busy while the other has nothing left (a longest-first schedule)
LONGEST_FIRST = (
    "tests/bench/test_bench_serve.py",  # ~500 s: 12 `vllm serve` starts
    "tests/integration/vllm/test_vllm_speculative.py",  # ~360 s
    "tests/bench/test_bench_concurrency.py",  # ~210 s
    "tests/bench/test_bench_trace.py",  # ~200 s
    "tests/bench/test_bench_fleet.py",  # ~190 s
    "tests/deploy/test_deploy_recipes.py",  # ~180 s
    "tests/integration/vllm/test_vllm_mla.py",  # ~150 s: two MLA backends on a Xeon with AMX
    "tests/integration/vllm/test_vllm_async_stores.py",  # ~140 s
    "tests/integration/vllm/test_gpu_v2_bundle.py",  # ~135 s
    "tests/integration/vllm/test_vllm_serve.py",  # ~135 s
    "tests/integration/vllm/test_vllm_preemption_abort.py",  # ~130 s
    "tests/integration/vllm/test_vllm_tiny_kv_cache.py",  # ~125 s
    "tests/integration/vllm/test_vllm_linear_attention.py",  # ~110 s
    "tests/test_neighbour_files_kept.py",  # ~110 s
    "tests/test_wheel.py",  # ~105 s
    "tests/integration/vllm/test_vllm_cross_instance.py",  # ~100 s
)


def longest_first(items) -> None:
    """LONGEST_FIRST's files first, in its order; every other file after them as collected (stable)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
