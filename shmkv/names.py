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

# Segments are POSIX shared memory (/dev/shm/<name>) unless the segment_dir setting names a directory
# of their own: a tmpfs, 0700, of the cache's uid, which a container mounts alone (docs/deployment.md
# "Containers"). The directory travels as an argument (Store.*(..., segment_dir=), the core's open and
# unlink); this variable is the setting's, read with the others (shmkv.config), and the default of a
# library call that names no directory. Every process of a deployment must name the same one.
SEGMENT_DIR_ENV = "SHMKV_SEGMENT_DIR"
POSIX_SHM_DIR = "/dev/shm"


def segment_dir_or_default(segment_dir: str | None) -> str:
    """`segment_dir` as given ("" = POSIX shm), or when None the setting's
    value in this process's environment (SHMKV_SEGMENT_DIR; "" when unset)."""
    return os.environ.get(SEGMENT_DIR_ENV, "") if segment_dir is None else segment_dir


def segments_dir(segment_dir: str | None = None) -> str:
    """The directory segments of `segment_dir` live in (segment_dir_or_default; /dev/shm for POSIX shm)."""
    return segment_dir_or_default(segment_dir) or POSIX_SHM_DIR
