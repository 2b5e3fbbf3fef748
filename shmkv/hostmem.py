"""What the host's memory offers a segment: the filesystem it lives on and
whether its pages can be huge (2 MiB or more instead of 4 KiB: fewer
page-table entries to pin for a GPU, fewer TLB misses in copies).

Huge pages come from the segment directory's mount: a tmpfs mounted with
huge=within_size or huge=always, or a hugetlbfs; shmem_enabled=force makes
every tmpfs use them. huge=advise does not: the core reserves a segment's
pages with posix_fallocate, outside any mapping an madvise could mark.
/dev/shm is usually mounted without huge=: 4 KiB pages.
Read from /proc/self/mountinfo and /sys; nothing here changes the host.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

SHMEM_ENABLED = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"


@dataclass(frozen=True)
class Pages:
    """The page size a segment directory gives: `huge` and why (`how`)."""

    huge: bool
    how: str
    fs_type: str
    options: tuple[str, ...]


def mount_of(path: str) -> tuple[str, str, tuple[str, ...]]:
    """(mount point, filesystem type, mount and super options) of the mount holding `path`."""
    best = ("", "", ())
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return best
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rest = left.split(), right.split()
        if len(fields) < 6 or len(rest) < 3:
            continue
        point = fields[4].replace("\\040", " ")
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[0]):
            best = (point, rest[0], tuple(fields[5].split(",") + rest[2].split(",")))
    return best


def shmem_enabled() -> str:
    """The kernel's transparent-huge-page policy for shared memory (the bracketed choice), or ""."""
    try:
        with open(SHMEM_ENABLED) as f:
            text = f.read()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else text.strip()


def segment_pages(directory: str) -> Pages:
    """Whether segments in `directory` get huge pages, and why."""
    point, fs_type, options = mount_of(directory)
    huge_opts = [o for o in options if o.startswith("huge=")]
    policy = shmem_enabled()
    if fs_type == "hugetlbfs":
        return Pages(True, f"{point} is a hugetlbfs", fs_type, options)
    if policy == "deny":
        return Pages(False, "shmem_enabled is deny: no tmpfs gets huge pages", fs_type, options)
    if policy == "force":
        return Pages(True, "shmem_enabled is force", fs_type, options)
    if huge_opts and huge_opts[-1] == "huge=advise":
        # NOTE: shmkv reserves a segment's pages with posix_fallocate, outside any mapping, so an
        # madvise(MADV_HUGEPAGE) could not reach them: advise gives 4 KiB pages here
        return Pages(False, f"{point} is mounted huge=advise, and shmkv reserves its pages with fallocate, "
                            "which takes no advice", fs_type, options)
    if huge_opts and huge_opts[-1] != "huge=never":
        return Pages(True, f"{point} is mounted {huge_opts[-1]}", fs_type, options)
    said = f"mounted {huge_opts[-1]}" if huge_opts else "mounted without huge="
    return Pages(False, f"{point or directory} is {said}", fs_type, options)
