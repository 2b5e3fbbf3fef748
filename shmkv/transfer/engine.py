"""The transfer engine: moves units between one worker's paged KV cache and
the shared segment, asynchronously on every platform. Knows nothing of vLLM
(shaped like vLLM's OffloadingWorker): submit loads and stores, per-layer
readiness of loads, poll for completed work, and an ordering barrier
(compute after the pending stores).

One code path above the copy primitive (shmkv.transfer.streams): a CUDA
stream and events on a GPU, a copy thread and completion flags on the CPU.
Each direction is a module of its own with its contract: loads
(shmkv.transfer.loads) and stores (shmkv.transfer.stores). This façade holds
what both share (the layouts, the streams, the unit's copy plan and payload
sections, the counters) and the one rule across directions: a load's copies
run only after the pending stores that read its blocks (a block vLLM freed
and gave to the load may still be gathered by a store).

Nothing here raises into the caller for a unit. A hybrid model's KV cache is
several groups, each with its own block ids; a group whose layers differ in
shape (vLLM's UniformTypeKVCacheSpecs: a drafter of another head size in the
target's group, per-layer head counts) is several layouts, one per shape,
over the same block ids. A unit's payload is the layouts' sections in layout
order, each `[layers of the layout][its stored blocks][block bytes]` (or per
token).
"""

from __future__ import annotations

import logging
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from shmkv.errors import InvalidArgumentError
from shmkv.store import Store
from shmkv.testing import SKIP_LOAD_LAYERS
from shmkv.transfer.items import GroupWindow
from shmkv.transfer.layout import KVLayout
from shmkv.transfer.loads import LOAD_ISSUE_AHEAD, LoadJob, LoadSide
from shmkv.transfer.stores import RequestTally, StoreJob, StoreSide
from shmkv.transfer.streams import backend_for

__all__ = ["LOAD_ISSUE_AHEAD", "LoadJob", "RequestTally", "StoreJob", "TransferEngine"]

log = logging.getLogger("shmkv.transfer")


class TransferEngine(LoadSide, StoreSide):
    """Loads and stores units for one worker (one TP rank)."""

    def __init__(self, store: Store, layouts: KVLayout | Sequence[KVLayout], tp_rank: int, *,
                 digest_file: str = "", on_commit: Callable[[bytes, bytes, int], None] | None = None,
                 layer_order: Sequence[str] | None = None, lossy_ok: bool = False, deferred: bool = False,
                 skip_load_layers: str = "", layout_groups: Sequence[int] | None = None, backend: Any = None,
                 load_issue_ahead: int | None = None):
        """`layouts`: one per KV-cache group, in the caller's group order, or
        several per group (one per layer shape) with `layout_groups` giving
        each layout's KV-cache group (the index into an item's `groups`);
        `on_commit(key, namespace, tokens)`: told of each chunk committed (the
        tier chain's write-through); `layer_order`: every layer name in forward
        order (default: group by group); `lossy_ok`: lossy chunks may be
        loaded (else never); `deferred` (tests): CPU copies run only when
        something waits for them; `skip_load_layers` (tests only: proves
        that a test would catch a layer left unloaded): a regex of layer
        names whose loads are not copied; `backend` (tests): the streams'
        backend (the tests' DeviceModel), else the device's; `load_issue_ahead`:
        layers whose load copies are issued ahead of the one the forward waits
        for (default LOAD_ISSUE_AHEAD; at least the whole forward: every
        layer issued by submit_load, as before)."""
        self.cache = store
        self.on_commit = on_commit
        # a request whose stores must not commit (another TP rank's load of it failed: rank_failures.py)
        self.veto: Callable[[str], bool] | None = None
        self.layouts = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        self._layout_groups = list(layout_groups) if layout_groups is not None else list(range(len(self.layouts)))
        self._num_groups = len(set(self._layout_groups))
        if (len(self._layout_groups) != len(self.layouts)
                or set(self._layout_groups) != set(range(self._num_groups))):
            raise ValueError(f"layout_groups {self._layout_groups} must give each of the {len(self.layouts)} "
                             "layouts a KV-cache group, every group from 0 on having one")
        # NOTE: a recurrent-state group ("state" layout) holds one block per unit, whatever the block size
        attention = [lay for lay in self.layouts if lay.kind != "state"] or self.layouts
        self.layout = layout = attention[0]
        if len({lay.block_size for lay in attention}) != 1:
            raise ValueError("every KV-cache group must have the same block size")
        where = {name: (g, li) for g, lay in enumerate(self.layouts) for li, name in enumerate(lay.names)}
        order = list(layer_order) if layer_order is not None else list(where)
        if sorted(order) != sorted(where):
            raise ValueError("layer_order must name every layer of the groups once")
        self._order = [where[name] for name in order]  # forward position -> (group, layer in group)
        self._position = {name: i for i, name in enumerate(order)}
        self._skip_load = set()
        if skip_load_layers:
            import re

            self._skip_load = {where[n] for n in order if re.search(skip_load_layers, n)}
            log.warning("shmkv: %s=%r: loads leave %d layers unfilled", SKIP_LOAD_LAYERS,
                        skip_load_layers, len(self._skip_load))
        self.rank = tp_rank
        self.counters: Counter[str] = Counter()
        self.tallies: dict[str, RequestTally] = defaultdict(RequestTally)
        self.digest_file = digest_file
        self.lossy_ok = lossy_ok
        self.on_gpu = layout.on_gpu
        self.backend = backend if backend is not None else backend_for(layout.device, deferred=deferred)
        self._tracks = getattr(self.backend, "tracks_blocks", False)  # name the blocks each copy touches
        self._store_stream = self.backend.stream("store")
        self._load_stream = self.backend.stream("load")
        self._stores: list[StoreJob] = []  # issued, not yet committed or aborted (issue order)
        self._loads: list[LoadJob] = []  # issued, leases not yet released
        self.load_issue_ahead = LOAD_ISSUE_AHEAD if load_issue_ahead is None else load_issue_ahead
        if self.load_issue_ahead < 0:
            raise ValueError(f"load_issue_ahead must be 0 or more, not {self.load_issue_ahead}")

    # ------------------------------------------- what both directions share --
    def _order_after_stores(self, stream: Any, block_ids: set[int]) -> int:
        """`stream`'s next copies run only after the pending stores reading
        any of `block_ids` have read them. How many waits (a request's stores
        of a step share one)."""
        n, seen = 0, set()
        for job in self.stores_on_blocks(block_ids):
            if id(job.event) not in seen and not job.event.query():
                seen.add(id(job.event))
                stream.wait(job.event)
                n += 1
        return n

    def shutdown(self) -> None:
        """Finish every copy in flight, commit and release, stop the streams."""
        self.wait_loads()
        self.poll_loads()
        self.wait_stores()
        self._store_stream.close()
        self._load_stream.close()

    def _windows(self, groups: Sequence[GroupWindow]) -> list[tuple[KVLayout, GroupWindow]]:
        """Each layout with its KV-cache group's window of a unit."""
        if len(groups) != self._num_groups:
            raise InvalidArgumentError(f"a unit of {len(groups)} KV-cache group windows for an engine of "
                                       f"{self._num_groups} groups")
        return [(lay, groups[g]) for lay, g in zip(self.layouts, self._layout_groups)]

    def _sections(self, groups: Sequence[GroupWindow]) -> list[tuple[int, int]]:
        """(byte offset, bytes) of each layout's section of a unit's payload."""
        out, off = [], 0
        for lay, w in self._windows(groups):
            n = lay.payload_bytes(w.payload_blocks * lay.block_size)
            out.append((off, n))
            off += n
        return out

    def _copy_plan(self, groups: Sequence[GroupWindow]) -> list[tuple[int, KVLayout, Any, dict[str, Any]]]:
        """Every group's copy of a unit: computed once per unit, then used for every layer."""
        return list(self._group_copies(groups))

    def _group_copies(self, groups: Sequence[GroupWindow]) -> Iterator[tuple[int, KVLayout, Any, dict[str, Any]]]:
        """(layout index, layout, index, copy options) of each layout a unit's
        copy touches, its block ids checked against the cache
        (InvalidArgumentError naming the group and block) before it is yielded."""
        import numpy as np

        sections = self._sections(groups)
        for g, (lay, w) in enumerate(self._windows(groups)):
            if not w.block_ids:
                continue  # nothing of this group is needed (outside its sliding window)
            ids = np.asarray(w.block_ids, dtype=np.int64)
            bad = ids[(ids < 0) | (ids >= lay.geometry.num_blocks)]
            if bad.size:
                raise InvalidArgumentError(f"KV-cache group {self._layout_groups[g]}: block id {int(bad[0])} is "
                                           f"outside the {lay.geometry.num_blocks} blocks of the cache")
            if lay.token_mode:
                yield g, lay, self._window_slots(lay, w), {"part": sections[g]}
            else:
                yield g, lay, ids, {"payload_first": w.payload_first, "payload_blocks": w.payload_blocks,
                                    "part": sections[g]}

    @staticmethod
    def _tensor_blocks(lay: KVLayout, w: GroupWindow) -> list[int]:
        """The blocks of `lay`'s tensors (their first dim) a unit's window covers (an order checker's view)."""
        per = max(1, lay.block_size // lay.geometry.block_size) if lay.token_mode else 1
        return [b * per + j for b in w.block_ids for j in range(per)]

    @staticmethod
    def _window_slots(lay: KVLayout, w: GroupWindow):
        """Token payloads: the slot of every token of the section; -1 outside the window."""
        import numpy as np

        bs = lay.block_size
        slots = np.full(w.payload_blocks * bs, -1, dtype=np.int64)
        inside = lay.slots_for_blocks(list(w.block_ids), len(w.block_ids) * bs)
        slots[w.payload_first * bs:w.payload_first * bs + len(inside)] = inside
        return slots
