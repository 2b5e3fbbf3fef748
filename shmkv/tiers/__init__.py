"""The tiers and the chunk format.

    chain.py    the tier chain (TierChain, open_tiers): the only code that
                moves chunks between tiers, and the only place tiers are built
    format.py   the chunk format: checked, byte-shuffled, zstd / raw / fp8;
                the disk files, the remote values and the compressed
                entries of the shared tier are all this format
    codec.py    which codec a tier writes (measured per tier)
    recode.py   re-encoding chunks in place in the shared tier (/compress,
                /decompress, the lossy form)
    disk/       the disk tier: checked files in a private directory, byte-capped
    remote/     the remote tier: Redis / Valkey across hosts

May import shmkv's store, keys, chunking, config, paths and errors; never the
transfer path, the services or the integrations. A tier never imports
another tier (tests/test_architecture.py walks the imports).
"""

from __future__ import annotations

from shmkv.names import DISK, REMOTE, SHM
from shmkv.tiers.chain import SharedTier, Spill, Tier, TierChain, kv_element_size, open_tiers

__all__ = ["DISK", "REMOTE", "SHM", "SharedTier", "Spill", "Tier", "TierChain", "kv_element_size", "open_tiers"]
