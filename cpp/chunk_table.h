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
};

// The table mutex is unusable (its bytes are not a mutex any more): the
// segment is broken. Thrown by every table operation; the bindings turn it
// into a Python error, never an abort.
struct SegmentBroken : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ColdEntry {
  Key key;
  Key ns;
  uint64_t size;
  uint32_t flags;
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
};

struct ReclaimResult {
  uint64_t leases = 0;
  uint64_t writes = 0;
  uint64_t procs = 0;
};

class ChunkTable {
 public:
  explicit ChunkTable(std::shared_ptr<Segment> seg);

  const std::shared_ptr<Segment>& segment() const { return seg_; }
  uint8_t* payload(uint64_t offset) const { return seg_->arena() + offset; }

  // -- stores
  Status reserve(const Key& key, uint64_t size, Reservation* out, const Key& ns = Key{0, 0});
  Status commit(const Reservation& r);
  Status abort(const Reservation& r);

  // -- loads
  Status acquire(const Key& key, LeaseHandle* out, bool count_lookup = true);
  // Leases on the longest READY prefix of keys[0..n); *n_out of them.
  Status acquire_prefix(const Key* keys, size_t n, LeaseHandle* out, size_t* n_out,
                        bool count_lookup = true);
  // cold: relink at the LRU tail, as if unread (the maintainer's spill reads)
  Status release(const LeaseHandle& h, bool cold = false);
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
  std::vector<std::string> drain_events();
  bool has_events() const { return has_events_.load(std::memory_order_relaxed); }

  // -- test hooks: take the lock (optionally scramble the derived structures as
  // a half-finished operation would), report on fd, then block forever so a
  // test can SIGKILL the process while it holds the lock.
  [[noreturn]] void debug_die_holding_lock(int notify_fd, bool scramble);

 private:
  friend class TableLock;
  Header* h() const { return seg_->header(); }
  Entry* entries() const { return reinterpret_cast<Entry*>(seg_->base() + h()->geo.entries_offset); }
  Lease* leases() const { return reinterpret_cast<Lease*>(seg_->base() + h()->geo.leases_offset); }
  uint32_t* index() const { return reinterpret_cast<uint32_t*>(seg_->base() + h()->geo.index_offset); }
  Extent* extents() const { return reinterpret_cast<Extent*>(seg_->base() + h()->geo.extents_offset); }
  ProcSlot* procs() const { return reinterpret_cast<ProcSlot*>(seg_->base() + h()->geo.procs_offset); }
  Counters& c() const { return h()->counters; }

  pid_t self_pid();
  void do_register_self_locked();

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
  bool do_evict_one_locked();
  void do_evict_locked(uint32_t e);          // e is READY and in the LRU list
  uint32_t do_find_ready_locked(const Key& k) const;  // kNone unless READY
  bool do_remove_ready_locked(uint32_t e);   // false: leased, doomed until release
  // records
  void do_free_entry_locked(uint32_t e);
  Status do_grant_lease_locked(uint32_t e, LeaseHandle* out);
  void do_drop_lease_locked(uint32_t l, bool cold = false);
  void do_after_refcount_drop_locked(uint32_t e, bool cold = false);
  void do_lru_link_tail_locked(uint32_t e);
  // recovery
  ReclaimResult do_reclaim_locked(bool full_scan);
  void do_rebuild_locked(const char* why);
  void do_reset_locked(const std::string& why);
  void log_event(const std::string& msg, bool warning = true);

  std::shared_ptr<Segment> seg_;
  pid_t pid_ = 0;
  uint64_t fork_generation_seen_ = ~0ull;
  pid_t registered_pid_ = 0;
  std::mutex events_mu_;
  std::vector<std::string> events_;
  std::atomic<bool> has_events_{false};
};

}  // namespace shmkv
