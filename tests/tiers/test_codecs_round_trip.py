"""A chunk written raw and one written compressed both come back byte-equal
through every tier below memory: the disk tier and the remote tier each
write with `none`, `zstd` and `auto`, the stored bytes carry the codec the
setting chose, and a promotion into the shared tier gives back the payload
the tier was given, byte for byte."""

from __future__ import annotations

import os

import pytest
import redis

from shmkv.config import load_config
from shmkv.tiers import format as fmt
from shmkv.tiers import open_tiers
from shmkv.tiers.remote.signing import chunk_key

NS = b"codec-round-trip"


def kv_like(n_bytes: int, seed: int) -> bytes:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_bytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("codec", ["none", "zstd", "auto"])
@pytest.mark.parametrize("where", ["disk", "remote"])
def test_raw_and_compressed_chunks_come_back_byte_equal(small_store, redis_server, tmp_path, where, codec):
    settings = {"cache_name": small_store.name, "disk_shuffle_bytes": 2}
    if where == "disk":
        settings.update(disk_dir=str(tmp_path / "disk"), disk_capacity="64MiB", disk_codec=codec)
    else:
        settings.update(remote_url=redis_server.url, remote_timeout=10, remote_codec=codec)
    chain = open_tiers(load_config(settings, env={}), small_store)
    try:
        tier = chain.disk if where == "disk" else chain.remote
        chunks = {os.urandom(16): kv_like(64 << 10, i) for i in range(3)}
        chunks[os.urandom(16)] = os.urandom(64 << 10)  # incompressible: raw under auto
        for k, raw in chunks.items():
            assert tier.write(k, NS, raw)
        if where == "disk":
            stored = {k: tier.read_file(k) for k in chunks}
        else:
            with redis.Redis.from_url(redis_server.url) as client:
                stored = {k: client.get(chunk_key(k, NS)) for k in chunks}
        written = [fmt.codec_of(stored[k]) for k in chunks]
        if codec != "auto":
            assert written == [codec] * len(chunks), written
        else:
            assert set(written) <= {"zstd", "none"} and written[0] == "zstd", written  # auto starts compressed
        small_store.clear()
        assert chain.promote(list(chunks), [NS] * len(chunks)) == len(chunks)
        for k, raw in chunks.items():
            assert bytes(small_store.get(k)) == raw, f"{where} {codec}: a chunk came back changed"
    finally:
        if where == "remote":
            chain.remote.clear(NS)
        chain.close()
