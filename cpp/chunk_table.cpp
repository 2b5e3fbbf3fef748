// chunk_table.cpp — see chunk_table.h for the protocol and layout.h for the
// crash model. Every change to an authoritative record (Entry, Lease) writes
// its fields first and its `state` word last (release), so do_rebuild_locked
// can always reconstruct the derived structures from the records alone.
#include "chunk_table.h"
#include "counters.h"

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

uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

uint64_t now_unix_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); 0 when
// unreadable. Together with the pid it names one process, so a recycled pid is
// not mistaken for the process that leased a chunk.
uint64_t proc_start_time(pid_t pid) {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d/stat", int(pid));
  std::ifstream f(path);
  if (!f) return 0;
  std::string line;
  std::getline(f, line);
  size_t close = line.rfind(')');
  if (close == std::string::npos) return 0;
  std::istringstream rest(line.substr(close + 2));
  std::string tok;
  for (int field = 3; field <= 22 && (rest >> tok); ++field) {
    if (field == 22) return std::strtoull(tok.c_str(), nullptr, 10);
  }
  return 0;
}

bool process_alive(pid_t pid, uint64_t start_time) {
  if (pid <= 0) return false;
  if (kill(pid, 0) != 0 && errno == ESRCH) return false;
  if (start_time != 0) {
    uint64_t now = proc_start_time(pid);
    if (now != 0 && now != start_time) return false;  // pid was recycled
  }
  return true;
}

// Liveness answers cached for the duration of one scan.
struct LivenessCache {
  std::unordered_map<pid_t, bool> known;
  const ProcSlot* procs;
  uint32_t nprocs;
  bool alive(pid_t pid) {
    auto it = known.find(pid);
    if (it != known.end()) return it->second;
    uint64_t start = 0;
    for (uint32_t i = 0; i < nprocs; ++i) {
      if (procs[i].pid.load(std::memory_order_relaxed) == pid) {
        start = procs[i].start_time;
        break;
      }
    }
    bool a = process_alive(pid, start);
    known.emplace(pid, a);
    return a;
  }
};

}  // namespace

static uint64_t now_mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Whether a thread id (the owner a glibc robust mutex records in its first
// word) names a live thread on this host.
static bool tid_alive(int32_t tid) {
  if (tid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d", int(tid));
  return access(path, F_OK) == 0;
}

// Takes the table mutex, waiting at most the table's bound; on EOWNERDEAD
// rebuilds the table before the caller proceeds. ok() is false when the wait
// timed out (counted; the caller answers its ordinary fallback). A mutex whose
// bytes are not a mutex any more throws SegmentBroken.
// NOTE: this is the only place the mutex is acquired.
class TableLock {
 public:
  explicit TableLock(ChunkTable& t) : t_(t) {
    Header* hd = t.h();
    pthread_mutex_t* m = &hd->lock;
    int rc = pthread_mutex_trylock(m);
    if (rc == EBUSY) {
      int32_t pid = hd->lock_holder_pid.load(std::memory_order_acquire);
      uint64_t since = hd->lock_since_ns.load(std::memory_order_relaxed);
      if (pid != 0 && pid == t.stuck_pid_.load(std::memory_order_relaxed) &&
          since == t.stuck_since_.load(std::memory_order_relaxed)) {
        timed_out();  // the holder we already waited for has not let go
        return;
      }
      timespec deadline;
      clock_gettime(CLOCK_MONOTONIC, &deadline);
      uint64_t ns = uint64_t(deadline.tv_nsec) + t.lock_timeout_ns_;
      deadline.tv_sec += time_t(ns / 1000000000ull);
      deadline.tv_nsec = long(ns % 1000000000ull);
      rc = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &deadline);
    }
    if (rc == ETIMEDOUT) {
      int32_t pid = hd->lock_holder_pid.load(std::memory_order_acquire);
      // A robust mutex's first word is its owner's thread id (plus flag bits).
      int32_t owner_tid = int32_t(*reinterpret_cast<volatile uint32_t*>(m) & 0x3fffffffu);
      if (!tid_alive(owner_tid) && (pid == 0 || kill(pid, 0) != 0)) {
        // Nobody alive owns it, and a dead owner would have made it EOWNERDEAD:
        // its bytes were overwritten.
        throw SegmentBroken("the segment's table lock is unusable (held by thread " +
                            std::to_string(owner_tid) + ", which does not exist): the segment was "
                            "overwritten; unlink it and start again");
      }
      t.stuck_pid_.store(pid, std::memory_order_relaxed);
      t.stuck_since_.store(hd->lock_since_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
      timed_out();
      return;
    }
    if (rc == EOWNERDEAD) {
      held_ = true;
      mark_held();
      t.c().lock_recoveries.fetch_add(1, std::memory_order_relaxed);
      try {
        t.do_rebuild_locked("a process died holding the table lock");
      } catch (const DerivedCorrupt& e) {
        t.do_reset_locked(std::string("rebuild after a dead lock holder failed: ") + e.what());
      }
      pthread_mutex_consistent(m);
    } else if (rc != 0) {
      // ENOTRECOVERABLE cannot happen with this code (we always mark the mutex
      // consistent); anything else means the mutex bytes were overwritten.
      throw SegmentBroken(std::string("the segment's table lock is unusable (pthread_mutex_lock: ") +
                          std::strerror(rc) + "): the segment was overwritten; unlink it and start again");
    } else {
      held_ = true;
      mark_held();
    }
    t.stuck_pid_.store(0, std::memory_order_relaxed);
    t.guarded([&] {
      t.do_register_self_locked();
      if (t.has_deferred_.load(std::memory_order_relaxed)) t.do_run_deferred_locked();
      return 0;
    });
  }
  ~TableLock() {
    if (!held_) return;
    t_.h()->lock_holder_pid.store(0, std::memory_order_release);
    pthread_mutex_unlock(&t_.h()->lock);
  }
  bool ok() const { return held_; }
  // For whole-table operations: no fallback answer, so a timeout is an error.
  void require(const char* what) const {
    if (held_) return;
    LockHolder who = t_.lock_holder();
    throw LockTimeout(std::string(what) + ": the table lock of segment '" + t_.segment()->name() +
                      "' is held by pid " + std::to_string(who.pid) + " for " +
                      std::to_string(who.held_ns / 1000000) + " ms (over the " +
                      std::to_string(t_.lock_timeout_ns_ / 1000000) +
                      " ms bound); is that process stopped?");
  }

 private:
  void mark_held() {
    Header* hd = t_.h();
    hd->lock_since_ns.store(now_mono_ns(), std::memory_order_relaxed);
    hd->lock_holder_pid.store(t_.self_pid(), std::memory_order_release);
  }
  void timed_out() { t_.c().lock_timeouts.fetch_add(1, std::memory_order_relaxed); }

  ChunkTable& t_;
  bool held_ = false;
};

template <class F>
auto ChunkTable::guarded(F&& f) -> decltype(f()) {
  for (int attempt = 0;; ++attempt) {
    try {
      return f();
    } catch (const DerivedCorrupt& e) {
      c().metadata_repairs.fetch_add(1, std::memory_order_relaxed);
      std::string why = std::string("derived metadata out of range (") + e.what() + ")";
      if (attempt >= 2) throw SegmentBroken("segment '" + seg_->name() + "': " + why + " even after a reset");
      try {
        if (attempt == 0) do_rebuild_locked(why.c_str());
        else do_reset_locked(why);
      } catch (const DerivedCorrupt& e2) {
        do_reset_locked(why + "; rebuild failed: " + e2.what());
      }
    }
  }
}

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
  }
  return pid_;
}

void ChunkTable::do_register_self_locked() {
  pid_t me = self_pid();
  if (registered_pid_ == me) return;
  ProcSlot* p = procs();
  uint32_t n = geo().max_procs;
  uint32_t free_slot = kNone;
  for (uint32_t i = 0; i < n; ++i) {
    int32_t pid = p[i].pid.load(std::memory_order_relaxed);
    if (pid == me) {
      registered_pid_ = me;
      return;
    }
    if (pid == 0 && free_slot == kNone) free_slot = i;
  }
  if (free_slot == kNone) {
    // Make room: forget processes that have exited (their leases are found by
    // the full reclaim scan, which does not need the slot).
    for (uint32_t i = 0; i < n; ++i) {
      int32_t pid = p[i].pid.load(std::memory_order_relaxed);
      if (pid != 0 && !process_alive(pid, p[i].start_time)) {
        do_reclaim_locked(true);
        break;
      }
    }
    for (uint32_t i = 0; i < n && free_slot == kNone; ++i)
      if (p[i].pid.load(std::memory_order_relaxed) == 0) free_slot = i;
  }
  if (free_slot == kNone) {
    c().procs_table_full.fetch_add(1, std::memory_order_relaxed);
    registered_pid_ = me;  // do not retry on every call
    return;
  }
  p[free_slot].start_time = proc_start_time(me);
  p[free_slot].attached_unix_ns = now_unix_ns();
  p[free_slot].pid.store(me, std::memory_order_release);
  registered_pid_ = me;
}

void ChunkTable::detach_process() {
  TableLock lock(*this);
  if (!lock.ok()) return;  // the slot is freed when this process is found dead
  pid_t me = self_pid();
  ProcSlot* p = procs();
  for (uint32_t i = 0; i < geo().max_procs; ++i)
    if (p[i].pid.load(std::memory_order_relaxed) == me) p[i].pid.store(0, std::memory_order_release);
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

// ------------------------------------------------------------ allocator ----
// Free extents sorted by offset, always merged with their neighbours. There
// are at most (live allocations + 1) of them, so the array never overflows.

bool ChunkTable::do_alloc_locked(uint64_t need, uint64_t* offset) {
  const Geometry& g = geo();
  Extent* ex = extents();
  uint64_t n = h()->num_extents;
  check(n <= uint64_t(g.max_entries) + 1, "more free extents than the extent table holds");
  for (uint64_t i = 0; i < n; ++i) {
    if (ex[i].length < need) continue;
    check(ex[i].offset <= g.arena_bytes && ex[i].length <= g.arena_bytes - ex[i].offset &&
              ex[i].offset % g.alignment == 0,
          "a free extent lies outside the arena");
    *offset = ex[i].offset;
    ex[i].offset += need;
    ex[i].length -= need;
    if (ex[i].length == 0) {
      std::memmove(&ex[i], &ex[i + 1], (n - i - 1) * sizeof(Extent));
      h()->num_extents = n - 1;
    }
    return true;
  }
  return false;
}

void ChunkTable::do_free_extent_locked(uint64_t off, uint64_t len) {
  const Geometry& g = geo();
  Extent* ex = extents();
  uint64_t n = h()->num_extents;
  check(n <= g.max_entries, "more free extents than live allocations allow");
  check(off <= g.arena_bytes && len <= g.arena_bytes - off, "a freed extent lies outside the arena");
  // first extent starting after `off`
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    uint64_t mid = (lo + hi) / 2;
    if (ex[mid].offset < off) lo = mid + 1;
    else hi = mid;
  }
  uint64_t i = lo;
  check(i == 0 || ex[i - 1].offset + ex[i - 1].length <= off, "a freed extent overlaps a free one");
  check(i == n || off + len <= ex[i].offset, "a freed extent overlaps a free one");
  bool merge_prev = i > 0 && ex[i - 1].offset + ex[i - 1].length == off;
  bool merge_next = i < n && off + len == ex[i].offset;
  if (merge_prev && merge_next) {
    ex[i - 1].length += len + ex[i].length;
    std::memmove(&ex[i], &ex[i + 1], (n - i - 1) * sizeof(Extent));
    h()->num_extents = n - 1;
  } else if (merge_prev) {
    ex[i - 1].length += len;
  } else if (merge_next) {
    ex[i].offset = off;
    ex[i].length += len;
  } else {
    std::memmove(&ex[i + 1], &ex[i], (n - i) * sizeof(Extent));
    ex[i] = Extent{off, len};
    h()->num_extents = n + 1;
  }
}

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

bool ChunkTable::do_evict_one_locked() {
  uint32_t e = checked_link(h()->lru_tail, "LRU tail");
  if (e == kNone) return false;
  const Entry& en = entries()[e];
  check(en.state.load(std::memory_order_relaxed) == kEntryReady && en.refcount == 0 && en.pin_count == 0,
        "the LRU list holds an entry that is not evictable");
  do_evict_locked(e);
  return true;
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
  c().ready_entries.fetch_sub(1, std::memory_order_relaxed);
  return false;
}

// -------------------------------------------------------------- records ----

// The entry is already out of the index and the LRU list.
void ChunkTable::do_free_entry_locked(uint32_t e) {
  Entry& en = entries()[e];
  Header* hd = h();
  uint32_t st = en.state.load(std::memory_order_relaxed);
  en.state.store(kEntryFree, std::memory_order_release);  // commit point
  c().bytes_used.fetch_sub(en.alloc_size, std::memory_order_relaxed);
  c().entries.fetch_sub(1, std::memory_order_relaxed);
  if (st == kEntryReady) c().ready_entries.fetch_sub(1, std::memory_order_relaxed);
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
  ls.next_free = kNone;
  ls.state.store(kLeaseHeld, std::memory_order_release);  // commit point
  hd->leases_held += 1;
  if (en.refcount++ == 0 && en.pin_count == 0) do_lru_unlink_locked(e);
  // last_use is stamped at release (a cold release keeps the old one)
  *out = LeaseHandle{l, ls.generation, e, en.offset, en.size};
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

// --------------------------------------------------------------- stores ----

Status ChunkTable::reserve(const Key& key, uint64_t size, Reservation* out, const Key& ns) {
  const Geometry& g = geo();
  if (size == 0) return Status::kInvalidArgument;
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
  return guarded([&] { return do_reserve_locked(key, size, need, out, ns); });
}

Status ChunkTable::do_reserve_locked(const Key& key, uint64_t size, uint64_t need, Reservation* out,
                                     const Key& ns) {
  const Geometry& g = geo();
  Header* hd = h();
  Entry* ent = entries();
  uint32_t existing = do_find_locked(key);
  if (existing != kNone) {
    Entry& ex = ent[existing];
    if (ex.state.load(std::memory_order_relaxed) == kEntryReady) {
      c().put_exists.fetch_add(1, std::memory_order_relaxed);
      return Status::kExists;
    }
    // WRITING: by a live process -> busy; by a dead one -> reclaim and go on.
    LivenessCache lc{{}, procs(), g.max_procs};
    if (lc.alive(ex.owner_pid)) {
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
  auto room = [&] {
    return g.arena_bytes - c().bytes_used.load(std::memory_order_relaxed) + hd->evictable_bytes;
  };
  if (room() < need) do_reclaim_locked(false);
  if (room() < need) {
    c().put_full.fetch_add(1, std::memory_order_relaxed);
    return Status::kFull;
  }
  uint64_t offset = 0;
  while (!do_alloc_locked(need, &offset)) {
    if (!do_evict_one_locked()) {  // fragmentation: total was enough, no hole is
      c().put_full.fetch_add(1, std::memory_order_relaxed);
      return Status::kFull;
    }
  }
  while (hd->free_entry_head == kNone) {
    c().entry_table_full.fetch_add(1, std::memory_order_relaxed);
    if (!do_evict_one_locked() && do_reclaim_locked(false).writes == 0) {
      do_free_extent_locked(offset, need);
      c().put_full.fetch_add(1, std::memory_order_relaxed);
      return Status::kFull;
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
  en.pin_count = 0;
  en.flags = 0;  // a re-stored key starts unspilled
  en.ns = ns;
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
  TableLock lock(*this);
  if (!lock.ok()) {
    defer(Deferred{Deferred::kCommit, r, LeaseHandle{}, false});
    return Status::kOk;  // visible once this process next gets the lock
  }
  return guarded([&] { return do_finish_locked(r, true); });
}

Status ChunkTable::abort(const Reservation& r) {
  if (r.entry >= geo().max_entries) return Status::kInvalidArgument;
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
  c().ready_entries.fetch_add(1, std::memory_order_relaxed);
  c().puts.fetch_add(1, std::memory_order_relaxed);
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
  return s;
}

Status ChunkTable::release(const LeaseHandle& hnd, bool cold) {
  if (hnd.lease >= geo().max_leases) return Status::kInvalidArgument;
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
      out[i] = e != kNone && ent[e].state.load(std::memory_order_relaxed) == kEntryReady;
    }
    return 0;
  });
}

// ----------------------------------------------------------- management ----

Status ChunkTable::pin(const Key& key) {
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    if (e == kNone) return Status::kMiss;
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
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    if (e == kNone || entries()[e].pin_count == 0) return Status::kMiss;
    Entry& en = entries()[e];
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
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    if (e == kNone) return Status::kMiss;
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

// Releases leases and frees WRITING entries whose owner has exited.
// full_scan=false is the cheap path used when an allocation would fail: it
// scans leases and entries only if some registered process has died.
ReclaimResult ChunkTable::do_reclaim_locked(bool full_scan) {
  ReclaimResult r;
  Header* hd = h();
  const Geometry& g = geo();
  LivenessCache lc{{}, procs(), g.max_procs};
  ProcSlot* p = procs();
  for (uint32_t i = 0; i < g.max_procs; ++i) {
    int32_t pid = p[i].pid.load(std::memory_order_relaxed);
    if (pid != 0 && !lc.alive(pid)) {
      p[i].pid.store(0, std::memory_order_release);
      r.procs += 1;
    }
  }
  bool untracked = c().procs_table_full.load(std::memory_order_relaxed) != 0;
  if (!full_scan && r.procs == 0 && !untracked) return r;
  Lease* ls = leases();
  for (uint32_t l = 0; l < g.max_leases; ++l) {
    if (ls[l].state.load(std::memory_order_relaxed) != kLeaseHeld) continue;
    if (lc.alive(ls[l].pid)) continue;
    do_drop_lease_locked(l);
    r.leases += 1;
  }
  Entry* ent = entries();
  for (uint32_t e = 0; e < g.max_entries; ++e) {
    if (ent[e].state.load(std::memory_order_relaxed) != kEntryWriting) continue;
    if (lc.alive(ent[e].owner_pid)) continue;
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
      out.push_back(ColdEntry{ent[e].key, ent[e].ns, ent[e].size, ent[e].flags});
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
                              en.owner_pid});
    }
    return out;
  });
}

Status ChunkTable::set_flags(const Key& key, uint32_t flags) {
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    if (e == kNone) return Status::kMiss;
    entries()[e].flags |= flags;
    return Status::kOk;
  });
}

Status ChunkTable::evict_spilled(const Key& key) {
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    if (e == kNone) return Status::kMiss;
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
  // other is dropped (its writer's commit then answers STALE).
  std::map<std::pair<uint64_t, uint64_t>, uint32_t> by_key;
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
      if (by_key.emplace(std::make_pair(en.key.lo, en.key.hi), e).second) {
        kept.push_back(e);
      } else if (en.refcount > 0) {
        en.state.store(kEntryDoomed, std::memory_order_release);
        kept.push_back(e);
      } else {
        en.state.store(kEntryFree, std::memory_order_release);
      }
    }
  }
  std::sort(kept.begin(), kept.end(),
            [&](uint32_t a, uint32_t b) { return ent[a].offset < ent[b].offset; });
  // Rebuild gauges, extents, free-entry list, LRU and index.
  uint64_t bytes = 0, nentries = 0, ready = 0, pinned = 0;
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
    if (st != kEntryReady) en.pin_count = 0;
  }
  if (cursor < g.arena_bytes) ex[nex++] = Extent{cursor, g.arena_bytes - cursor};
  hd->num_extents = nex;
  c().bytes_used.store(bytes, std::memory_order_relaxed);
  c().entries.store(nentries, std::memory_order_relaxed);
  c().ready_entries.store(ready, std::memory_order_relaxed);
  c().pinned_entries.store(pinned, std::memory_order_relaxed);

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

// ----------------------------------------------------------- inspection ----

std::vector<std::string> ChunkTable::check_consistency() {
  TableLock lock(*this);
  lock.require("check_consistency");
  return guarded([&] {
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
    uint64_t bytes = 0, n = 0, ready = 0, pinned = 0, evictable_n = 0, evictable_b = 0;
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
      if (st == kEntryReady && en.refcount == 0 && en.pin_count == 0) {
        evictable_n += 1;
        evictable_b += en.alloc_size;
      }
      if (st == kEntryDoomed && en.refcount == 0) fail("doomed entry " + std::to_string(e) + " has no lease");
      allocs.emplace_back(en.offset, en.alloc_size);
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
  });
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
    if (pid != 0 && process_alive(pid, p[i].start_time)) attached += 1;
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
