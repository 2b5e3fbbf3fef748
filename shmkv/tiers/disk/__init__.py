"""The disk tier: checked chunk files (format.py; zstd or raw, by codec.py's
choice) in a private directory with a byte cap (tier.py)."""

from __future__ import annotations

import logging
import os
from typing import Any

log = logging.getLogger("shmkv.disk")


def open_disk(cfg: Any, *, store: Any = None, element_size: int = 2) -> Any:
    """The disk tier (shmkv.tiers.disk.tier.DiskTier) a ShmkvConfig asks for,
    or None (no disk_dir); `store` only receives its counters. Called by
    shmkv.tiers.chain.open_tiers."""
    if not cfg.disk_dir:
        return None
    from shmkv.tiers.disk.tier import DiskTier

    tier = DiskTier(os.path.join(cfg.disk_dir, cfg.cache_name), capacity_bytes=cfg.disk_capacity,
                    level=cfg.disk_level, element_size=element_size, codec=cfg.disk_codec,
                    counter=store.bump if store is not None else None)
    log.info("shmkv: disk tier at %s (cap %.1f GiB, codec %s, zstd level %d)", tier.dir, cfg.disk_capacity / 2**30,
             cfg.disk_codec, cfg.disk_level)
    return tier
