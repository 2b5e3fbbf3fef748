"""Benchmarks, one module each: `shmkv bench NAME [--json]` (`shmkv bench --help` lists them).

Each benchmark measures its baseline (memcpy, cudaMemcpy...) in the same run,
so ratios are meaningful on whatever machine runs them.
"""


def drop_cache(name: str) -> None:
    """A benchmark's cache, gone once the benchmark is done with it: its
    segment and what it kept in the runtime directory (registries, locks,
    the controller's token), so runs leave the host as they found it."""
    from shmkv import Store
    from shmkv.paths import remove_cache_files

    Store.unlink(name)
    remove_cache_files(name)
