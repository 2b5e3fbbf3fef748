"""`python -m shmkv.bench remote --json` on loopback and over a rate-limited
link, small: every codec setting measured beside the link alone, the stored
ratio what each setting wrote (none: 1, zstd: KV compresses), and auto
naming what it chose and why; the benchmark leaves no key behind."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import redis

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("link", [[], ["--link-mbps", "40"]], ids=["loopback", "slow-link"])
def test_the_remote_benchmark_measures_every_codec_against_its_link(redis_server, link):
    r = subprocess.run([sys.executable, "-m", "shmkv.bench", "remote", "--url", redis_server.url, "--chunks", "4",
                        "--chunk-mib", "1", "--repeats", "2", *link, "--json"], capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout)
    assert got["link"] == ("40 MB/s" if link else "loopback")
    assert got["wire_put_gbps"] > 0 and got["wire_get_gbps"] > 0
    if link:
        assert got["wire_put_gbps"] < 0.06, "the link carried no more than its rate (and some slack)"
    codecs = got["codecs"]
    assert set(codecs) == {"auto", "zstd", "none"}
    assert all(c["put_gbps"] > 0 and c["get_gbps"] > 0 and c["put_of_wire"] > 0 for c in codecs.values()), codecs
    assert codecs["none"]["ratio"] == 1.0 and codecs["zstd"]["ratio"] > 1.2, codecs
    assert codecs["auto"]["codec"].split()[0] in ("zstd", "none") and "(" in codecs["auto"]["codec"], codecs["auto"]
    with redis.Redis.from_url(redis_server.url) as client:
        assert client.dbsize() == 0, "the benchmark removed every key it wrote"
