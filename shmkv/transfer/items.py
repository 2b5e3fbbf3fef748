"""What the transfer engine moves: one unit (chunk or tail piece) of a
request, as windows of each KV-cache group's blocks. Built by the scheduler
half (shmkv.integration.vllm.planner), shipped to the workers, executed by
shmkv.transfer.engine. Plain frozen dataclasses: picklable, no vLLM types.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GroupWindow:
    """One KV-cache group's part of a copy: that group's section of the unit's
    payload holds `payload_blocks` blocks per layer; the copy moves blocks
    [payload_first, payload_first + len(block_ids)) of it to or from
    `block_ids` of the paged cache."""

    payload_first: int
    payload_blocks: int
    block_ids: tuple[int, ...]


def _all_blocks(groups: tuple[GroupWindow, ...]) -> tuple[int, ...]:
    return tuple(b for g in groups for b in g.block_ids)


@dataclass(frozen=True)
class LoadItem:
    """Fill each group's window of the paged cache from the stored unit."""

    req_id: str
    keys: tuple[bytes, ...]
    groups: tuple[GroupWindow, ...]  # one per KV-cache group

    @property
    def block_ids(self) -> tuple[int, ...]:
        """Every block this item fills (all groups): what vLLM recomputes if it fails."""
        return _all_blocks(self.groups)


@dataclass(frozen=True)
class StoreItem:
    """Store a unit of `tokens` tokens: each group's window, whole."""

    req_id: str
    keys: tuple[bytes, ...]
    tokens: int
    groups: tuple[GroupWindow, ...]  # one per KV-cache group, payload_first 0
    namespaces: tuple[bytes, ...] = ()  # root key per rank: tags the entry (clear by namespace, tiers)

    @property
    def block_ids(self) -> tuple[int, ...]:
        return _all_blocks(self.groups)
