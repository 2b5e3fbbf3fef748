// table_lru.cpp — the LRU: a doubly linked list through the entry records
// that holds exactly the evictable entries (READY, no lease, no pin), newest
// at the head; puts evict from the tail. Derived state: rebuilt on recovery
// in last-use order. Every *_locked function expects the table lock.
#include "chunk_table.h"
#include "table_internal.h"
#include "table_lock.h"

#include <cstring>

namespace shmkv {

// ------------------------------------------------------------------ LRU ----

void ChunkTable::do_lru_link_head_locked(uint32_t e) {
  Entry* ent = entries();
  Header* hd = h();
  checked_link(hd->lru_head, "LRU head");
  checked_link(hd->lru_tail, "LRU tail");
  ent[e].lru_prev = kNone;
  ent[e].lru_next = hd->lru_head;
  if (hd->lru_head != kNone) ent[hd->lru_head].lru_prev = e;
  hd->lru_head = e;
  if (hd->lru_tail == kNone) hd->lru_tail = e;
  hd->evictable_bytes += ent[e].alloc_size;
}

void ChunkTable::do_lru_unlink_locked(uint32_t e) {
  Entry* ent = entries();
  Header* hd = h();
  uint32_t p = checked_link(ent[e].lru_prev, "LRU link"), n = checked_link(ent[e].lru_next, "LRU link");
  check(p != kNone ? ent[p].lru_next == e : hd->lru_head == e, "LRU list links disagree");
  check(n != kNone ? ent[n].lru_prev == e : hd->lru_tail == e, "LRU list links disagree");
  check(hd->evictable_bytes >= ent[e].alloc_size, "evictable_bytes below an evictable entry");
  if (p != kNone) ent[p].lru_next = n;
  else hd->lru_head = n;
  if (n != kNone) ent[n].lru_prev = p;
  else hd->lru_tail = p;
  ent[e].lru_prev = ent[e].lru_next = kNone;
  hd->evictable_bytes -= ent[e].alloc_size;
}

bool ChunkTable::spill_guard_active() const {
  return now_mono_ns() < h()->spill_guard_until_ns.load(std::memory_order_acquire);
}

void ChunkTable::renew_spill_guard(uint64_t for_ns) {
  h()->spill_guard_until_ns.store(for_ns ? now_mono_ns() + for_ns : 0, std::memory_order_release);
}

EvictOutcome ChunkTable::do_evict_one_locked() {
  uint32_t e = checked_link(h()->lru_tail, "LRU tail");
  if (e == kNone) return EvictOutcome::kNothing;
  if (spill_guard_active()) {
    // The disk takes what RAM lets go: the coldest chunk already on disk within reach of
    // the tail goes; none there means the writes outran the spills (the put answers FULL)
    uint32_t steps = 0;
    while (e != kNone && !(entries()[e].flags & kFlagSpilled)) {
      if (++steps >= kSpillGuardReach) return EvictOutcome::kSpillBehind;
      e = checked_link(entries()[e].lru_prev, "LRU link");
    }
    if (e == kNone) return EvictOutcome::kSpillBehind;
  }
  const Entry& en = entries()[e];
  check(en.state.load(std::memory_order_relaxed) == kEntryReady && en.refcount == 0 && en.pin_count == 0,
        "the LRU list holds an entry that is not evictable");
  do_evict_locked(e);
  return EvictOutcome::kEvicted;
}

void ChunkTable::do_evict_locked(uint32_t e) {
  do_lru_unlink_locked(e);
  do_index_remove_locked(e);
  c().evictions.fetch_add(1, std::memory_order_relaxed);
  if (!(entries()[e].flags & kFlagSpilled)) c().evicted_unspilled.fetch_add(1, std::memory_order_relaxed);
  c().evicted_bytes.fetch_add(entries()[e].alloc_size, std::memory_order_relaxed);
  do_free_entry_locked(e);
}

uint32_t ChunkTable::do_find_ready_locked(const Key& k) const {
  uint32_t e = do_find_locked(k);
  if (e == kNone || entries()[e].state.load(std::memory_order_relaxed) != kEntryReady) return kNone;
  return e;
}

// Out of the index now; freed now, or (leased) doomed and freed at the last release.
bool ChunkTable::do_remove_ready_locked(uint32_t e) {
  Entry& en = entries()[e];
  do_index_remove_locked(e);
  if (en.refcount == 0) {
    if (en.pin_count == 0) do_lru_unlink_locked(e);
    do_free_entry_locked(e);
    return true;
  }
  if (en.pin_count) {
    c().pinned_entries.fetch_sub(1, std::memory_order_relaxed);
    en.pin_count = 0;
  }
  en.state.store(kEntryDoomed, std::memory_order_release);
  do_count_ready_locked(en, -1);
  return false;
}

// The LRU list is ordered by last_use (head newest). Re-insert `e` at its
// place by age, walking from the tail: short for the cold entries the
// maintainer reads, and it keeps their order.
void ChunkTable::do_lru_link_tail_locked(uint32_t e) {
  Entry* ent = entries();
  Header* hd = h();
  uint32_t newer = checked_link(hd->lru_tail, "LRU tail");  // first entry, from the tail, not older than e
  uint64_t steps = 0;
  while (newer != kNone && ent[newer].last_use < ent[e].last_use) {
    check(++steps <= geo().max_entries, "LRU list has a cycle");
    newer = checked_link(ent[newer].lru_prev, "LRU link");
  }
  uint32_t older = checked_link(newer == kNone ? hd->lru_head : ent[newer].lru_next, "LRU link");
  ent[e].lru_prev = newer;
  ent[e].lru_next = older;
  if (newer != kNone) ent[newer].lru_next = e;
  else hd->lru_head = e;
  if (older != kNone) ent[older].lru_prev = e;
  else hd->lru_tail = e;
  hd->evictable_bytes += ent[e].alloc_size;
}

}  // namespace shmkv
