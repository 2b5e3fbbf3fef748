// table_check.cpp — the consistency check: every derived structure (index,
// allocator, LRU, free lists, gauges) recomputed from the records and
// compared, returning what disagrees (at most 50 findings). Used by tests
// and the soak benchmark; expects the table lock.
#include "chunk_table.h"
#include "table_internal.h"

#include <algorithm>
#include <cstring>

#include <string>
#include <vector>

namespace shmkv {

std::vector<std::string> ChunkTable::do_check_consistency_locked() {
  {
    std::vector<std::string> bad;
    auto fail = [&](const std::string& s) {
      if (bad.size() < 50) bad.push_back(s);
    };
    Header* hd = h();
    const Geometry& g = geo();
    Entry* ent = entries();
    Lease* ls = leases();
    // refcounts vs leases
    std::vector<uint32_t> refs(g.max_entries, 0);
    uint64_t held = 0;
    for (uint32_t l = 0; l < g.max_leases; ++l) {
      if (ls[l].state.load() != kLeaseHeld) continue;
      held += 1;
      uint32_t e = ls[l].entry;
      if (e >= g.max_entries) {
        fail("lease " + std::to_string(l) + " points past the entry table");
        continue;
      }
      uint32_t st = ent[e].state.load();
      if (st != kEntryReady && st != kEntryDoomed)
        fail("lease " + std::to_string(l) + " holds entry " + std::to_string(e) + " in state " +
             std::to_string(st));
      if (ent[e].generation != ls[l].entry_generation)
        fail("lease " + std::to_string(l) + " has a stale entry generation");
      refs[e] += 1;
    }
    if (held != hd->leases_held) fail("leases_held " + std::to_string(hd->leases_held) +
                                      " != held leases " + std::to_string(held));
    uint64_t bytes = 0, n = 0, ready = 0, pinned = 0, zentries = 0, zbytes = 0, evictable_n = 0, evictable_b = 0;
    std::vector<std::pair<uint64_t, uint64_t>> allocs;
    for (uint32_t e = 0; e < g.max_entries; ++e) {
      uint32_t st = ent[e].state.load();
      if (st == kEntryFree) continue;
      const Entry& en = ent[e];
      if (en.refcount != refs[e])
        fail("entry " + std::to_string(e) + " refcount " + std::to_string(en.refcount) +
             " but " + std::to_string(refs[e]) + " leases");
      bytes += en.alloc_size;
      n += 1;
      if (st == kEntryReady) ready += 1;
      if (st == kEntryReady && en.pin_count) pinned += 1;
      if (st == kEntryReady && (en.flags & kFlagCompressed)) {
        zentries += 1;
        zbytes += en.size;
      }
      if (st == kEntryReady && en.refcount == 0 && en.pin_count == 0) {
        evictable_n += 1;
        evictable_b += en.alloc_size;
      }
      if (st == kEntryDoomed && en.refcount == 0) fail("doomed entry " + std::to_string(e) + " has no lease");
      allocs.emplace_back(en.offset, en.alloc_size);
      if (en.offset + en.alloc_size > hd->arena_reserved.load(std::memory_order_acquire))
        fail("entry " + std::to_string(e) + " lies beyond the reserved part of the arena");
      bool indexed = false;
      try {
        indexed = do_find_locked(en.key) == e;
      } catch (const DerivedCorrupt& dc) {
        fail(std::string("index: ") + dc.what());
      }
      if ((st == kEntryReady || st == kEntryWriting) != indexed)
        fail("entry " + std::to_string(e) + " state " + std::to_string(st) +
             (indexed ? " is" : " is not") + " reachable through the index");
    }
    if (bytes != c().bytes_used.load()) fail("bytes_used " + std::to_string(c().bytes_used.load()) +
                                             " != sum of live entries " + std::to_string(bytes));
    if (n != c().entries.load()) fail("entries gauge " + std::to_string(c().entries.load()) + " != " + std::to_string(n));
    if (ready != c().ready_entries.load()) fail("ready_entries gauge wrong");
    if (pinned != c().pinned_entries.load()) fail("pinned_entries gauge wrong");
    if (zentries != c().compressed_entries.load() || zbytes != c().compressed_bytes.load())
      fail("compressed_entries / compressed_bytes gauges wrong");
    if (bytes > g.arena_bytes) fail("bytes used exceed the arena");
    // extents + allocations tile the arena exactly
    Extent* ex = extents();
    uint64_t nex = hd->num_extents;
    if (nex > uint64_t(g.max_entries) + 1) {
      fail("num_extents " + std::to_string(nex) + " exceeds the extent table");
      nex = 0;
    }
    for (uint64_t i = 0; i < nex; ++i) {
      allocs.emplace_back(ex[i].offset, ex[i].length);
      if (ex[i].length == 0) fail("empty free extent");
      if (i && ex[i - 1].offset + ex[i - 1].length >= ex[i].offset)
        fail("free extents " + std::to_string(i - 1) + "," + std::to_string(i) + " unsorted or unmerged");
    }
    std::sort(allocs.begin(), allocs.end());
    uint64_t cursor = 0;
    for (auto& a : allocs) {
      if (a.first != cursor) {
        fail("arena not tiled at offset " + std::to_string(cursor) + " (next piece at " +
             std::to_string(a.first) + ")");
        break;
      }
      cursor = a.first + a.second;
    }
    if (cursor != g.arena_bytes && bad.empty()) fail("arena tiling ends at " + std::to_string(cursor));
    // LRU list: exactly the evictable entries, properly linked
    uint64_t walked = 0, walked_b = 0;
    uint32_t prev = kNone;
    for (uint32_t e = hd->lru_head; e != kNone && walked <= g.max_entries; e = ent[e].lru_next) {
      if (e >= g.max_entries) {
        fail("LRU link " + std::to_string(e) + " points past the entry table");
        break;
      }
      if (ent[e].lru_prev != prev) fail("LRU back link broken at entry " + std::to_string(e));
      uint32_t st = ent[e].state.load();
      if (st != kEntryReady || ent[e].refcount || ent[e].pin_count)
        fail("LRU holds non-evictable entry " + std::to_string(e));
      walked += 1;
      walked_b += ent[e].alloc_size;
      prev = e;
    }
    if (prev != hd->lru_tail) fail("LRU tail does not match the list");
    if (walked != evictable_n) fail("LRU has " + std::to_string(walked) + " entries, " +
                                    std::to_string(evictable_n) + " are evictable");
    if (walked_b != hd->evictable_bytes || evictable_b != hd->evictable_bytes)
      fail("evictable_bytes gauge wrong");
    // free lists
    uint64_t free_entries = 0;
    for (uint32_t e = hd->free_entry_head; e != kNone && free_entries <= g.max_entries; e = ent[e].lru_next) {
      if (e >= g.max_entries) {
        fail("free entry link points past the entry table");
        break;
      }
      if (ent[e].state.load() != kEntryFree) fail("free list holds live entry " + std::to_string(e));
      free_entries += 1;
    }
    if (free_entries + n != g.max_entries) fail("free entry list has " + std::to_string(free_entries) +
                                                " records, expected " + std::to_string(g.max_entries - n));
    uint64_t free_leases = 0;
    for (uint32_t l = hd->free_lease_head; l != kNone && free_leases <= g.max_leases; l = ls[l].next_free) {
      if (l >= g.max_leases) {
        fail("free lease link points past the lease table");
        break;
      }
      if (ls[l].state.load() != kLeaseFree) fail("free lease list holds a held lease");
      free_leases += 1;
    }
    if (free_leases + held != g.max_leases) fail("free lease list length wrong");
    // index bookkeeping
    uint64_t used = 0;
    for (uint32_t s = 0; s < g.index_slots; ++s) used += index()[s] != kIndexEmpty;
    if (used != hd->index_used) fail("index_used wrong");
    return bad;
  }
}

}  // namespace shmkv
