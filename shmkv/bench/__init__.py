"""Benchmarks: `python -m shmkv.bench {store,kernels} [--json]`.

Each benchmark measures its baseline (memcpy, cudaMemcpy...) in the same run,
so ratios are meaningful on whatever machine runs them.
"""
