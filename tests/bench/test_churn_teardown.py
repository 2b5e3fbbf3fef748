"""bench churn's teardown tries every step even when one fails: an engine
whose fork server is gone (BrokenPipeError on its kill) still leaves the
disk tier's tmpfs unmounted and the segment dropped (a crashed run left both
behind)."""

from __future__ import annotations

import os

import pytest

from shmkv import Store
from shmkv.bench import churn_bench


class GoneEngine:
    def kill(self) -> None:
        raise BrokenPipeError(32, "Broken pipe")


def test_a_failing_step_leaves_the_rest_of_the_teardown_done(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("the disk tier's tmpfs needs root")
    a = churn_bench.parse(["--workdir", str(tmp_path), "--no-lora", "--no-redis", "--no-daemon"])
    churn = churn_bench.Churn(a)
    assert churn.mount_disk()
    Store.create(churn.cache, 4 << 20, populate=False).close()
    churn.engines[0] = GoneEngine()
    with pytest.raises(BrokenPipeError):
        churn.teardown()
    assert not os.path.ismount(churn.disk_fs), "the disk tier's tmpfs unmounted"
    assert not os.path.exists(f"/dev/shm/{churn.cache}"), "the segment dropped"
    assert churn.live() == []
