"""Which codec a tier below memory writes chunks with: `zstd`, `none`, or
`auto`, chosen from what the tier measures as it writes.

The chunk format (shmkv.tiers.format) names its codec in every header, so a
tier reads whatever mix it holds; only writes follow the choice.

`auto` compares, per chunk, the time a write takes compressed (encode, then
the device writes raw/ratio bytes) with the time raw (the device writes the
raw bytes), from moving averages of the tier's own measurements:

    compress  when  1/codec_rate + 1/(ratio * device_rate) < 1/device_rate
              or    the tier is short of space (then bytes matter more than time)

It starts with zstd (nothing is known yet), decides after WARMUP chunks, and
while it writes raw it still compresses one chunk in PROBE_EVERY to keep the
codec's rate and ratio current. Each change of choice is logged at INFO with
its figures.

Invariant: measurements only ever change which codec the next write uses;
a chunk's bytes are always checked the same way whatever its codec.
"""

from __future__ import annotations

import logging
import threading

from shmkv.names import AUTO, CODEC_SETTINGS, RAW, ZSTD

log = logging.getLogger("shmkv.codec")

WARMUP = 8
PROBE_EVERY = 32
_ALPHA = 0.2  # weight of the newest sample in the moving averages


class CodecChoice:
    """The codec a tier's next write uses, and the rates it has measured."""

    def __init__(self, tier: str, setting: str = AUTO) -> None:
        if setting not in CODEC_SETTINGS:
            raise ValueError(f"{tier}_codec={setting!r}: expected one of {', '.join(CODEC_SETTINGS)}")
        self.tier = tier
        self.setting = setting
        self.codec_bps = 0.0   # raw bytes encoded per second (one thread)
        self.device_bps = 0.0  # bytes the device takes per second (one writer)
        self.ratio = 0.0       # raw / encoded of the compressed writes
        self.choice = ZSTD if setting == AUTO else setting
        self.reason = "not measured yet" if setting == AUTO else "configured"
        self._compressed = 0
        self._writes = 0
        self._lock = threading.Lock()

    def pick(self, *, space_short: bool = False) -> str:
        """The codec for the next write: "zstd" or "none"."""
        if self.setting != AUTO:
            return self.setting
        with self._lock:
            self._writes += 1
            if space_short:
                return ZSTD
            if self.choice == RAW and self._writes % PROBE_EVERY == 0:
                return ZSTD  # a probe: keeps the codec's rate and ratio current
            return self.choice

    def record(self, codec: str, raw_bytes: int, stored_bytes: int, encode_s: float, write_s: float) -> None:
        """One write's figures: `encode_s` spent encoding, `write_s` giving the
        `stored_bytes` to the device."""
        if self.setting != AUTO or raw_bytes <= 0 or stored_bytes <= 0:
            return
        with self._lock:
            if write_s > 0:
                self.device_bps = _average(self.device_bps, stored_bytes / write_s)
            if codec == ZSTD and encode_s > 0:
                self.codec_bps = _average(self.codec_bps, raw_bytes / encode_s)
                self.ratio = _average(self.ratio, raw_bytes / stored_bytes)
                self._compressed += 1
            if self._compressed >= WARMUP and self.device_bps > 0:
                self._decide()

    def _decide(self) -> None:
        compressed_s = 1 / self.codec_bps + 1 / (self.ratio * self.device_bps)
        raw_s = 1 / self.device_bps
        choice = ZSTD if compressed_s < raw_s else RAW
        figures = (f"zstd {self.codec_bps / 1e9:.2f} GB/s per thread at ratio {self.ratio:.2f}; device "
                   f"{self.device_bps / 1e9:.2f} GB/s per writer")
        if choice == ZSTD:
            reason = f"compressing is faster than writing raw ({figures})"
        else:
            reason = f"compressing would make the tier slower than its device ({figures})"
        if choice != self.choice or self.reason == "not measured yet":
            log.info("shmkv: %s codec auto: %s, %s", self.tier, "zstd" if choice == ZSTD else "raw", reason)
        self.choice, self.reason = choice, reason

    def describe(self) -> dict[str, object]:
        """For stats and logs: the setting, the current choice and why."""
        with self._lock:
            return {"setting": self.setting, "choice": self.choice, "reason": self.reason,
                    "codec_gbps": round(self.codec_bps / 1e9, 3), "device_gbps": round(self.device_bps / 1e9, 3),
                    "ratio": round(self.ratio, 3)}


def _average(old: float, new: float) -> float:
    return new if old <= 0 else (1 - _ALPHA) * old + _ALPHA * new
