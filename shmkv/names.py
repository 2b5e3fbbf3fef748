"""The one vocabulary of names that cross modules: tiers (counters
"<tier>_hits", JSON of /stats and /lookup, logs), chunk codecs (the chunk
format's codec byte, the disk_codec / remote_codec settings) and lossy forms."""

from __future__ import annotations

SHM, DISK, REMOTE = "shm", "disk", "remote"
TIERS = (SHM, DISK, REMOTE)  # in chain order

ZSTD, RAW = "zstd", "none"  # a chunk's payload: zstd of the byte-shuffled bytes, or as it is
AUTO = "auto"  # a tier's codec setting: chosen by measurement (shmkv.tiers.codec)
CODEC_SETTINGS = (AUTO, ZSTD, RAW)

FP8 = "fp8"  # float8 e4m3 with a float32 scale per 1,024 values (shmkv.tiers.format)
LOSSY_FORMS = (FP8,)
