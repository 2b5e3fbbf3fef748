// table_leases.cpp — the authoritative records and who holds them: entry
// records (freed last-write-wins: fields first, `state` last), read leases
// (pid + generation, so a reclaimed handle is STALE), the refcount an entry
// keeps while leased, and the reclaim of leases and half-written entries of
// processes that died. Every *_locked function expects the table lock.
#include "chunk_table.h"
#include "table_internal.h"

#include <cstring>
#include <unordered_map>
#include <vector>

namespace shmkv {

// -------------------------------------------------------------- records ----

void ChunkTable::do_count_ready_locked(const Entry& en, int delta) {
  c().ready_entries.fetch_add(uint64_t(int64_t(delta)), std::memory_order_relaxed);
  if (en.flags & kFlagCompressed) {
    c().compressed_entries.fetch_add(uint64_t(int64_t(delta)), std::memory_order_relaxed);
    c().compressed_bytes.fetch_add(uint64_t(int64_t(delta) * int64_t(en.size)), std::memory_order_relaxed);
  }
}

// The entry is already out of the index and the LRU list.
void ChunkTable::do_free_entry_locked(uint32_t e) {
  Entry& en = entries()[e];
  Header* hd = h();
  uint32_t st = en.state.load(std::memory_order_relaxed);
  en.state.store(kEntryFree, std::memory_order_release);  // commit point
  c().bytes_used.fetch_sub(en.alloc_size, std::memory_order_relaxed);
  c().entries.fetch_sub(1, std::memory_order_relaxed);
  if (st == kEntryReady) do_count_ready_locked(en, -1);
  if (en.pin_count) c().pinned_entries.fetch_sub(1, std::memory_order_relaxed);
  do_free_extent_locked(en.offset, en.alloc_size);
  en.refcount = 0;
  en.lru_prev = kNone;
  en.lru_next = checked_link(hd->free_entry_head, "free entry list head");
  hd->free_entry_head = e;
}

Status ChunkTable::do_grant_lease_locked(uint32_t e, LeaseHandle* out) {
  Header* hd = h();
  if (hd->free_lease_head == kNone) {
    ReclaimResult r = do_reclaim_locked(false);
    if (hd->free_lease_head == kNone && r.leases == 0) {
      c().lease_table_full.fetch_add(1, std::memory_order_relaxed);
      return Status::kBusy;
    }
  }
  uint32_t l = hd->free_lease_head;
  check(l < geo().max_leases, "free lease list head");
  Lease& ls = leases()[l];
  check(ls.state.load(std::memory_order_relaxed) == kLeaseFree, "free lease list holds a held lease");
  uint32_t next = ls.next_free;
  check(next == kNone || next < geo().max_leases, "free lease list link");
  Entry& en = entries()[e];
  // the payload handed out must lie inside the arena (a wild offset is a wild pointer)
  check(en.offset <= geo().arena_bytes && en.size <= en.alloc_size &&
            en.alloc_size <= geo().arena_bytes - en.offset,
        "an entry's payload lies outside the arena");
  hd->free_lease_head = next;
  ls.generation += 1;
  ls.entry = e;
  ls.entry_generation = en.generation;
  ls.pid = self_pid();
  ls.holder = self_holder();
  ls.next_free = kNone;
  ls.state.store(kLeaseHeld, std::memory_order_release);  // commit point
  hd->leases_held += 1;
  if (en.refcount++ == 0 && en.pin_count == 0) do_lru_unlink_locked(e);
  // last_use is stamped at release (a cold release keeps the old one)
  *out = LeaseHandle{l, ls.generation, e, en.offset, en.size, en.tokens, en.flags};
  return Status::kOk;
}

void ChunkTable::do_drop_lease_locked(uint32_t l, bool cold) {
  Header* hd = h();
  Lease& ls = leases()[l];
  uint32_t e = checked_entry(ls.entry, "a lease points past the entry table");
  check(entries()[e].refcount > 0, "an entry's refcount is below its leases");
  check(hd->free_lease_head == kNone || hd->free_lease_head < geo().max_leases, "free lease list head");
  ls.state.store(kLeaseFree, std::memory_order_release);  // commit point
  ls.next_free = hd->free_lease_head;
  hd->free_lease_head = l;
  hd->leases_held -= 1;
  Entry& en = entries()[e];
  en.refcount -= 1;
  if (en.refcount == 0) do_after_refcount_drop_locked(e, cold);
}

void ChunkTable::do_after_refcount_drop_locked(uint32_t e, bool cold) {
  Entry& en = entries()[e];
  uint32_t st = en.state.load(std::memory_order_relaxed);
  if (st == kEntryDoomed) {
    do_free_entry_locked(e);
  } else if (st == kEntryReady && en.pin_count == 0) {
    if (cold) {
      do_lru_link_tail_locked(e);  // back where its (unchanged) last_use puts it
    } else {
      en.last_use = ++h()->use_clock;
      do_lru_link_head_locked(e);
    }
  }
}



// Releases leases and frees WRITING entries whose owner has exited.
// full_scan=false is the cheap path used when an allocation would fail: it
// scans leases and entries only if some registered process has died.
ReclaimResult ChunkTable::do_reclaim_locked(bool full_scan) {
  ReclaimResult r;
  const Geometry& g = geo();
  ProcSlot* p = procs();
  // Each holder id's and each pid's verdict from the slots as they are now (any held slot of
  // the pid: alive), taken before the dead slots are freed, so the holders of a freed slot
  // are judged by it
  std::unordered_map<uint32_t, bool> holders;
  std::unordered_map<pid_t, bool> known;
  std::vector<uint32_t> dead;
  for (uint32_t i = 0; i < g.max_procs; ++i) {
    int32_t pid = p[i].pid.load(std::memory_order_relaxed);
    if (pid == 0) continue;
    bool alive = slot_alive(i);
    holders[p[i].holder] = alive;
    known[pid] |= alive;
    if (!alive) dead.push_back(i);
  }
  for (uint32_t i : dead) {
    p[i].pid.store(0, std::memory_order_release);
    r.procs += 1;
  }
  auto alive = [&](pid_t pid, uint32_t holder) {
    if (holder != 0) {
      auto h = holders.find(holder);
      return h != holders.end() && h->second;  // no slot carries it: its process exited
    }
    auto it = known.find(pid);
    if (it != known.end()) return it->second;
    bool a = holder_alive(pid);  // no slot: judged by /proc where that can be trusted
    known.emplace(pid, a);
    return a;
  };
  bool untracked = c().procs_table_full.load(std::memory_order_relaxed) != 0;
  if (!full_scan && r.procs == 0 && !untracked) return r;
  Lease* ls = leases();
  for (uint32_t l = 0; l < g.max_leases; ++l) {
    if (ls[l].state.load(std::memory_order_relaxed) != kLeaseHeld) continue;
    if (alive(ls[l].pid, ls[l].holder)) continue;
    do_drop_lease_locked(l);
    r.leases += 1;
  }
  Entry* ent = entries();
  for (uint32_t e = 0; e < g.max_entries; ++e) {
    if (ent[e].state.load(std::memory_order_relaxed) != kEntryWriting) continue;
    if (alive(ent[e].owner_pid, ent[e].owner_holder)) continue;
    do_index_remove_locked(e);
    do_free_entry_locked(e);
    r.writes += 1;
  }
  c().leases_reclaimed.fetch_add(r.leases, std::memory_order_relaxed);
  c().writes_reclaimed.fetch_add(r.writes, std::memory_order_relaxed);
  if (r.leases || r.writes) {
    log_event("reclaimed " + std::to_string(r.leases) + " lease(s) and " +
              std::to_string(r.writes) + " unfinished write(s) of exited processes");
  }
  return r;
}

}  // namespace shmkv
