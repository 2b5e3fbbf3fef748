"""Byte counts as people read them (log lines, `shmkv stats`, `shmkv check`):
one formatter, binary units. The lowest floor: imports nothing of shmkv."""

from __future__ import annotations


def format_bytes(n: float) -> str:
    """`n` bytes in B, KiB, MiB, GiB or TiB: '512 B', '1.5 GiB'."""
    x = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(x) < 1024:
            return f"{x:.0f} {unit}" if unit == "B" else f"{x:.1f} {unit}"
        x /= 1024
    return f"{x:.1f} TiB"
