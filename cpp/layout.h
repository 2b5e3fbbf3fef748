// layout.h — the byte layout of one shmkv shared-memory segment, drawn once.
//
//   offset 0            Header            magic, version, fingerprints, geometry,
//                                         the robust table mutex, counters, roots
//   geo.procs_offset    ProcSlot[max_procs]     processes attached (pid, since)
//   geo.entries_offset  Entry[max_entries]      the chunk records  (AUTHORITATIVE)
//   geo.leases_offset   Lease[max_leases]       read leases        (AUTHORITATIVE)
//   geo.index_offset    uint32[index_slots]     open-addressing index -> entry
//   geo.extents_offset  Extent[max_entries + 1] free payload extents, by offset
//   geo.arena_offset    payload bytes ........  arena_bytes, the byte cap
//   = geo.capacity_bytes (the file is exactly this long)
//
// Damage model. A process keeps its own copy of the Geometry, validated when it
// attached, and never reads the header's again; every derived value it reads
// (heads, links, index slots, extents, gauges) is bounds-checked before use,
// and an impossible one triggers a rebuild from the authoritative records
// (ChunkTable::DerivedCorrupt), never a wild pointer.
//
// Crash model. Every structure is changed only under Header::lock (a
// process-shared robust mutex), but a process can die anywhere, also while it
// holds the lock. So the segment keeps two kinds of state:
//   * authoritative: Entry records (key, state, offset, sizes, owner, pins,
//     last_use) and Lease records. Each change to them ends with ONE release
//     store of the record's `state` word (the commit point), so a record is
//     either wholly old or wholly new to any survivor.
//   * derived: the index, the free-extent list, the LRU list, the free-record
//     lists, refcounts and the bytes/entries gauges. A survivor that gets
//     EOWNERDEAD rebuilds all of them from the authoritative records
//     (ChunkTable::do_rebuild_locked) instead of trusting half-made changes.
// Payload bytes are never touched under the lock; a WRITING entry belongs to
// its owner pid until commit/abort, and a READY entry's bytes are immutable
// until it is freed, which cannot happen while a lease is held.
#pragma once

#include <pthread.h>
#include <sys/types.h>

#include <atomic>
#include <cstddef>
#include <cstdint>

namespace shmkv {

constexpr uint64_t kMagic = 0x31564b4d48535f5fULL;  // "__SHMKV1" little-endian
constexpr uint32_t kFormatVersion = 10;  // 10: remote_healed; 9: the spill guard (Header::spill_guard_until_ns), put_bytes, put_spill_behind
constexpr uint32_t kNone = 0xffffffffu;       // null record index
constexpr uint32_t kIndexEmpty = 0xffffffffu;  // index slot never used
constexpr uint32_t kIndexTomb = 0xfffffffeu;   // index slot whose entry left

struct Key {
  uint64_t lo;
  uint64_t hi;
  bool operator==(const Key& o) const { return lo == o.lo && hi == o.hi; }
};

enum EntryState : uint32_t {
  kEntryFree = 0,
  kEntryWriting = 1,  // reserved by owner_pid; invisible to readers
  kEntryReady = 2,    // visible; immutable payload
  kEntryDoomed = 3,   // erased while leased: invisible, freed at last release
};

// One chunk. 96 bytes.
struct Entry {
  Key key;                       // full 128-bit key, compared on every hit
  uint64_t offset;               // payload offset inside the arena
  uint64_t size;                 // payload bytes as asked
  uint64_t alloc_size;           // bytes taken from the arena (aligned)
  uint64_t last_use;             // Header::use_clock tick of last use (LRU rebuild)
  std::atomic<uint32_t> state;   // EntryState; the commit point of every change
  uint32_t generation;           // bumped each time the record is reused
  int32_t owner_pid;             // writer while WRITING (its own namespace's pid: messages)
  uint32_t pin_count;            // persistent pins (authoritative)
  uint32_t flags;                // kFlag* below (authoritative, single store)
  // derived:
  uint32_t refcount;             // live leases on this entry
  uint32_t lru_prev;             // LRU list of evictable entries (READY, unleased,
  uint32_t lru_next;             // unpinned); also free-record list via lru_next
  uint32_t tokens;               // prompt tokens the chunk holds, as its writer said (0: not given)
  uint32_t owner_holder;         // writer's ProcSlot::holder while WRITING (0: it had no slot)
  Key ns;                        // namespace digest given at reserve (tiers, clear)
};

// Entry::flags
constexpr uint32_t kFlagSpilled = 1;     // a copy is in the disk tier
constexpr uint32_t kFlagCompressed = 2;  // the payload is a chunk file (shmkv/disk/format.py), not raw KV;
                                         // given at reserve, never changed (the compressed_* gauges)

enum LeaseState : uint32_t { kLeaseFree = 0, kLeaseHeld = 1 };

// One read lease. 32 bytes.
struct Lease {
  std::atomic<uint32_t> state;   // LeaseState; commit point
  uint32_t generation;           // bumped on every grant, validates handles
  uint32_t entry;                // entry index
  uint32_t entry_generation;     // entry generation at grant time
  int32_t pid;                   // holder, in its own PID namespace (messages; the fallback below)
  uint32_t next_free;            // derived free list
  uint32_t holder;               // holder's ProcSlot::holder (0: it had no slot: judged by pid)
  uint32_t reserved;
};

// A process attached to the segment. Its liveness is the OFD lock its own
// open file description holds on the slot's byte of the segment file
// (Segment::hold_slot), which the kernel drops when the process dies, in
// whatever PID namespace the checker runs. Leases and writes name their
// holder by the slot's holder id, unique to this claim of the slot (pids of
// different PID namespaces collide: every container's first process is 1);
// pid and start time name it in messages.
struct ProcSlot {
  std::atomic<int32_t> pid;      // 0 = free slot; in the process's own PID namespace
  uint32_t pid_ns;               // inode of its PID namespace (/proc/self/ns/pid); 0 = unknown
  uint64_t start_time;           // /proc/<pid>/stat starttime: a recycled pid told apart (ownership: holder)
  uint64_t attached_unix_ns;
  uint32_t holder;               // this claim's id (Header::next_holder), never 0 while the slot is taken
  uint32_t reserved;
};

struct Extent {
  uint64_t offset;
  uint64_t length;
};

// Chosen by the creator; every field is part of the layout fingerprint.
struct Geometry {
  uint64_t capacity_bytes;       // whole segment (the file size)
  uint64_t arena_offset;
  uint64_t arena_bytes;          // the payload byte cap
  uint64_t max_payload_bytes;
  uint64_t alignment;            // payload offsets and sizes are multiples
  uint32_t max_entries;
  uint32_t index_slots;          // power of two >= 2 * max_entries
  uint32_t max_leases;
  uint32_t max_procs;
  uint64_t procs_offset;
  uint64_t entries_offset;
  uint64_t leases_offset;
  uint64_t index_offset;
  uint64_t extents_offset;
};

// Monotonic event counters and two gauges, readable without the lock.
struct Counters {
  std::atomic<uint64_t> lookups;          // keys asked for (acquire + lookup)
  std::atomic<uint64_t> hits;
  std::atomic<uint64_t> misses;
  std::atomic<uint64_t> puts;             // commits
  std::atomic<uint64_t> put_full;         // reserve answered FULL
  std::atomic<uint64_t> put_exists;       // reserve of a READY key
  std::atomic<uint64_t> put_busy;         // reserve of a key another pid writes
  std::atomic<uint64_t> put_too_large;
  std::atomic<uint64_t> evictions;
  std::atomic<uint64_t> evicted_bytes;
  std::atomic<uint64_t> writes_aborted;   // abort() calls
  std::atomic<uint64_t> writes_reclaimed; // WRITING entries of dead pids freed
  std::atomic<uint64_t> leases_reclaimed; // leases of dead pids released
  std::atomic<uint64_t> lease_table_full;
  std::atomic<uint64_t> entry_table_full; // had to evict for a record, not bytes
  std::atomic<uint64_t> stale_handles;    // commit/release of a reclaimed handle
  std::atomic<uint64_t> deletes;
  std::atomic<uint64_t> pins;
  std::atomic<uint64_t> lock_recoveries;  // EOWNERDEAD handled by a rebuild
  std::atomic<uint64_t> segment_resets;   // rebuild impossible: emptied
  std::atomic<uint64_t> index_rehashes;   // tombstone clean-ups
  std::atomic<uint64_t> procs_table_full;
  std::atomic<uint64_t> evicted_unspilled;  // evicted by a put before it reached disk
  // tier counters, bumped by the Python tiers through ChunkTable::bump()
  std::atomic<uint64_t> spills;             // chunks written to the disk tier
  std::atomic<uint64_t> spill_bytes;        // raw bytes spilled
  std::atomic<uint64_t> spill_errors;       // disk full / I/O error: not spilled
  std::atomic<uint64_t> disk_hits;          // chunks promoted from disk
  std::atomic<uint64_t> promote_bytes;
  std::atomic<uint64_t> disk_damaged;       // bad files found (miss + unlink)
  std::atomic<uint64_t> disk_removed;       // files removed by the disk byte cap
  std::atomic<uint64_t> promote_errors;
  std::atomic<uint64_t> remote_puts;        // chunks written to the remote tier
  std::atomic<uint64_t> remote_put_bytes;   // encoded bytes sent
  std::atomic<uint64_t> remote_put_errors;  // writes that failed (remote down, timeout)
  std::atomic<uint64_t> remote_dropped;     // writes dropped: queue full or chunk gone
  std::atomic<uint64_t> remote_hits;        // chunks promoted from the remote tier
  std::atomic<uint64_t> remote_get_bytes;   // encoded bytes fetched
  std::atomic<uint64_t> remote_misses;      // remote lookups that ended a prefix
  std::atomic<uint64_t> remote_errors;      // calls that failed or timed out (a miss)
  std::atomic<uint64_t> remote_damaged;     // values that failed the chunk checks
  std::atomic<uint64_t> lock_timeouts;      // the table lock was not free within the bound
  std::atomic<uint64_t> deferred_ops;       // commit/abort/release queued behind a held lock
  std::atomic<uint64_t> metadata_repairs;   // derived metadata out of range: rebuilt
  std::atomic<uint64_t> segment_truncated;  // the segment file was found shorter than its capacity
  // prompt tokens vLLM got from shmkv, by the tier their chunks were found in (the connector bumps them)
  std::atomic<uint64_t> hit_tokens;
  std::atomic<uint64_t> disk_hit_tokens;
  std::atomic<uint64_t> remote_hit_tokens;
  // prompt tokens written to each tier (shm: committed with a token count; disk: spilled; remote: written)
  std::atomic<uint64_t> put_tokens;
  std::atomic<uint64_t> spill_tokens;
  std::atomic<uint64_t> remote_put_tokens;
  std::atomic<uint64_t> put_unreserved;   // FULL only because the arena was still being reserved
  std::atomic<uint64_t> reserve_errors;   // background reservations that failed (/dev/shm full)
  std::atomic<uint64_t> liveness_unshared;  // forked processes left on their parent's description (no /proc)
  std::atomic<uint64_t> remote_foreign;     // remote values signed with another secret (left in place)
  std::atomic<uint64_t> remote_expired;     // remote values past the expiry their writer signed
  std::atomic<uint64_t> remote_stale;       // remote values signed before a clear (an older generation)
  std::atomic<uint64_t> put_bytes;          // payload bytes committed (the write rate the maintainer logs)
  std::atomic<uint64_t> put_spill_behind;   // puts refused while the spill guard kept unspilled chunks
  std::atomic<uint64_t> remote_healed;      // clear-generation records found erased or rolled back, written back
  // gauges (maintained under the lock, rebuilt on recovery)
  std::atomic<uint64_t> bytes_used;       // sum of alloc_size of non-FREE entries
  std::atomic<uint64_t> entries;          // non-FREE entries
  std::atomic<uint64_t> ready_entries;
  std::atomic<uint64_t> pinned_entries;
  std::atomic<uint64_t> compressed_entries;  // READY entries with kFlagCompressed
  std::atomic<uint64_t> compressed_bytes;    // their payload bytes
};

struct alignas(64) Header {
  std::atomic<uint64_t> magic;   // written last at initialisation
  uint32_t format_version;
  uint32_t header_bytes;
  uint64_t build_fingerprint;    // struct sizes/offsets of this build
  uint64_t layout_fingerprint;   // build fingerprint + geometry
  Geometry geo;
  int32_t creator_pid;
  uint32_t next_holder;          // the last holder id given to a process slot (under lock; skips 0)
  uint64_t created_unix_ns;
  std::atomic<uint64_t> epoch;   // bumped by every segment reset
  // Bytes from the arena's start whose pages are reserved in /dev/shm
  // (posix_fallocate): the allocator hands out nothing beyond, so no write
  // ever lands on a page that could SIGBUS. Only grows (creation reserves a
  // first part; Segment::reserve_more the rest, in the background).
  std::atomic<uint64_t> arena_reserved;
  alignas(64) pthread_mutex_t lock;
  // Who holds `lock` now (0: nobody), and since when: written by the holder
  // right after taking it and cleared before giving it back, so a process
  // that times out waiting can name the holder (stats, logs, the daemon).
  std::atomic<int32_t> lock_holder_pid;
  uint32_t reserved1;
  std::atomic<uint64_t> lock_since_ns;   // CLOCK_MONOTONIC (the same clock for every process)
  // The spill guard: while this CLOCK_MONOTONIC time is ahead, the maintainer's spills
  // reach the disk, so a put evicts only chunks already on disk (ChunkTable::do_evict_one_locked);
  // the maintainer renews it every pass. A failing disk or a stopped maintainer lets it lapse.
  std::atomic<uint64_t> spill_guard_until_ns;
  // --- derived roots (under lock) ---
  alignas(64) uint32_t lru_head;  // most recently used evictable entry
  uint32_t lru_tail;              // next victim
  uint32_t free_entry_head;
  uint32_t free_lease_head;
  uint64_t num_extents;
  uint64_t index_used;            // live + tombstone slots
  uint64_t use_clock;             // LRU tick (authoritative enough: monotone)
  uint64_t leases_held;
  uint64_t evictable_bytes;       // sum of alloc_size over the LRU list
  alignas(64) Counters counters;
};

static_assert(std::atomic<uint32_t>::is_always_lock_free, "need lock-free atomics");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need lock-free atomics");
static_assert(sizeof(Entry) == 104, "Entry layout changed: bump kFormatVersion");
static_assert(sizeof(Lease) == 32, "Lease layout changed: bump kFormatVersion");
static_assert(sizeof(ProcSlot) == 32, "ProcSlot layout changed: bump kFormatVersion");

// FNV-1a over the things that must be identical for two builds to share a
// segment. Computed at compile time from this header.
inline uint64_t fnv1a(uint64_t h, uint64_t v) {
  for (int i = 0; i < 8; ++i) {
    h ^= (v >> (8 * i)) & 0xff;
    h *= 0x100000001b3ULL;
  }
  return h;
}

inline uint64_t build_fingerprint() {
  uint64_t h = 0xcbf29ce484222325ULL;
  for (uint64_t v : {uint64_t(kFormatVersion), uint64_t(sizeof(Header)),
                     uint64_t(sizeof(Entry)), uint64_t(sizeof(Lease)),
                     uint64_t(sizeof(ProcSlot)), uint64_t(sizeof(Extent)),
                     uint64_t(sizeof(Counters)), uint64_t(sizeof(pthread_mutex_t)),
                     uint64_t(offsetof(Header, lock)), uint64_t(offsetof(Header, counters)),
                     uint64_t(offsetof(Entry, state)), uint64_t(offsetof(Lease, pid))}) {
    h = fnv1a(h, v);
  }
  return h;
}

inline uint64_t layout_fingerprint(const Geometry& g) {
  uint64_t h = build_fingerprint();
  for (uint64_t v : {g.capacity_bytes, g.arena_offset, g.arena_bytes, g.max_payload_bytes,
                     g.alignment, uint64_t(g.max_entries), uint64_t(g.index_slots),
                     uint64_t(g.max_leases), uint64_t(g.max_procs), g.procs_offset,
                     g.entries_offset, g.leases_offset, g.index_offset, g.extents_offset}) {
    h = fnv1a(h, v);
  }
  return h;
}

}  // namespace shmkv
