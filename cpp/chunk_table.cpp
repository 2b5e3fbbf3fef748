// chunk_table.cpp — the locking front of the chunk table: construction,
// deferred operations, process registration, and the hot-path operations
// (stores, loads, lookups), each taking the lock (table_lock.h) and calling
// the parts, one concern per file as in memcached:
//   table_admin.cpp      management, tiers, stats, restore (the rest of the front)
//   table_index.cpp      hash index          table_allocator.cpp  payload extents
//   table_lru.cpp        LRU of evictables   table_leases.cpp     records, leases, reclaim
//   table_recovery.cpp   rebuild / reset     table_check.cpp      consistency check
//   process_liveness.cpp who is alive
// See chunk_table.h for the protocol and layout.h for the crash model. Every
// change to an authoritative record (Entry, Lease) writes its fields first
// and its `state` word last (release), so do_rebuild_locked can always
// reconstruct the derived structures from the records alone.
#include "chunk_table.h"
#include "counters.h"
#include "table_internal.h"
#include "table_lock.h"

#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <unordered_map>

namespace shmkv {
namespace {

std::atomic<uint64_t> g_fork_generation{0};
void on_fork_child() { g_fork_generation.fetch_add(1, std::memory_order_relaxed); }
const int g_atfork_registered = pthread_atfork(nullptr, nullptr, on_fork_child);

}  // namespace

ChunkTable::ChunkTable(std::shared_ptr<Segment> seg, uint64_t lock_timeout_ns)
    : seg_(std::move(seg)), lock_timeout_ns_(lock_timeout_ns) {
  (void)g_atfork_registered;
  self_pid();
  if (seg_->needs_rebuild()) {
    TableLock lock(*this);
    lock.require("adopting a stale segment");
    guarded([&] {
      do_rebuild_locked("adopting a segment whose processes had all exited");
      do_reclaim_locked(true);
      return 0;
    });
  } else {
    TableLock lock(*this);  // registers this process (later, if the lock is busy now)
  }
}

ChunkTable::~ChunkTable() {
  // Deferred commits/releases left: one more bounded try. Whatever is still
  // queued after it is reclaimed when this process exits (dead owner).
  if (has_deferred_.load(std::memory_order_relaxed)) {
    try {
      TableLock lock(*this);
    } catch (const std::exception&) {
    }
  }
}

bool ChunkTable::probe_lock() {
  TableLock lock(*this);
  return lock.ok();
}

LockHolder ChunkTable::lock_holder() const {
  LockHolder out;
  out.pid = h()->lock_holder_pid.load(std::memory_order_acquire);
  if (out.pid != 0) {
    uint64_t since = h()->lock_since_ns.load(std::memory_order_relaxed);
    uint64_t now = now_mono_ns();
    out.held_ns = now > since ? now - since : 0;
  }
  return out;
}

void ChunkTable::defer(const Deferred& d) {
  std::lock_guard<std::mutex> g(deferred_mu_);
  deferred_.push_back(d);
  has_deferred_.store(true, std::memory_order_relaxed);
  c().deferred_ops.fetch_add(1, std::memory_order_relaxed);
}

void ChunkTable::do_run_deferred_locked() {
  std::vector<Deferred> todo;
  {
    std::lock_guard<std::mutex> g(deferred_mu_);
    todo.swap(deferred_);
    has_deferred_.store(false, std::memory_order_relaxed);
  }
  for (const Deferred& d : todo) {
    if (d.kind == Deferred::kRelease) do_release_locked(d.l, d.cold);
    else do_finish_locked(d.r, d.kind == Deferred::kCommit);
  }
}

pid_t ChunkTable::self_pid() {
  uint64_t g = g_fork_generation.load(std::memory_order_relaxed);
  if (g != fork_generation_seen_) {
    fork_generation_seen_ = g;
    pid_ = getpid();
    my_pid_ns_ = own_pid_namespace();
  }
  return pid_;
}

void ChunkTable::do_register_self_locked() {
  pid_t me = self_pid();
  if (registered_pid_ == me) return;
  uint64_t gen = g_fork_generation.load(std::memory_order_relaxed);
  if (gen != renewed_generation_) {
    // A forked child shares its parent's description of the segment file, and with it the
    // parent's slot lock: it takes one of its own, so each process's slot lives and dies with it
    renewed_generation_ = gen;
    my_slot_ = kNone;  // the parent's
    if (gen != 0 && !seg_->renew_description()) {
      // No description of its own (no /proc): a slot locked through the parent's would read
      // "not held" to the parent (and the parent's to us). So this process takes no slot: its
      // leases and writes are judged by its pid, and it judges slots that read free by theirs.
      c().liveness_unshared.fetch_add(1, std::memory_order_relaxed);
      description_shared_ = true;
      registered_pid_ = me;
      log_event("process " + std::to_string(me) + " was forked from a process attached to the segment and "
                "cannot open a description of its own (/proc is not mounted): its liveness is judged by pid");
      return;
    }
  }
  ProcSlot* p = procs();
  uint32_t n = geo().max_procs;
  uint32_t free_slot = kNone;
  bool stale_own_pid = false;
  for (uint32_t i = 0; i < n; ++i) {
    int32_t pid = p[i].pid.load(std::memory_order_relaxed);
    if (pid == me && p[i].pid_ns == my_pid_ns_ && my_pid_ns_ != 0) {
      // Another Store of this process holds it (its lock, through that Store's own
      // description, reads "held" from ours) and it was claimed by a process started when we
      // were. Otherwise a dead process that had our pid left it: its leases must be reclaimed,
      // never adopted.
      uint64_t started = proc_start_time(me);
      if (seg_->slot_held(i) == 1 && (started == 0 || p[i].start_time == 0 || p[i].start_time == started)) {
        seg_->hold_slot(i);
        my_slot_ = i;
        registered_pid_ = me;
        return;
      }
      stale_own_pid = true;
      continue;
    }
    if (pid == 0 && free_slot == kNone) free_slot = i;
  }
  if (stale_own_pid) {
    // judged by the slot's lock alone (our pid is on it): reclaims that process's leases and writes
    do_reclaim_locked(true);
    if (free_slot == kNone)
      for (uint32_t i = 0; i < n && free_slot == kNone; ++i)
        if (p[i].pid.load(std::memory_order_relaxed) == 0) free_slot = i;
  }
  if (free_slot == kNone) {
    // Make room: forget processes that have exited (their leases are found by
    // the full reclaim scan, which does not need the slot).
    for (uint32_t i = 0; i < n; ++i) {
      if (p[i].pid.load(std::memory_order_relaxed) != 0 && !slot_alive(i)) {
        do_reclaim_locked(true);
        break;
      }
    }
    for (uint32_t i = 0; i < n && free_slot == kNone; ++i)
      if (p[i].pid.load(std::memory_order_relaxed) == 0) free_slot = i;
  }
  // NOTE: the lock is taken before the pid is published (both under the table lock): a
  // checker never sees a registered slot that nobody holds yet
  if (free_slot == kNone || !seg_->hold_slot(free_slot)) {
    c().procs_table_full.fetch_add(1, std::memory_order_relaxed);
    registered_pid_ = me;  // do not retry on every call
    return;
  }
  p[free_slot].start_time = proc_start_time(me);
  p[free_slot].attached_unix_ns = now_unix_ns();
  p[free_slot].pid_ns = my_pid_ns_;
  uint32_t id = ++h()->next_holder;
  p[free_slot].holder = id != 0 ? id : ++h()->next_holder;
  p[free_slot].pid.store(me, std::memory_order_release);
  my_slot_ = free_slot;
  registered_pid_ = me;
}

void ChunkTable::detach_process() {
  TableLock lock(*this);
  if (!lock.ok()) return;  // the slot is freed when this process is found dead
  pid_t me = self_pid();
  ProcSlot* p = procs();
  for (uint32_t i = 0; i < geo().max_procs; ++i)
    if (p[i].pid.load(std::memory_order_relaxed) == me && p[i].pid_ns == my_pid_ns_) {
      seg_->release_slot(i);
      // another Store of this process still holds the byte through its own description:
      // the slot, and the holder id its leases and writes carry, stay
      if (seg_->slot_held(i) != 0) continue;
      p[i].pid.store(0, std::memory_order_release);
    }
  my_slot_ = kNone;
  registered_pid_ = 0;
}

// Events are drained by the Python bindings into logging ("W:" -> warning,
// "I:" -> info), outside the lock and with the GIL.
void ChunkTable::log_event(const std::string& msg, bool warning) {
  std::lock_guard<std::mutex> g(events_mu_);
  events_.push_back((warning ? "W:" : "I:") + msg);
  has_events_.store(true, std::memory_order_relaxed);
}

std::vector<std::string> ChunkTable::drain_events() {
  std::lock_guard<std::mutex> g(events_mu_);
  std::vector<std::string> out;
  out.swap(events_);
  has_events_.store(false, std::memory_order_relaxed);
  return out;
}

// --------------------------------------------------------------- stores ----

namespace {
// A handle's holder is done with it when commit/abort/release returns (done now, or deferred
// to this process's next lock): counted on the way out, after the operation.
struct HandleClosed {
  std::atomic<int64_t>& n;
  explicit HandleClosed(std::atomic<int64_t>& c) : n(c) {}
  ~HandleClosed() { n.fetch_sub(1, std::memory_order_acq_rel); }
};
}  // namespace

Status ChunkTable::reserve(const Key& key, uint64_t size, Reservation* out, const Key& ns, uint32_t tokens,
                           uint32_t flags) {
  const Geometry& g = geo();
  if (size == 0 || (flags & ~kFlagCompressed)) return Status::kInvalidArgument;
  if (size > g.max_payload_bytes) {
    c().put_too_large.fetch_add(1, std::memory_order_relaxed);
    return Status::kTooLarge;
  }
  uint64_t need = align_up(size, g.alignment);
  TableLock lock(*this);
  if (!lock.ok()) {
    c().put_busy.fetch_add(1, std::memory_order_relaxed);
    return Status::kBusy;
  }
  Status st = guarded([&] { return do_reserve_locked(key, size, need, out, ns, tokens, flags); });
  if (st == Status::kOk) open_handles_.fetch_add(1, std::memory_order_acq_rel);
  return st;
}

Status ChunkTable::do_reserve_locked(const Key& key, uint64_t size, uint64_t need, Reservation* out,
                                     const Key& ns, uint32_t tokens, uint32_t flags) {
  const Geometry& g = geo();
  Header* hd = h();
  Entry* ent = entries();
  uint32_t existing = do_find_locked(key);
  if (existing != kNone) {
    Entry& ex = ent[existing];
    if (ex.state.load(std::memory_order_relaxed) == kEntryReady) {
      c().put_exists.fetch_add(1, std::memory_order_relaxed);
      // A put of a chunk held is a use (an engine computed it again, or its own
      // prefix cache served it): the newest in the LRU, as a read would make it.
      if (ex.refcount == 0 && ex.pin_count == 0) {
        do_lru_unlink_locked(existing);
        ex.last_use = ++hd->use_clock;
        do_lru_link_head_locked(existing);
      }
      return Status::kExists;
    }
    // WRITING: by a live process -> busy; by a dead one -> reclaim and go on.
    if (holder_alive(ex.owner_pid, ex.owner_holder)) {
      c().put_busy.fetch_add(1, std::memory_order_relaxed);
      return Status::kBusy;
    }
    do_index_remove_locked(existing);
    c().writes_reclaimed.fetch_add(1, std::memory_order_relaxed);
    do_free_entry_locked(existing);
  }
  // Room check before evicting anything: if all free plus all evictable bytes
  // cannot hold it, answer FULL without destroying the cache. Dead processes'
  // leases and half-writes are reclaimed first (cheap unless someone died).
  check(c().bytes_used.load(std::memory_order_relaxed) <= g.arena_bytes && hd->evictable_bytes <= g.arena_bytes,
        "bytes_used or evictable_bytes exceed the arena");
  // Only the reserved part of the arena is usable (Header::arena_reserved).
  uint64_t usable = std::min(hd->arena_reserved.load(std::memory_order_acquire), g.arena_bytes);
  auto room = [&] {
    uint64_t used = c().bytes_used.load(std::memory_order_relaxed);
    return (usable > used ? usable - used : 0) + hd->evictable_bytes;
  };
  if (room() < need) do_reclaim_locked(false);
  if (room() < need) {
    (usable < g.arena_bytes ? c().put_unreserved : c().put_full).fetch_add(1, std::memory_order_relaxed);
    return Status::kFull;
  }
  // FULL, counted by why: nothing evictable (or fragmentation: the total was enough, no hole
  // is), or only chunks not yet on disk while the spill guard holds
  auto full = [&](EvictOutcome why) {
    (why == EvictOutcome::kSpillBehind ? c().put_spill_behind : c().put_full).fetch_add(1, std::memory_order_relaxed);
    return Status::kFull;
  };
  uint64_t offset = 0;
  while (!do_alloc_locked(need, &offset)) {
    EvictOutcome ev = do_evict_one_locked();
    if (ev != EvictOutcome::kEvicted) return full(ev);
  }
  while (hd->free_entry_head == kNone) {
    c().entry_table_full.fetch_add(1, std::memory_order_relaxed);
    EvictOutcome ev = do_evict_one_locked();
    if (ev != EvictOutcome::kEvicted && do_reclaim_locked(false).writes == 0) {
      do_free_extent_locked(offset, need);
      return full(ev);
    }
  }
  uint32_t e = checked_entry(hd->free_entry_head, "free entry list head");
  Entry& en = ent[e];
  check(en.state.load(std::memory_order_relaxed) == kEntryFree, "free entry list holds a live entry");
  hd->free_entry_head = checked_link(en.lru_next, "free entry list link");
  en.key = key;
  en.offset = offset;
  en.size = size;
  en.alloc_size = need;
  en.last_use = ++hd->use_clock;
  en.generation += 1;
  en.owner_pid = self_pid();
  en.owner_holder = self_holder();
  en.pin_count = 0;
  en.flags = flags;  // a re-stored key starts unspilled
  en.ns = ns;
  en.tokens = tokens;
  en.refcount = 0;
  en.lru_prev = en.lru_next = kNone;
  en.state.store(kEntryWriting, std::memory_order_release);  // commit point
  c().bytes_used.fetch_add(need, std::memory_order_relaxed);
  c().entries.fetch_add(1, std::memory_order_relaxed);
  do_index_insert_locked(e);
  *out = Reservation{e, en.generation, offset, size};
  return Status::kOk;
}

Status ChunkTable::commit(const Reservation& r) {
  if (r.entry >= geo().max_entries) return Status::kInvalidArgument;
  HandleClosed closed(open_handles_);
  TableLock lock(*this);
  if (!lock.ok()) {
    defer(Deferred{Deferred::kCommit, r, LeaseHandle{}, false});
    return Status::kOk;  // visible once this process next gets the lock
  }
  return guarded([&] { return do_finish_locked(r, true); });
}

Status ChunkTable::abort(const Reservation& r) {
  if (r.entry >= geo().max_entries) return Status::kInvalidArgument;
  HandleClosed closed(open_handles_);
  TableLock lock(*this);
  if (!lock.ok()) {
    defer(Deferred{Deferred::kAbort, r, LeaseHandle{}, false});
    return Status::kOk;
  }
  return guarded([&] { return do_finish_locked(r, false); });
}

Status ChunkTable::do_finish_locked(const Reservation& r, bool commit) {
  Entry& en = entries()[r.entry];
  if (en.state.load(std::memory_order_relaxed) != kEntryWriting || en.generation != r.generation) {
    c().stale_handles.fetch_add(1, std::memory_order_relaxed);
    return Status::kStale;  // reclaimed (we were presumed dead) or reset
  }
  if (!commit) {
    do_index_remove_locked(r.entry);
    do_free_entry_locked(r.entry);
    c().writes_aborted.fetch_add(1, std::memory_order_relaxed);
    return Status::kOk;
  }
  en.last_use = ++h()->use_clock;
  do_lru_link_head_locked(r.entry);  // derived first: if it finds damage, nothing is committed yet
  en.state.store(kEntryReady, std::memory_order_release);  // commit point
  do_count_ready_locked(en, +1);
  c().puts.fetch_add(1, std::memory_order_relaxed);
  c().put_tokens.fetch_add(en.tokens, std::memory_order_relaxed);
  c().put_bytes.fetch_add(en.size, std::memory_order_relaxed);
  return Status::kOk;
}

// ---------------------------------------------------------------- loads ----

Status ChunkTable::acquire(const Key& key, LeaseHandle* out, bool count_lookup) {
  size_t n = 0;
  Status s = acquire_prefix(&key, 1, out, &n, count_lookup);
  if (s != Status::kOk) return s;
  return n == 1 ? Status::kOk : Status::kMiss;
}

Status ChunkTable::acquire_prefix(const Key* keys, size_t n, LeaseHandle* out, size_t* n_out,
                                  bool count_lookup) {
  TableLock lock(*this);
  *n_out = 0;
  if (!lock.ok()) return Status::kOk;  // a miss
  Entry* ent = entries();
  size_t got = 0;
  Status s = Status::kOk;
  guarded([&] {
    for (size_t i = 0; i < got; ++i) do_release_locked(out[i], true);  // a retry starts over
    got = 0;
    for (; got < n; ++got) {
      uint32_t e = do_find_locked(keys[got]);
      if (e == kNone || ent[e].state.load(std::memory_order_relaxed) != kEntryReady) break;
      if (do_grant_lease_locked(e, &out[got]) != Status::kOk) break;  // lease table full
    }
    return 0;
  });
  if (count_lookup) {
    c().lookups.fetch_add(got + (got < n ? 1 : 0), std::memory_order_relaxed);
    c().hits.fetch_add(got, std::memory_order_relaxed);
    if (got < n) c().misses.fetch_add(1, std::memory_order_relaxed);
  }
  *n_out = got;
  open_handles_.fetch_add(int64_t(got), std::memory_order_acq_rel);
  return s;
}

Status ChunkTable::release(const LeaseHandle& hnd, bool cold) {
  if (hnd.lease >= geo().max_leases) return Status::kInvalidArgument;
  HandleClosed closed(open_handles_);
  TableLock lock(*this);
  if (!lock.ok()) {
    // The bytes were read under a lease that is still held: they are valid.
    defer(Deferred{Deferred::kRelease, Reservation{}, hnd, cold});
    return Status::kOk;
  }
  return guarded([&] { return do_release_locked(hnd, cold); });
}

Status ChunkTable::do_release_locked(const LeaseHandle& hnd, bool cold) {
  Lease& ls = leases()[hnd.lease];
  if (ls.state.load(std::memory_order_relaxed) != kLeaseHeld || ls.generation != hnd.generation) {
    c().stale_handles.fetch_add(1, std::memory_order_relaxed);
    return Status::kStale;  // reclaimed or reset: the bytes read may be wrong
  }
  do_drop_lease_locked(hnd.lease, cold);
  return Status::kOk;
}

size_t ChunkTable::lookup_prefix(const Key* keys, size_t n, bool count_lookup) {
  TableLock lock(*this);
  if (!lock.ok()) return 0;  // a miss
  Entry* ent = entries();
  size_t got = guarded([&] {
    size_t k = 0;
    for (; k < n; ++k) {
      uint32_t e = do_find_locked(keys[k]);
      if (e == kNone || ent[e].state.load(std::memory_order_relaxed) != kEntryReady) break;
    }
    return k;
  });
  if (count_lookup) {
    c().lookups.fetch_add(got + (got < n ? 1 : 0), std::memory_order_relaxed);
    c().hits.fetch_add(got, std::memory_order_relaxed);
    if (got < n) c().misses.fetch_add(1, std::memory_order_relaxed);
  }
  return got;
}

void ChunkTable::contains(const Key* keys, size_t n, uint8_t* out) {
  std::memset(out, 0, n);
  TableLock lock(*this);
  if (!lock.ok()) return;  // all misses
  Entry* ent = entries();
  guarded([&] {
    for (size_t i = 0; i < n; ++i) {
      uint32_t e = do_find_locked(keys[i]);
      uint32_t st = e == kNone ? kEntryFree : ent[e].state.load(std::memory_order_relaxed);
      out[i] = st == kEntryReady ? 1 : st == kEntryWriting ? 2 : 0;
    }
    return 0;
  });
}

}  // namespace shmkv
