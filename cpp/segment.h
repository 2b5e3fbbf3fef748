// segment.h — owning one mapping of a shmkv POSIX shared-memory segment.
//
// A Segment is the file /dev/shm/<name>, exactly geo.capacity_bytes long,
// mode 0600, owned by our uid. Its pages are reserved with posix_fallocate:
// the metadata and a first part of the arena at creation, the rest by
// reserve_more (in the background); Header::arena_reserved says how far, and
// the allocator hands out nothing beyond it.
// Liveness is tracked by the kernel, not by pids: every attached process holds
// a shared open-file-description lock on byte 1 of the file for as long as it
// has the segment open. Whoever can take that byte exclusively knows nobody
// else is attached (the segment is stale). Byte 0 is held exclusively while a
// process creates, re-initialises or validates, so attachers never see a
// half-written header.
//
// Invariants:
//   * the header's magic is stored last (release) when a segment is
//     initialised; an attacher refuses anything whose magic, format version,
//     build fingerprint or (when it asked for a geometry) layout differs, and
//     writes nothing to it in that case;
//   * a segment that has live processes is never re-initialised;
//   * the mapping lives until the last shared_ptr to the Segment goes, so
//     buffer views handed to Python can never dangle.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include "layout.h"
#include "status.h"

namespace shmkv {

struct SegmentConfig {
  uint64_t capacity_bytes = 0;        // the whole segment
  uint64_t max_payload_bytes = 0;     // 0: a quarter of the arena
  uint64_t alignment = 4096;          // power of two, >= 64
  uint32_t max_entries = 0;           // 0: derived from capacity
  uint32_t max_leases = 0;            // 0: derived from max_entries
  uint32_t max_procs = 256;
  // How long open() waits for another process initialising (or validating)
  // the segment: past it, kTimedOut naming the wait (a stopped process must
  // not stop every vLLM start behind it).
  uint64_t init_wait_ns = 120'000'000'000ull;
};

enum class OpenMode { kCreate, kAttach, kOpenOrCreate };

// How the open went, for logs and tests.
enum class OpenOutcome { kCreated, kAttached, kReinitialisedStale, kAdoptedStale };

class Segment {
 public:
  // Open `name` (a POSIX shm name without the leading '/').
  // kCreate: a fresh, empty segment; a stale one is re-initialised; a live one
  //   is kAlreadyExists. kAttach: an existing, initialised segment with this
  //   build's layout (config ignored). kOpenOrCreate: attach if a segment with
  //   the same geometry exists; adopt a stale one with the same geometry after
  //   a rebuild; otherwise create or re-initialise. `populate` maps the
  //   reserved pages now so the first copy into a chunk does not pay page faults.
  // `dir`: the segment directory (a tmpfs of this uid, mode 0700), or "" for POSIX shm (/dev/shm).
  static Status open(const std::string& name, const std::string& dir, OpenMode mode, const SegmentConfig& cfg,
                     bool populate, std::shared_ptr<Segment>* out, std::string* err);
  static Status unlink(const std::string& name, const std::string& dir, std::string* err);
  static Status compute_geometry(const SegmentConfig& cfg, Geometry* geo, std::string* err);
  static bool valid_name(const std::string& name);

  ~Segment();
  Segment(const Segment&) = delete;
  Segment& operator=(const Segment&) = delete;

  Header* header() const { return reinterpret_cast<Header*>(base_); }
  uint8_t* base() const { return base_; }
  uint8_t* arena() const { return base_ + geo_.arena_offset; }
  // This process's copy of the geometry, validated at open: the header's own
  // copy may be overwritten later by a buggy or hostile writer and is never
  // trusted again.
  const Geometry& geo() const { return geo_; }
  // The segment file's size now (fstat): smaller than capacity_bytes means
  // somebody truncated it and touching the pages past the end raises SIGBUS.
  // -1 if fstat fails.
  int64_t file_bytes() const;
  // Grow a truncated file back to capacity_bytes and reserve its pages again
  // (the bytes past the old end read as zero). kNoSpace if /dev/shm is full.
  Status restore_size(std::string* err);
  // Reserve up to `max_bytes` more of the arena's pages (posix_fallocate),
  // publish them to the allocator, then (with `map_pages`) map them into
  // this process. Any process may call it, concurrently: it only grows the
  // reserved part. kNoSpace (counted in reserve_errors) if /dev/shm is full.
  Status reserve_more(uint64_t max_bytes, bool map_pages, uint64_t* reserved_now, std::string* err);
  // Map the reserved pages of arena bytes [offset, offset + bytes) into this
  // process now (clipped to the reserved part); false if the kernel cannot
  // (no MADV_POPULATE_WRITE: first touch maps them).
  bool map_arena(uint64_t offset, uint64_t bytes);
  const std::string& name() const { return name_; }
  OpenOutcome outcome() const { return outcome_; }

  // Liveness of attached processes, in any PID namespace: each process holds a
  // shared OFD lock on its process slot's byte of the segment file through its
  // own open file description, which the kernel releases when it dies.
  bool hold_slot(uint32_t slot);
  void release_slot(uint32_t slot);
  // 1: another open file description holds `slot`'s byte (its process lives);
  // 0: none does; -1: the kernel did not answer (the caller must presume life).
  int slot_held(uint32_t slot) const;
  // After a fork: give this process an open file description of its own (the
  // inherited one, and the locks on it, stay the parent's), holding the alive
  // byte. False (the shared one kept) when /proc/self/fd cannot be reopened.
  bool renew_description();
  // An exclusive role among every process of every PID namespace that shares
  // this segment (the cache maintainer): an OFD write lock on one byte, held
  // until released or until this description closes. Never waits.
  bool try_hold_role(uint32_t role);
  void release_role(uint32_t role);
  // Whether another description holds `role` (a failed query: true).
  bool role_held_elsewhere(uint32_t role) const;
  // True when the header was adopted from a stale segment: the table must be
  // rebuilt from its authoritative records before use.
  bool needs_rebuild() const { return outcome_ == OpenOutcome::kAdoptedStale; }

 private:
  Segment() = default;
  std::string name_;
  std::string where_;  // the directory it lives in, for messages (/dev/shm for POSIX shm)
  int fd_ = -1;
  uint8_t* base_ = nullptr;
  uint64_t mapped_bytes_ = 0;
  Geometry geo_{};
  OpenOutcome outcome_ = OpenOutcome::kAttached;

  friend struct SegmentOpener;
};

// Human-readable byte counts for messages ("32.0 GiB").
std::string format_bytes(uint64_t n);

}  // namespace shmkv
