"""The suite's schedule (tests/conftest.py sorts the collected items with
longest_first; pyproject's addopts turn off xdist's own reordering): xdist
--dist loadfile hands files out in collection order, so the longest go first."""

from __future__ import annotations

# The files that take longest (seconds of a full run on 2 cores, --durations: the benchmark runs, the
# suites of several engine pairs), run first: xdist hands files out in collection order, and a long
# file started last keeps one worker busy while the other has nothing left (a longest-first schedule)
LONGEST_FIRST = (  # seconds: a full run of f3fe6e2 on the 2-core Xeon (AMX) CI machine
    "tests/bench/test_bench_serve.py",  # ~370 s: 8 `vllm serve` starts, API servers forked (10 and ~480 s before)
    "tests/integration/vllm/decoding/test_vllm_speculative.py",  # ~330 s
    "tests/test_wheel.py",  # ~150 s: builds the run's one wheel (tests/support/wheel_build.py)
    "tests/integration/vllm/models/test_vllm_mla.py",  # ~230 s: two MLA backends on a Xeon with AMX
    "tests/bench/test_bench_trace.py",  # ~220 s
    "tests/bench/test_bench_churn.py",  # ~225 s at 50 changes, ~40 engine starts (forked); 20 now
    "tests/deploy/test_deploy_recipes.py",  # ~220 s
    "tests/integration/vllm/worker/test_vllm_async_stores.py",  # ~200 s
    "tests/integration/vllm/serving/test_vllm_serve.py",  # ~190 s
    "tests/integration/vllm/worker/test_vllm_preemption_abort.py",  # ~190 s
    "tests/integration/vllm/worker/test_vllm_tiny_kv_cache.py",  # ~180 s
    "tests/bench/test_bench_concurrency.py",  # ~170 s
    "tests/integration/vllm/serving/test_vllm_cross_instance.py",  # ~155 s
    "tests/integration/vllm/models/test_vllm_linear_attention.py",  # ~125 s
    "tests/integration/vllm/worker/test_gpu_v2_bundle.py",  # ~120 s once the wheel is built (after test_wheel's start)
    "tests/integration/vllm/serving/test_vllm_pid_namespaces.py",  # ~115 s
    "tests/integration/vllm/worker/test_vllm_call_order.py",  # ~110 s
    "tests/bench/test_bench_fleet.py",  # ~110 s
    "tests/integration/vllm/worker/test_vllm_tp_load_failure.py",  # ~80 s: two TP=2 engines
    "tests/test_neighbour_files_kept.py",  # ~50 s
)


def longest_first(items) -> None:
    """LONGEST_FIRST's files first, in its order; every other file after them as collected (stable)."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))
