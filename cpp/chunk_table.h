// chunk_table.h — the operations on a shmkv segment: an open-addressing hash
// table of 128-bit keys, a payload allocator under a byte cap, an LRU of
// evictable chunks, read leases, persistent pins, and crash recovery.
//
// Protocol (all two-phase, no payload byte is copied under the lock):
//   store: reserve(key, size) -> write the bytes in place -> commit | abort
//   load:  acquire(key)       -> read the bytes in place  -> release
// A READY entry is evictable only when no lease and no pin holds it; the LRU
// list holds exactly those entries (ordered by last release/commit). reserve
// evicts from its tail; if even evicting every evictable entry could not make
// room it answers FULL at once without evicting anything.
//
// Lock scope: every method named do_*_locked expects Header::lock held; the
// public methods take it (TableLock), and a TableLock that inherits the lock
// from a dead owner (EOWNERDEAD) rebuilds every derived structure from the
// authoritative Entry/Lease records before going on (layout.h, "Crash model").
//
// Bounded waits: a TableLock waits at most lock_timeout for the mutex (a
// holder may be stopped by SIGSTOP, a debugger or a frozen container). Then
// lookups answer "miss", reserve answers BUSY, commit/abort/release are queued
// and done by the next operation of this process that gets the lock (they
// return at once: nothing is lost, the chunk becomes visible a little later),
// single-key management answers kTimedOut, and whole-table operations throw
// LockTimeout. Once a wait for one holder has timed out, later calls fail at
// once while that same holder keeps the lock, so a frozen holder costs one
// bound, not one per call.
//
// Damage: every derived value read from the segment is range-checked
// (DerivedCorrupt); a failed check rebuilds the derived structures from the
// records (or resets the segment if the records are impossible) and retries
// the operation once (layout.h, "Damage model").
#pragma once

#include <sys/types.h>

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "layout.h"
#include "segment.h"
#include "status.h"

namespace shmkv {

struct Reservation {
  uint32_t entry = kNone;
  uint32_t generation = 0;
  uint64_t offset = 0;  // arena offset of the payload
  uint64_t size = 0;
};

struct LeaseHandle {
  uint32_t lease = kNone;
  uint32_t generation = 0;
  uint32_t entry = kNone;
  uint64_t offset = 0;
  uint64_t size = 0;
  uint32_t tokens = 0;  // the entry's token count
  uint32_t flags = 0;   // the entry's flags when the lease was granted
};

// The table mutex is unusable (its bytes are not a mutex any more): the
// segment is broken. Thrown by every table operation; the bindings turn it
// into a Python error, never an abort.
struct SegmentBroken : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A whole-table operation could not get the table lock within the bound.
struct LockTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A derived value in the segment is out of range (internal: caught by the
// operation, which repairs the table and retries).
struct DerivedCorrupt : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Who holds the table lock right now, as the holder recorded it.
struct LockHolder {
  int32_t pid = 0;        // 0: nobody
  uint64_t held_ns = 0;   // for how long
};

struct ColdEntry {
  Key key;
  Key ns;
  uint64_t size;
  uint32_t flags;
  uint32_t tokens;
};

// One record as list_entries() reports it (audits, tests, the soak benchmark).
struct EntryInfo {
  Key key;
  Key ns;
  uint64_t size;
  uint64_t alloc_size;
  uint32_t state;
  uint32_t pin_count;
  uint32_t refcount;
  uint32_t flags;
  int32_t owner_pid;
  uint32_t tokens;
};

struct ReclaimResult {
  uint64_t leases = 0;
  uint64_t writes = 0;
  uint64_t procs = 0;
};

// What a put's eviction did: evicted one chunk; found nothing evictable; or found only
// chunks not yet on disk while the spill guard holds (ChunkTable::renew_spill_guard).
enum class EvictOutcome { kEvicted, kNothing, kSpillBehind };

// How far from the LRU tail a guarded eviction looks for a chunk already on disk.
constexpr uint32_t kSpillGuardReach = 4096;

class ChunkTable {
 public:
  static constexpr uint64_t kDefaultLockTimeoutNs = 300'000'000;  // 0.3 s

  explicit ChunkTable(std::shared_ptr<Segment> seg, uint64_t lock_timeout_ns = kDefaultLockTimeoutNs);
  ~ChunkTable();

  const std::shared_ptr<Segment>& segment() const { return seg_; }
  uint8_t* payload(uint64_t offset) const { return seg_->arena() + offset; }

  // -- stores
  // `tokens`: the prompt tokens the chunk holds (counted at commit as put_tokens; kept for spills)
  // `flags`: kFlagCompressed or 0 (other bits are refused)
  Status reserve(const Key& key, uint64_t size, Reservation* out, const Key& ns = Key{0, 0}, uint32_t tokens = 0,
                 uint32_t flags = 0);
  Status commit(const Reservation& r);
  Status abort(const Reservation& r);

  // -- loads
  Status acquire(const Key& key, LeaseHandle* out, bool count_lookup = true);
  // Leases on the longest READY prefix of keys[0..n); *n_out of them.
  Status acquire_prefix(const Key* keys, size_t n, LeaseHandle* out, size_t* n_out,
                        bool count_lookup = true);
  // cold: relink at the LRU tail, as if unread (the maintainer's spill reads)
  Status release(const LeaseHandle& h, bool cold = false);
  // Leases and reservations this object handed out and not yet released,
  // committed or aborted: while any is open, detach_process() must not run
  // (its slot is the liveness that keeps them from being reclaimed).
  int64_t open_handles() const { return open_handles_.load(std::memory_order_acquire); }

  // -- the spill guard (layout.h, Header::spill_guard_until_ns): the maintainer renews it
  // for `for_ns` while its spills reach the disk (0: lift it now)
  void renew_spill_guard(uint64_t for_ns);
  bool spill_guard_active() const;
  // Number of leading keys that are READY (one lock, no leases).
  size_t lookup_prefix(const Key* keys, size_t n, bool count_lookup = true);
  void contains(const Key* keys, size_t n, uint8_t* out);

  // -- management
  Status pin(const Key& key);
  Status unpin(const Key& key);
  Status erase(const Key& key);  // kBusy: leased, hidden now, freed at release
  uint64_t clear(const Key* ns = nullptr);  // erase everything (or one namespace)
  ReclaimResult reclaim();       // leases and WRITING entries of dead processes
  // -- tiers (the maintainer)
  // Up to max_n evictable entries, coldest first (the next eviction victims).
  std::vector<ColdEntry> coldest(size_t max_n);
  // Every non-free record, in record order.
  std::vector<EntryInfo> list_entries();
  Status set_flags(const Key& key, uint32_t flags);  // OR into a READY entry
  // Evict `key` if it is READY, unleased, unpinned and spilled (kBusy if not).
  Status evict_spilled(const Key& key);
  // Add n to a tier counter by name; false if no such counter.
  bool bump(const std::string& counter, uint64_t n);
  void detach_process();         // drop this process from the attached list
  void rebuild();                // force a full rebuild from authoritative records
  std::vector<std::string> check_consistency();
  std::map<std::string, uint64_t> stats();
  // evictions + deletes + resets: moves whenever a chunk may have left the table (lock-free read)
  uint64_t removal_count();
  std::vector<std::string> drain_events();
  LockHolder lock_holder() const;
  // Take and give back the table lock, waiting at most the bound: whether it
  // could be had (the controller's check before it changes anything).
  bool probe_lock();
  uint64_t lock_timeout_ns() const { return lock_timeout_ns_; }
  // Segment file size against its capacity; restore_size() grows a truncated
  // file back and resets the table (what was past the cut is gone).
  int64_t file_bytes() const { return seg_->file_bytes(); }
  Status restore_size(std::string* err);
  bool has_events() const { return has_events_.load(std::memory_order_relaxed); }

  // -- test hooks: take the lock (optionally scramble the derived structures as
  // a half-finished operation would), report on fd, then block forever so a
  // test can SIGKILL the process while it holds the lock.
  [[noreturn]] void debug_die_holding_lock(int notify_fd, bool scramble);

 private:
  friend class TableLock;
  Header* h() const { return seg_->header(); }
  const Geometry& geo() const { return seg_->geo(); }  // this process's validated copy
  Entry* entries() const { return reinterpret_cast<Entry*>(seg_->base() + geo().entries_offset); }
  Lease* leases() const { return reinterpret_cast<Lease*>(seg_->base() + geo().leases_offset); }
  uint32_t* index() const { return reinterpret_cast<uint32_t*>(seg_->base() + geo().index_offset); }
  Extent* extents() const { return reinterpret_cast<Extent*>(seg_->base() + geo().extents_offset); }
  ProcSlot* procs() const { return reinterpret_cast<ProcSlot*>(seg_->base() + geo().procs_offset); }
  Counters& c() const { return h()->counters; }

  // Run f (which expects the lock held); on DerivedCorrupt repair the table
  // and run it once more.
  template <class F>
  auto guarded(F&& f) -> decltype(f());
  template <class F>
  Status with_ready_entry(const Key& key, F&& fn);
  void check(bool ok, const char* what) const {
    if (!ok) throw DerivedCorrupt(what);
  }
  uint32_t checked_entry(uint32_t e, const char* what) const {
    check(e < geo().max_entries, what);
    return e;
  }
  uint32_t checked_link(uint32_t e, const char* what) const {  // an entry index or kNone
    check(e == kNone || e < geo().max_entries, what);
    return e;
  }

  // Deferred commit / abort / release (the lock was not free in time).
  struct Deferred {
    enum Kind { kCommit, kAbort, kRelease } kind;
    Reservation r;
    LeaseHandle l;
    bool cold;
  };
  void defer(const Deferred& d);
  void do_run_deferred_locked();

  pid_t self_pid();
  void do_register_self_locked();
  // liveness (process_liveness.cpp): a slot's process holds its byte, or is us
  bool slot_alive(uint32_t slot);
  // a lease's or write's holder: by its slot's holder id when it has one (a slot no longer
  // carrying that id: its process exited); else, and for the lock's holder, by the slots of
  // its pid (doubt: alive)
  bool holder_alive(pid_t pid, uint32_t holder = 0);
  // this process's holder id (0: it has no slot); valid under the lock, once registered
  uint32_t self_holder() const;
  // some attached process runs in another PID namespace (or ours is unknown)
  bool mixed_namespaces();

  // index
  uint64_t slot_of(const Key& k) const;
  uint32_t do_find_locked(const Key& k, uint64_t* slot_out = nullptr) const;
  void do_index_insert_locked(uint32_t e);
  void do_index_remove_locked(uint32_t e);
  void do_rehash_locked();
  // allocator
  bool do_alloc_locked(uint64_t need, uint64_t* offset);
  void do_free_extent_locked(uint64_t offset, uint64_t len);
  // LRU
  void do_lru_link_head_locked(uint32_t e);
  void do_lru_unlink_locked(uint32_t e);
  EvictOutcome do_evict_one_locked();
  void do_evict_locked(uint32_t e);          // e is READY and in the LRU list
  uint32_t do_find_ready_locked(const Key& k) const;  // kNone unless READY
  bool do_remove_ready_locked(uint32_t e);   // false: leased, doomed until release
  // records
  void do_free_entry_locked(uint32_t e);
  Status do_grant_lease_locked(uint32_t e, LeaseHandle* out);
  void do_drop_lease_locked(uint32_t l, bool cold = false);
  void do_after_refcount_drop_locked(uint32_t e, bool cold = false);
  void do_lru_link_tail_locked(uint32_t e);
  Status do_finish_locked(const Reservation& r, bool commit);
  Status do_reserve_locked(const Key& key, uint64_t size, uint64_t need, Reservation* out, const Key& ns,
                           uint32_t tokens, uint32_t flags);
  void do_count_ready_locked(const Entry& en, int delta);  // ready_entries and the compressed_* gauges
  Status do_release_locked(const LeaseHandle& h, bool cold);
  // recovery
  ReclaimResult do_reclaim_locked(bool full_scan);
  std::vector<std::string> do_check_consistency_locked();
  void do_rebuild_locked(const char* why);
  void do_reset_locked(const std::string& why);
  void log_event(const std::string& msg, bool warning = true);

  std::shared_ptr<Segment> seg_;
  pid_t pid_ = 0;
  uint64_t fork_generation_seen_ = ~0ull;
  pid_t registered_pid_ = 0;
  uint32_t my_slot_ = kNone;        // this process's slot once registered
  uint32_t my_pid_ns_ = 0;          // inode of this process's PID namespace
  uint64_t renewed_generation_ = 0;  // the fork generation whose description is our own
  // A forked child whose renewal failed: its description (and the slot locks on it) is its
  // parent's, so a slot that reads "not held" may be held by that very description
  bool description_shared_ = false;
  std::atomic<int64_t> open_handles_{0};
  std::mutex events_mu_;
  std::vector<std::string> events_;
  std::atomic<bool> has_events_{false};
  uint64_t lock_timeout_ns_;
  // The holder (pid, since) a wait last timed out on: while it still holds the
  // lock, later waits fail at once.
  std::atomic<int32_t> stuck_pid_{0};
  std::atomic<uint64_t> stuck_since_{0};
  std::mutex deferred_mu_;
  std::vector<Deferred> deferred_;
  std::atomic<bool> has_deferred_{false};
};

}  // namespace shmkv
