// table_index.cpp — the hash index: open addressing with linear probing over
// `index_slots` uint32 slots (entry number, kIndexEmpty or kIndexTomb), keyed
// by the full 128-bit key (compared on every probe). Derived state: rebuilt
// from the entry records on recovery; tombstones are cleared by a rehash when
// they pile up (index_rehashes). Every *_locked function expects the table lock.
#include "chunk_table.h"
#include "table_internal.h"

#include <cstring>

namespace shmkv {

// ---------------------------------------------------------------- index ----

uint64_t ChunkTable::slot_of(const Key& k) const {
  uint64_t x = k.lo ^ (k.hi * 0x9e3779b97f4a7c15ull);
  x ^= x >> 29;
  return x & (uint64_t(geo().index_slots) - 1);
}

uint32_t ChunkTable::do_find_locked(const Key& k, uint64_t* slot_out) const {
  const uint32_t* idx = index();
  const Entry* ent = entries();
  uint64_t mask = uint64_t(geo().index_slots) - 1;
  uint64_t s = slot_of(k);
  for (uint64_t probes = 0; probes <= mask; ++probes, s = (s + 1) & mask) {
    uint32_t v = idx[s];
    if (v == kIndexEmpty) return kNone;
    if (v == kIndexTomb) continue;
    check(v < geo().max_entries, "index slot points past the entry table");
    if (ent[v].key == k) {
      if (slot_out) *slot_out = s;
      return v;
    }
  }
  return kNone;
}

void ChunkTable::do_index_insert_locked(uint32_t e) {
  uint32_t* idx = index();
  uint64_t mask = uint64_t(geo().index_slots) - 1;
  uint64_t s = slot_of(entries()[e].key);
  uint64_t probes = 0;
  while (idx[s] != kIndexEmpty && idx[s] != kIndexTomb) {
    check(++probes <= mask, "the index has no free slot");
    s = (s + 1) & mask;
  }
  if (idx[s] == kIndexEmpty) h()->index_used += 1;
  idx[s] = e;
  // Tombstones lengthen probes; clean up when live + tombstones pass 3/4.
  if (h()->index_used * 4 > uint64_t(geo().index_slots) * 3) do_rehash_locked();
}

void ChunkTable::do_index_remove_locked(uint32_t e) {
  uint64_t s;
  if (do_find_locked(entries()[e].key, &s) == e) index()[s] = kIndexTomb;
}

void ChunkTable::do_rehash_locked() {
  Header* hd = h();
  std::memset(index(), 0xff, uint64_t(geo().index_slots) * sizeof(uint32_t));
  hd->index_used = 0;
  uint32_t* idx = index();
  uint64_t mask = uint64_t(geo().index_slots) - 1;
  Entry* ent = entries();
  for (uint32_t i = 0; i < geo().max_entries; ++i) {
    uint32_t st = ent[i].state.load(std::memory_order_relaxed);
    if (st != kEntryWriting && st != kEntryReady) continue;
    uint64_t s = slot_of(ent[i].key);
    while (idx[s] != kIndexEmpty) s = (s + 1) & mask;
    idx[s] = i;
    hd->index_used += 1;
  }
  c().index_rehashes.fetch_add(1, std::memory_order_relaxed);
}

}  // namespace shmkv
