"""Remote tier (Redis/Valkey) shared by several hosts.

redis-py is an optional dependency (`pip install 'shmkv[remote]'`): it is
imported only when `remote_url` is set.
"""

from __future__ import annotations

import logging
from typing import Any

from shmkv.config_values import redact_url
from shmkv.errors import ConfigError

log = logging.getLogger("shmkv.remote")


def open_remote(cfg: Any, *, store: Any = None, element_size: int = 2) -> Any:
    """The remote tier (shmkv.tiers.remote.tier.RemoteTier) a ShmkvConfig asks
    for, or None (no remote_url); `store` only receives its counters. Called
    by shmkv.tiers.chain.open_tiers, which gives it its source of bytes."""
    if not cfg.remote_url:
        return None
    try:
        from shmkv.tiers.remote.client import read_secret
        from shmkv.tiers.remote.tier import RemoteTier
    except ImportError as e:
        raise ConfigError(f"remote_url is set but the remote tier cannot load ({e}); "
                          "install it with: pip install 'shmkv[remote]'") from e
    secret = read_secret(cfg.remote_secret_file) if cfg.remote_secret_file else None
    tier = RemoteTier(cfg.remote_url, timeout_s=cfg.remote_timeout, ttl_s=cfg.remote_ttl,
                      capacity_bytes=cfg.remote_capacity, counter=store.bump if store is not None else None,
                      element_size=element_size, level=cfg.disk_level,
                      codec=cfg.remote_codec, secret=secret)
    if secret is None:
        log.info("shmkv: remote tier %s has no remote_secret_file: anyone who can write to it can plant KV that "
                 "every engine using it will load", redact_url(cfg.remote_url))
    log.info("shmkv: remote tier %s (timeout %.2f s, ttl %s, budget %s, write-through %s, codec %s, chunks %s)",
             redact_url(cfg.remote_url),
             cfg.remote_timeout, f"{cfg.remote_ttl} s" if cfg.remote_ttl else "none",
             f"{cfg.remote_capacity / 2**30:.1f} GiB" if cfg.remote_capacity else "none",
             "on" if cfg.remote_write_through else "off", cfg.remote_codec,
             "with a MAC of the shared secret" if secret else "unauthenticated")
    return tier
