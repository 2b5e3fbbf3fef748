// table_admin.cpp — the rest of the chunk table's locking front: management
// (pin, unpin, erase, clear, reclaim), what the tiers and the maintainer ask
// (coldest, list_entries, flags, evict_spilled, counters), rebuild, the
// consistency check, stats, and restoring a truncated segment. Each takes the
// lock (table_lock.h) and calls the parts; see chunk_table.cpp for the map.
#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "chunk_table.h"
#include "counters.h"
#include "table_internal.h"
#include "table_lock.h"

namespace shmkv {

// ----------------------------------------------------------- management ----

Status ChunkTable::pin(const Key& key) {
  return with_ready_entry(key, [&](uint32_t e) {
    Entry& en = entries()[e];
    if (en.pin_count == 0) {
      if (en.refcount == 0) do_lru_unlink_locked(e);
      c().pinned_entries.fetch_add(1, std::memory_order_relaxed);
    }
    en.pin_count += 1;
    c().pins.fetch_add(1, std::memory_order_relaxed);
    return Status::kOk;
  });
}

Status ChunkTable::unpin(const Key& key) {
  return with_ready_entry(key, [&](uint32_t e) {
    Entry& en = entries()[e];
    if (en.pin_count == 0) return Status::kMiss;
    en.pin_count -= 1;
    if (en.pin_count == 0) {
      c().pinned_entries.fetch_sub(1, std::memory_order_relaxed);
      if (en.refcount == 0) {
        en.last_use = ++h()->use_clock;
        do_lru_link_head_locked(e);
      }
    }
    return Status::kOk;
  });
}

Status ChunkTable::erase(const Key& key) {
  return with_ready_entry(key, [&](uint32_t e) {
    c().deletes.fetch_add(1, std::memory_order_relaxed);
    return do_remove_ready_locked(e) ? Status::kOk : Status::kBusy;
  });
}

uint64_t ChunkTable::clear(const Key* ns) {
  TableLock lock(*this);
  lock.require("clear");
  return guarded([&] {
    Entry* ent = entries();
    uint64_t removed = 0;
    for (uint32_t e = 0; e < geo().max_entries; ++e) {
      if (ent[e].state.load(std::memory_order_relaxed) != kEntryReady) continue;
      if (ns && !(ent[e].ns == *ns)) continue;
      do_remove_ready_locked(e);
      ++removed;
    }
    c().deletes.fetch_add(removed, std::memory_order_relaxed);
    return removed;
  });
}

// -------------------------------------------------------------- reclaim ----

ReclaimResult ChunkTable::reclaim() {
  TableLock lock(*this);
  lock.require("reclaim");
  return guarded([&] {
    return do_reclaim_locked(true);
  });
}

// ---------------------------------------------------------------- tiers ----

std::vector<ColdEntry> ChunkTable::coldest(size_t max_n) {
  TableLock lock(*this);
  lock.require("coldest");
  return guarded([&] {
    std::vector<ColdEntry> out;
    Entry* ent = entries();
    out.clear();  // a retry starts over
    uint64_t steps = 0;
    for (uint32_t e = checked_link(h()->lru_tail, "LRU tail"); e != kNone && out.size() < max_n;
         e = checked_link(ent[e].lru_prev, "LRU link")) {
      check(++steps <= geo().max_entries, "LRU list has a cycle");
      out.push_back(ColdEntry{ent[e].key, ent[e].ns, ent[e].size, ent[e].flags, ent[e].tokens});
    }
    return out;
  });
}

std::vector<EntryInfo> ChunkTable::list_entries() {
  TableLock lock(*this);
  lock.require("list_entries");
  return guarded([&] {
    std::vector<EntryInfo> out;
    const Entry* ent = entries();
    for (uint32_t e = 0; e < geo().max_entries; ++e) {
      const Entry& en = ent[e];
      uint32_t st = en.state.load(std::memory_order_relaxed);
      if (st == kEntryFree) continue;
      out.push_back(EntryInfo{en.key, en.ns, en.size, en.alloc_size, st, en.pin_count, en.refcount, en.flags,
                              en.owner_pid, en.tokens});
    }
    return out;
  });
}

Status ChunkTable::set_flags(const Key& key, uint32_t flags) {
  return with_ready_entry(key, [&](uint32_t e) {
    entries()[e].flags |= flags & kFlagSpilled;  // kFlagCompressed is fixed at reserve
    return Status::kOk;
  });
}

Status ChunkTable::evict_spilled(const Key& key) {
  return with_ready_entry(key, [&](uint32_t e) {
    const Entry& en = entries()[e];
    if (en.refcount || en.pin_count || !(en.flags & kFlagSpilled)) return Status::kBusy;
    do_evict_locked(e);
    return Status::kOk;
  });
}

bool ChunkTable::bump(const std::string& name, uint64_t n) {
  for (const CounterInfo& nc : kCounters) {
    if (nc.bumpable && name == nc.name) {
      (c().*nc.member).fetch_add(n, std::memory_order_relaxed);
      return true;
    }
  }
  return false;
}

// ------------------------------------------------------------- recovery ----

void ChunkTable::rebuild() {
  TableLock lock(*this);
  lock.require("rebuild");
  return guarded([&] {
    do_rebuild_locked("requested");
  });
}

// ----------------------------------------------------------- inspection ----

std::vector<std::string> ChunkTable::check_consistency() {
  TableLock lock(*this);
  lock.require("check_consistency");
  return guarded([&] { return do_check_consistency_locked(); });
}

uint64_t ChunkTable::removal_count() {
  return c().evictions.load(std::memory_order_relaxed) + c().deletes.load(std::memory_order_relaxed) +
         h()->epoch.load();
}

std::map<std::string, uint64_t> ChunkTable::stats() {
  std::map<std::string, uint64_t> m;
  Header* hd = h();
  const Geometry& g = geo();
  Counters& k = c();
  for (const CounterInfo& nc : kCounters)
    if (nc.member != nullptr) m[nc.name] = (k.*nc.member).load(std::memory_order_relaxed);
  m["capacity_bytes"] = g.capacity_bytes;
  m["arena_bytes"] = g.arena_bytes;
  m["arena_reserved_bytes"] = std::min(hd->arena_reserved.load(std::memory_order_acquire), g.arena_bytes);
  m["max_payload_bytes"] = g.max_payload_bytes;
  m["max_entries"] = g.max_entries;
  m["max_leases"] = g.max_leases;
  m["alignment"] = g.alignment;
  m["epoch"] = hd->epoch.load();
  m["creator_pid"] = uint64_t(hd->creator_pid);
  m["created_unix_ns"] = hd->created_unix_ns;
  uint64_t attached = 0;
  ProcSlot* p = procs();
  for (uint32_t i = 0; i < g.max_procs; ++i) {
    int32_t pid = p[i].pid.load(std::memory_order_relaxed);
    if (pid != 0 && slot_alive(i)) attached += 1;
  }
  m["processes_attached"] = attached;
  // derived roots are read without the lock: a snapshot, possibly torn
  m["leases_held"] = hd->leases_held;
  m["evictable_bytes"] = hd->evictable_bytes;
  LockHolder who = lock_holder();
  m["lock_holder_pid"] = uint64_t(uint32_t(who.pid));
  m["lock_held_ms"] = who.held_ns / 1000000;
  m["lock_timeout_ms"] = lock_timeout_ns_ / 1000000;
  int64_t fb = file_bytes();
  m["file_bytes"] = fb < 0 ? 0 : uint64_t(fb);
  return m;
}

Status ChunkTable::restore_size(std::string* err) {
  int64_t now = file_bytes();
  if (now < 0 || uint64_t(now) >= geo().capacity_bytes) return Status::kOk;
  bool header_cut = uint64_t(now) < sizeof(Header);
  Status s = seg_->restore_size(err);  // first: touching a page past the end is SIGBUS
  if (s != Status::kOk) return s;
  if (header_cut) {
    *err = "segment '" + seg_->name() + "' was truncated to " + std::to_string(now) +
           " bytes, inside its header (the table lock is gone): unlink it and start again";
    return Status::kCorrupt;
  }
  c().segment_truncated.fetch_add(1, std::memory_order_relaxed);
  // Everything past the cut now reads as zero: records included. Start over.
  TableLock lock(*this);
  lock.require("restoring a truncated segment");
  do_reset_locked("the segment file had been truncated to " + std::to_string(now) + " of " +
                  std::to_string(geo().capacity_bytes) + " bytes");
  return Status::kOk;
}

void ChunkTable::debug_die_holding_lock(int notify_fd, bool scramble) {
  pthread_mutex_lock(&h()->lock);
  h()->lock_since_ns.store(now_mono_ns(), std::memory_order_relaxed);
  h()->lock_holder_pid.store(self_pid(), std::memory_order_release);
  if (scramble) {
    // What a process killed half-way through an operation could leave: broken
    // LRU links, a lost free extent, wrong gauges, a garbage index slot.
    Header* hd = h();
    Entry* ent = entries();
    if (hd->lru_head != kNone) ent[hd->lru_head].lru_prev = 12345;
    hd->lru_tail = kNone;
    if (hd->num_extents) hd->num_extents -= 1;
    c().bytes_used.fetch_add(777, std::memory_order_relaxed);
    hd->evictable_bytes += 4096;
    index()[0] = kIndexTomb;
    hd->free_entry_head = kNone;
    hd->free_lease_head = kNone;
  }
  char b = 'L';
  if (write(notify_fd, &b, 1) != 1) {}
  for (;;) pause();
}

}  // namespace shmkv
