"""What a cache keeps in the runtime directory goes with it: benchmarks and
tests call shmkv.paths.remove_cache_files once nobody uses the cache, which
removes its registries, token and locks, but never a lock a live process
holds (a new file under the old name would let a second holder in)."""

from __future__ import annotations

import os

from shmkv.paths import CACHE_FILE_SUFFIXES, maintainer_lock, remove_cache_files, runtime_dir_path


def test_a_finished_caches_files_go_and_a_held_lock_stays(cache_name):
    rt = runtime_dir_path()
    held = maintainer_lock(cache_name)
    assert held.try_acquire()
    try:
        for suffix in CACHE_FILE_SUFFIXES:
            path = os.path.join(rt, f"{cache_name}.{suffix}")
            if not os.path.exists(path):
                with open(path, "w") as f:
                    f.write("x")
        other = os.path.join(rt, f"{cache_name}x.engines.jsonl")  # another cache whose name starts alike
        with open(other, "w") as f:
            f.write("x")
        removed = remove_cache_files(cache_name)
        assert sorted(removed) == sorted(f"{cache_name}.{s}" for s in CACHE_FILE_SUFFIXES if s != "maintainer.lock")
        assert os.path.exists(held.path), "the lock a live process holds stays"
        assert os.path.exists(other)
        os.unlink(other)
    finally:
        held.release()
    assert remove_cache_files(cache_name) == [f"{cache_name}.maintainer.lock"], "released: it goes too"
