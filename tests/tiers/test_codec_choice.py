"""`disk_codec` / `remote_codec`: auto writes raw when compressing would make
the tier slower than its device and space is not short, zstd otherwise;
the choice follows the tier's own measurements, and a fixed setting never
changes."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import shmkv.tiers.disk.tier as tier_mod
from shmkv.config import load_config
from shmkv.errors import ConfigError
from shmkv.tiers import format as fmt
from shmkv.tiers.codec import PROBE_EVERY, WARMUP, CodecChoice
from shmkv.tiers.disk.tier import DiskTier

MB = 1 << 20


def feed(choice: CodecChoice, n: int, *, codec_gbps: float, device_gbps: float, ratio: float) -> list[str]:
    """n writes at the given rates (64 MiB chunks); the codecs picked."""
    picked = []
    for _ in range(n):
        codec = choice.pick()
        picked.append(codec)
        raw = 64 * MB
        stored = int(raw / ratio) if codec == "zstd" else raw
        choice.record(codec, raw, stored, raw / (codec_gbps * 1e9) if codec == "zstd" else 0.0,
                      stored / (device_gbps * 1e9))
    return picked


def test_auto_writes_raw_to_a_device_faster_than_the_codec():
    c = CodecChoice("disk")
    picked = feed(c, WARMUP + 3 * PROBE_EVERY, codec_gbps=0.5, device_gbps=3.0, ratio=1.46)
    assert picked[:WARMUP] == ["zstd"] * WARMUP, "nothing is known before the warm-up"
    assert c.choice == "none" and "slower than its device" in c.reason
    later = picked[WARMUP + 1:]
    assert later.count("zstd") in (len(later) // PROBE_EVERY, len(later) // PROBE_EVERY + 1), \
        "only one probe in PROBE_EVERY compresses once raw is chosen"


def test_auto_compresses_for_a_device_slower_than_the_codec():
    c = CodecChoice("remote")
    picked = feed(c, 40, codec_gbps=0.5, device_gbps=0.05, ratio=1.46)
    assert set(picked) == {"zstd"} and c.choice == "zstd" and "faster than writing raw" in c.reason


def test_auto_follows_the_device_when_it_slows_down():
    c = CodecChoice("disk")
    feed(c, 40, codec_gbps=0.5, device_gbps=3.0, ratio=1.46)
    assert c.choice == "none"
    feed(c, 4 * PROBE_EVERY, codec_gbps=0.5, device_gbps=0.05, ratio=1.46)  # e.g. writeback throttling
    assert c.choice == "zstd"


def test_incompressible_data_is_written_raw_even_to_a_slow_device():
    c = CodecChoice("disk")
    feed(c, 40, codec_gbps=0.5, device_gbps=0.05, ratio=1.0)
    assert c.choice == "none"


def test_short_of_space_compresses_whatever_the_rates():
    c = CodecChoice("disk")
    feed(c, 40, codec_gbps=0.5, device_gbps=3.0, ratio=1.46)
    assert c.choice == "none" and c.pick(space_short=True) == "zstd"


@pytest.mark.parametrize("setting", ["zstd", "none"])
def test_a_fixed_codec_never_changes(setting):
    c = CodecChoice("disk", setting)
    assert set(feed(c, 40, codec_gbps=0.5, device_gbps=0.05 if setting == "none" else 3.0, ratio=1.46)) == {setting}


def test_bad_settings_name_the_key():
    with pytest.raises(ConfigError, match="disk_codec"):
        load_config({"disk_codec": "lz4"}, env={})
    with pytest.raises(ValueError, match="remote_codec"):
        CodecChoice("remote", "brotli")
    assert load_config({}, env={}).disk_codec == "auto" and load_config({}, env={}).remote_codec == "auto"


def kv_like(n_bytes: int, seed: int) -> bytes:
    """bf16 Gaussian values, as KV looks to a compressor (ratio ~1.4 shuffled)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randn(n_bytes // 2, generator=g).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.parametrize("device", ["fast", "slow"])
def test_disk_tier_auto_on_a_fast_and_a_slow_device(tmp_path, monkeypatch, device):
    """The real tier: its own timings decide. The slow device is simulated by
    holding each write for its bytes at 20 MB/s; the fast one is this
    machine's page cache (GB/s, faster than zstd's ~0.5 GB/s per core)."""
    if device == "slow":
        real = tier_mod._write_all

        def slow_write(fd, parts):
            n = sum(p.nbytes for p in parts)
            real(fd, parts)
            time.sleep(n / 20e6)

        monkeypatch.setattr(tier_mod, "_write_all", slow_write)
    t = DiskTier(str(tmp_path / "disk"), capacity_bytes=1 << 40)
    keys = [os.urandom(16) for _ in range(WARMUP + 4)]
    payloads = [kv_like(256 << 10, i) for i in range(len(keys))]
    for k, p in zip(keys, payloads):
        assert t.write(k, b"n" * 16, p)
    codecs = [fmt.codec_of(t.read_file(k)) for k in keys]
    assert codecs[:WARMUP] == ["zstd"] * WARMUP
    want = "none" if device == "fast" else "zstd"
    assert t.codec.choice == want, t.codec.describe()
    assert codecs[-1] == want
    assert all(t.read(k) == p for k, p in zip(keys, payloads)), "every codec reads back exactly"
    assert np.isclose(t.codec.ratio, 1.4, atol=0.2), t.codec.describe()
