// table_recovery.cpp — crash recovery (layout.h, "Crash model" and "Damage
// model"). The entry and lease records are authoritative; everything else is
// derived. do_rebuild_locked makes the derived state again in passes:
//   1. check every non-FREE entry record (state, alignment, size, extent
//      inside the arena) and that no two extents overlap: any failure means
//      the records are impossible, and the segment is reset instead;
//   2. leases: keep those that point at a live READY/DOOMED entry of the
//      same generation, free the others (any impossible state word too),
//      recount every entry's refcount and leases_held from the kept ones;
//   3. entries: DOOMED ones nobody reads any more are freed; a key present
//      twice (only if a death interrupted a reserve) keeps its READY record,
//      the other is doomed if leased, else freed (its commit answers STALE);
//   4. from the kept entries, in offset order: the free extents (the gaps),
//      the gauges (bytes used, entries, ready, pinned), the free-entry list;
//   5. the LRU from the READY, unleased, unpinned entries in last-use order
//      (and evictable_bytes, the use clock);
//   6. the index from the READY and WRITING entries.
// When the records themselves are impossible, do_reset_locked empties the
// segment (segment_resets) instead: the cache is disposable, a wrong byte is
// not. Both expect the table lock.
#include "chunk_table.h"
#include "table_internal.h"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

namespace shmkv {

// Rebuild every derived structure from the Entry and Lease records. If the
// records themselves are impossible (out of range, overlapping), empty the
// segment instead: the cache is disposable, a wrong byte is not.
void ChunkTable::do_rebuild_locked(const char* why) {
  Header* hd = h();
  const Geometry& g = geo();
  Entry* ent = entries();
  Lease* ls = leases();
  uint64_t max_alloc = align_up(g.max_payload_bytes, g.alignment);

  std::vector<uint32_t> live;
  for (uint32_t e = 0; e < g.max_entries; ++e) {
    uint32_t st = ent[e].state.load(std::memory_order_relaxed);
    if (st == kEntryFree) continue;
    const Entry& en = ent[e];
    bool ok = st <= kEntryDoomed && en.offset % g.alignment == 0 &&
              en.alloc_size % g.alignment == 0 && en.alloc_size >= en.size && en.size > 0 &&
              en.alloc_size <= max_alloc && en.offset <= g.arena_bytes &&
              en.alloc_size <= g.arena_bytes - en.offset;
    if (!ok) {
      do_reset_locked(std::string(why) + "; entry " + std::to_string(e) + " is invalid");
      return;
    }
    live.push_back(e);
  }
  std::sort(live.begin(), live.end(),
            [&](uint32_t a, uint32_t b) { return ent[a].offset < ent[b].offset; });
  for (size_t i = 1; i < live.size(); ++i) {
    if (ent[live[i - 1]].offset + ent[live[i - 1]].alloc_size > ent[live[i]].offset) {
      do_reset_locked(std::string(why) + "; entries " + std::to_string(live[i - 1]) + " and " +
                      std::to_string(live[i]) + " overlap");
      return;
    }
  }
  // Leases: keep those that point at a live READY/DOOMED entry of the same
  // generation; recount refcounts from them.
  for (uint32_t e : live) ent[e].refcount = 0;
  hd->free_lease_head = kNone;
  hd->leases_held = 0;
  for (uint32_t l = g.max_leases; l-- > 0;) {
    bool held = ls[l].state.load(std::memory_order_relaxed) == kLeaseHeld;
    if (held) {
      uint32_t e = ls[l].entry;
      uint32_t st = e < g.max_entries ? ent[e].state.load(std::memory_order_relaxed) : kEntryFree;
      if ((st == kEntryReady || st == kEntryDoomed) && ent[e].generation == ls[l].entry_generation) {
        ent[e].refcount += 1;
        hd->leases_held += 1;
        ls[l].next_free = kNone;
        continue;
      }
    }
    ls[l].state.store(kLeaseFree, std::memory_order_release);  // also a state word that is neither
    ls[l].next_free = hd->free_lease_head;
    hd->free_lease_head = l;
  }
  // Doomed entries nobody reads any more are freed. A key present twice (only
  // possible if a death interrupted a reserve) keeps its READY record; the
  // other is dropped (its writer's commit then answers STALE). Two READY
  // records of one key no writer ever makes: neither can be told the genuine
  // one, so neither is kept (a miss, never a forged record served).
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> by_key;
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> ready_count;
  for (uint32_t e : live)
    if (ent[e].state.load(std::memory_order_relaxed) == kEntryReady) ready_count[{ent[e].key.lo, ent[e].key.hi}] += 1;
  uint64_t twins = 0;
  std::vector<uint32_t> kept;
  for (int pass = 0; pass < 3; ++pass) {
    for (uint32_t e : live) {
      Entry& en = ent[e];
      uint32_t st = en.state.load(std::memory_order_relaxed);
      if (pass == 0 && st == kEntryDoomed) {
        if (en.refcount == 0) en.state.store(kEntryFree, std::memory_order_release);
        else kept.push_back(e);
        continue;
      }
      if ((pass == 1 && st != kEntryReady) || (pass == 2 && st != kEntryWriting) || pass == 0)
        continue;
      bool twin = st == kEntryReady && ready_count[{en.key.lo, en.key.hi}] > 1;
      if (twin) {
        twins += 1;
        by_key.emplace(std::make_pair(en.key.lo, en.key.hi), e);  // a WRITING record of it is dropped too
      }
      if (!twin && by_key.emplace(std::make_pair(en.key.lo, en.key.hi), e).second) {
        kept.push_back(e);
      } else if (en.refcount > 0) {
        en.state.store(kEntryDoomed, std::memory_order_release);
        kept.push_back(e);
      } else {
        en.state.store(kEntryFree, std::memory_order_release);
      }
    }
  }
  if (twins != 0) {
    log_event("dropped " + std::to_string(twins) + " committed records of keys that were held twice (no writer "
              "makes that: neither copy can be trusted); those chunks are misses now", true);
  }
  std::sort(kept.begin(), kept.end(),
            [&](uint32_t a, uint32_t b) { return ent[a].offset < ent[b].offset; });
  // Rebuild gauges, extents, free-entry list, LRU and index.
  uint64_t bytes = 0, nentries = 0, ready = 0, pinned = 0, zentries = 0, zbytes = 0;
  Extent* ex = extents();
  uint64_t nex = 0, cursor = 0;
  for (uint32_t e : kept) {
    Entry& en = ent[e];
    if (en.offset > cursor) ex[nex++] = Extent{cursor, en.offset - cursor};
    cursor = en.offset + en.alloc_size;
    bytes += en.alloc_size;
    nentries += 1;
    uint32_t st = en.state.load(std::memory_order_relaxed);
    if (st == kEntryReady) ready += 1;
    if (st == kEntryReady && en.pin_count) pinned += 1;
    if (st == kEntryReady && (en.flags & kFlagCompressed)) {
      zentries += 1;
      zbytes += en.size;
    }
    if (st != kEntryReady) en.pin_count = 0;
  }
  if (cursor < g.arena_bytes) ex[nex++] = Extent{cursor, g.arena_bytes - cursor};
  hd->num_extents = nex;
  c().bytes_used.store(bytes, std::memory_order_relaxed);
  c().entries.store(nentries, std::memory_order_relaxed);
  c().ready_entries.store(ready, std::memory_order_relaxed);
  c().pinned_entries.store(pinned, std::memory_order_relaxed);
  c().compressed_entries.store(zentries, std::memory_order_relaxed);
  c().compressed_bytes.store(zbytes, std::memory_order_relaxed);

  hd->free_entry_head = kNone;
  for (uint32_t e = g.max_entries; e-- > 0;) {
    if (ent[e].state.load(std::memory_order_relaxed) != kEntryFree) continue;
    ent[e].refcount = 0;
    ent[e].lru_prev = kNone;
    ent[e].lru_next = hd->free_entry_head;
    hd->free_entry_head = e;
  }
  std::vector<uint32_t> evictable;
  uint64_t max_use = 0;
  for (uint32_t e : kept) {
    Entry& en = ent[e];
    en.lru_prev = en.lru_next = kNone;
    max_use = std::max(max_use, en.last_use);
    if (en.state.load(std::memory_order_relaxed) == kEntryReady && en.refcount == 0 &&
        en.pin_count == 0)
      evictable.push_back(e);
  }
  std::sort(evictable.begin(), evictable.end(),
            [&](uint32_t a, uint32_t b) { return ent[a].last_use < ent[b].last_use; });
  hd->lru_head = hd->lru_tail = kNone;
  hd->evictable_bytes = 0;
  for (uint32_t e : evictable) do_lru_link_head_locked(e);  // oldest first: ends at tail
  if (hd->use_clock <= max_use) hd->use_clock = max_use + 1;

  std::memset(index(), 0xff, uint64_t(g.index_slots) * sizeof(uint32_t));
  hd->index_used = 0;
  for (uint32_t e : kept) {
    uint32_t st = ent[e].state.load(std::memory_order_relaxed);
    if (st == kEntryReady || st == kEntryWriting) do_index_insert_locked(e);
  }
  // adopting a stale segment is routine; recovering from a dead lock holder is not
  bool routine = std::strncmp(why, "adopting", 8) == 0 || std::strcmp(why, "requested") == 0 ||
                 std::strcmp(why, "after reset") == 0;
  log_event(std::string("rebuilt the chunk table (") + why + "): " + std::to_string(nentries) +
            " entries, " + format_bytes(bytes) + " kept", !routine);
}

void ChunkTable::do_reset_locked(const std::string& why) {
  Header* hd = h();
  const Geometry& g = geo();
  Entry* ent = entries();
  for (uint32_t e = 0; e < g.max_entries; ++e) {
    if (ent[e].state.load(std::memory_order_relaxed) != kEntryFree) ent[e].generation += 1;
    ent[e].state.store(kEntryFree, std::memory_order_release);
    ent[e].pin_count = 0;
  }
  Lease* ls = leases();
  for (uint32_t l = 0; l < g.max_leases; ++l) {
    ls[l].generation += 1;
    ls[l].state.store(kLeaseFree, std::memory_order_release);
  }
  hd->epoch.fetch_add(1);
  c().segment_resets.fetch_add(1, std::memory_order_relaxed);
  log_event("segment reset, all cached chunks dropped: " + why);
  do_rebuild_locked("after reset");
}

}  // namespace shmkv
