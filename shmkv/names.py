"""The one vocabulary of names that cross modules: tiers (counters
"<tier>_hits", JSON of /stats and /lookup, logs), chunk codecs (the chunk
format's codec byte, the disk_codec / remote_codec settings), lossy forms,
and where segments live."""

from __future__ import annotations

import os

SHM, DISK, REMOTE = "shm", "disk", "remote"
TIERS = (SHM, DISK, REMOTE)  # in chain order

ZSTD, RAW = "zstd", "none"  # a chunk's payload: zstd of the byte-shuffled bytes, or as it is
AUTO = "auto"  # a tier's codec setting: chosen by measurement (shmkv.tiers.codec)
CODEC_SETTINGS = (AUTO, ZSTD, RAW)

FP8 = "fp8"  # float8 e4m3 with a float32 scale per 1,024 values (shmkv.tiers.format)
LOSSY_FORMS = (FP8,)

# Segments are POSIX shared memory (/dev/shm/<name>) unless this names a directory of their own: a
# tmpfs, 0700, of the cache's uid, which a container mounts alone (docs/deployment.md "Containers"). Read by
# the C++ core at every open and unlink, so every process of a deployment must see the same value.
SEGMENT_DIR_ENV = "SHMKV_SEGMENT_DIR"


def segments_dir() -> str:
    """The directory this process's segments live in."""
    return os.environ.get(SEGMENT_DIR_ENV) or "/dev/shm"
