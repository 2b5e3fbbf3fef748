// segment.cpp — create / attach / re-initialise / unlink a shmkv segment.
// See segment.h for the liveness protocol (open-file-description locks on
// bytes 0 and 1 of the segment file) and the invariants kept here.
#include "segment.h"
#include "segment_files.h"
#include "value_limits.h"
#include "table_internal.h"  // align_up, now_unix_ns

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sstream>

namespace shmkv {
namespace {

using segment_files::errno_text;
using segment_files::foreign_owner_text;
using segment_files::free_bytes_of;
using segment_files::kAliveByte;
using segment_files::kInitByte;
using segment_files::ofd_lock;
using segment_files::ofd_lock_within;
using segment_files::open_place;
using segment_files::SegmentPlace;

// Arena bytes a new segment reserves before it is handed out; the rest is
// reserved by Segment::reserve_more, in the background (shmkv.store).
constexpr uint64_t kFirstReserve = 256ull << 20;
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23  // Linux 5.14; older kernels answer EINVAL
#endif


void init_mutex(pthread_mutex_t* m) {
  pthread_mutexattr_t a;
  pthread_mutexattr_init(&a);
  pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
  pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
  pthread_mutex_init(m, &a);
  pthread_mutexattr_destroy(&a);
}

// Map the (reserved) pages of [addr, addr + bytes) into this process now, so
// first copies pay no page faults. False on a kernel without MADV_POPULATE_WRITE.
bool prefault(uint8_t* addr, uint64_t bytes) {
  return bytes == 0 || madvise(addr, bytes, MADV_POPULATE_WRITE) == 0 || errno != EINVAL;
}

// Lay out a fresh segment whose metadata and first `reserved` arena bytes
// are reserved. The metadata region must already be zero.
void initialise(uint8_t* base, const Geometry& g, uint64_t reserved) {
  auto* h = reinterpret_cast<Header*>(base);
  h->arena_reserved.store(reserved);
  h->format_version = kFormatVersion;
  h->header_bytes = sizeof(Header);
  h->build_fingerprint = build_fingerprint();
  h->layout_fingerprint = layout_fingerprint(g);
  h->geo = g;
  h->creator_pid = getpid();
  h->created_unix_ns = now_unix_ns();
  h->epoch.store(0);
  init_mutex(&h->lock);

  auto* entries = reinterpret_cast<Entry*>(base + g.entries_offset);
  for (uint32_t i = 0; i < g.max_entries; ++i) {
    entries[i].lru_prev = kNone;
    entries[i].lru_next = (i + 1 < g.max_entries) ? i + 1 : kNone;
  }
  auto* leases = reinterpret_cast<Lease*>(base + g.leases_offset);
  for (uint32_t i = 0; i < g.max_leases; ++i) {
    leases[i].next_free = (i + 1 < g.max_leases) ? i + 1 : kNone;
  }
  std::memset(base + g.index_offset, 0xff, uint64_t(g.index_slots) * sizeof(uint32_t));
  auto* extents = reinterpret_cast<Extent*>(base + g.extents_offset);
  extents[0] = Extent{0, g.arena_bytes};
  h->num_extents = 1;
  h->lru_head = h->lru_tail = kNone;
  h->free_entry_head = 0;
  h->free_lease_head = 0;
  h->index_used = 0;
  h->use_clock = 1;
  h->leases_held = 0;
  h->magic.store(kMagic, std::memory_order_release);
}

// Field-by-field description of how two geometries differ.
std::string describe_geometry_diff(const Geometry& have, const Geometry& want) {
  std::ostringstream os;
  auto field = [&](const char* name, uint64_t a, uint64_t b) {
    if (a != b) os << "\n  " << name << ": segment has " << a << ", this process asked for " << b;
  };
  field("capacity_bytes", have.capacity_bytes, want.capacity_bytes);
  field("max_payload_bytes", have.max_payload_bytes, want.max_payload_bytes);
  field("alignment", have.alignment, want.alignment);
  field("max_entries", have.max_entries, want.max_entries);
  field("max_leases", have.max_leases, want.max_leases);
  field("max_procs", have.max_procs, want.max_procs);
  field("arena_bytes", have.arena_bytes, want.arena_bytes);
  return os.str();
}

}  // namespace

std::string format_bytes(uint64_t n) {
  char buf[64];
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  double v = double(n);
  int u = 0;
  while (v >= 1024.0 && u < 4) {
    v /= 1024.0;
    ++u;
  }
  if (u == 0) std::snprintf(buf, sizeof buf, "%llu B", static_cast<unsigned long long>(n));
  else std::snprintf(buf, sizeof buf, "%.1f %s", v, units[u]);
  return buf;
}

bool Segment::valid_name(const std::string& name) {
  if (name.empty() || name.size() > kCacheNameMax || name[0] == '.') return false;
  for (char c : name) {
    bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
              c == '-' || c == '_' || c == '.';
    if (!ok) return false;
  }
  return true;
}

Status Segment::compute_geometry(const SegmentConfig& cfg, Geometry* geo, std::string* err) {
  Geometry g;
  std::memset(&g, 0, sizeof g);
  if (cfg.alignment < 64 || (cfg.alignment & (cfg.alignment - 1)) != 0) {
    *err = "alignment must be a power of two >= 64, got " + std::to_string(cfg.alignment);
    return Status::kInvalidArgument;
  }
  if (cfg.capacity_bytes < (1ull << 20)) {
    *err = "capacity_bytes must be at least 1 MiB, got " + std::to_string(cfg.capacity_bytes);
    return Status::kInvalidArgument;
  }
  if (cfg.max_procs < 1 || cfg.max_procs > 65536) {
    *err = "max_procs must be in [1, 65536], got " + std::to_string(cfg.max_procs);
    return Status::kInvalidArgument;
  }
  g.capacity_bytes = cfg.capacity_bytes;
  g.alignment = cfg.alignment;
  uint64_t entries = cfg.max_entries;
  if (entries == 0) {
    entries = cfg.capacity_bytes / (32 * 1024);
    if (entries < 1024) entries = 1024;
    if (entries > (1u << 21)) entries = 1u << 21;
  }
  if (entries < 1 || entries > (1u << 26)) {
    *err = "max_entries must be in [1, 2^26], got " + std::to_string(entries);
    return Status::kInvalidArgument;
  }
  uint64_t leases = cfg.max_leases;
  if (leases == 0) {
    leases = entries * 2;
    if (leases < 4096) leases = 4096;
    if (leases > (1u << 22)) leases = 1u << 22;
  }
  if (leases < 1 || leases > (1u << 26)) {
    *err = "max_leases must be in [1, 2^26], got " + std::to_string(leases);
    return Status::kInvalidArgument;
  }
  uint64_t slots = 16;
  while (slots < 2 * entries) slots <<= 1;
  g.max_entries = uint32_t(entries);
  g.max_leases = uint32_t(leases);
  g.max_procs = cfg.max_procs;
  g.index_slots = uint32_t(slots);
  uint64_t off = align_up(sizeof(Header), 64);
  g.procs_offset = off;
  off = align_up(off + uint64_t(g.max_procs) * sizeof(ProcSlot), 64);
  g.entries_offset = off;
  off = align_up(off + entries * sizeof(Entry), 64);
  g.leases_offset = off;
  off = align_up(off + leases * sizeof(Lease), 64);
  g.index_offset = off;
  off = align_up(off + slots * sizeof(uint32_t), 64);
  g.extents_offset = off;
  off += (entries + 1) * sizeof(Extent);
  uint64_t page_align = cfg.alignment > 4096 ? cfg.alignment : 4096;
  g.arena_offset = align_up(off, page_align);
  if (g.arena_offset + cfg.alignment > cfg.capacity_bytes) {
    *err = "capacity_bytes " + std::to_string(cfg.capacity_bytes) +
           " leaves no payload space after " + std::to_string(g.arena_offset) +
           " bytes of metadata (max_entries " + std::to_string(entries) + ")";
    return Status::kInvalidArgument;
  }
  g.arena_bytes = (cfg.capacity_bytes - g.arena_offset) / cfg.alignment * cfg.alignment;
  g.max_payload_bytes = cfg.max_payload_bytes ? cfg.max_payload_bytes : g.arena_bytes / 4;
  if (g.max_payload_bytes > g.arena_bytes) {
    *err = "max_payload_bytes " + std::to_string(g.max_payload_bytes) +
           " exceeds the payload arena (" + std::to_string(g.arena_bytes) +
           " bytes left of capacity_bytes " + std::to_string(cfg.capacity_bytes) +
           " after metadata)";
    return Status::kInvalidArgument;
  }
  *geo = g;
  return Status::kOk;
}

// All the steps of Segment::open that need the fd and the locks.
struct SegmentOpener {
  std::string name;
  const SegmentPlace& place;
  OpenMode mode;
  const SegmentConfig& cfg;
  bool populate;
  std::string* err;
  int fd = -1;
  uint8_t* base = nullptr;
  uint64_t mapped = 0;

  ~SegmentOpener() {
    if (base) munmap(base, mapped);
    if (fd >= 0) close(fd);
  }

  // Never MAP_POPULATE the whole file: pages past the reserved part would be
  // allocated by this process, synchronously (see prefault_reserved).
  Status map(uint64_t bytes) {
    if (base) munmap(base, mapped);
    base = nullptr;
    void* p = mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      *err = errno_text(("mmap of segment '" + name + "'").c_str(), errno);
      return Status::kSystem;
    }
    base = static_cast<uint8_t*>(p);
    mapped = bytes;
    return Status::kOk;
  }

  // Size, reserve and lay out a segment nobody else is attached to.
  Status initialise_fresh(const Geometry& g) {
    if (base) munmap(base, mapped);
    base = nullptr;
    // Drop whatever a previous incarnation left, then reserve the metadata and
    // a first part of the arena now; the allocator hands out nothing beyond
    // Header::arena_reserved, so no write can SIGBUS, and the rest is reserved
    // in the background (Segment::reserve_more). A /dev/shm too small for the
    // whole capacity fails here.
    if (ftruncate(fd, 0) != 0 || ftruncate(fd, off_t(g.capacity_bytes)) != 0) {
      *err = errno_text(("ftruncate of segment '" + name + "'").c_str(), errno);
      return Status::kSystem;
    }
    uint64_t first = std::min(g.arena_bytes, kFirstReserve);
    int rc = free_bytes_of(fd) < g.capacity_bytes ? ENOSPC : posix_fallocate(fd, 0, off_t(g.arena_offset + first));
    if (rc != 0) {
      uint64_t free_now = free_bytes_of(fd);
      ftruncate(fd, 0);
      *err = "cannot reserve " + format_bytes(g.capacity_bytes) + " (" +
             std::to_string(g.capacity_bytes) + " bytes) for shared-memory segment '" + name +
             "': " + place.where() + " has " + format_bytes(free_now) + " free (posix_fallocate: " +
             std::strerror(rc) + "); lower the capacity or enlarge " + place.where();
      return rc == ENOSPC ? Status::kNoSpace : Status::kSystem;
    }
    Status s = map(g.capacity_bytes);
    if (s != Status::kOk) return s;
    // ftruncate(0) dropped the old pages, so metadata is zero here.
    initialise(base, g, first);
    madvise(base + g.arena_offset, g.capacity_bytes - g.arena_offset, MADV_DONTDUMP);
    return Status::kOk;
  }

  // With `populate`: map the metadata and the reserved part of the arena now.
  void prefault_reserved() {
    if (!populate || !base) return;
    const auto* h = reinterpret_cast<const Header*>(base);
    uint64_t reserved = std::min(h->arena_reserved.load(std::memory_order_acquire), h->geo.arena_bytes);
    uint64_t bytes = std::min(mapped, h->geo.arena_offset + reserved);
    if (prefault(base, bytes)) return;
    // An older kernel: read one byte of every page (it maps them; a first write is then a minor
    // fault). Never a MAP_FIXED remap: a failed one would leave the range unmapped.
    long page = sysconf(_SC_PAGESIZE);
    volatile uint8_t sink = 0;
    for (uint64_t off = 0; off < bytes; off += uint64_t(page > 0 ? page : 4096)) sink ^= base[off];
    (void)sink;
  }

  // Check an existing segment's header. `want` (may be null) is the geometry
  // the caller needs. Writes nothing.
  Status validate(const Geometry* want) {
    struct stat st;
    if (fstat(fd, &st) != 0) {
      *err = errno_text("fstat", errno);
      return Status::kSystem;
    }
    if (uint64_t(st.st_size) < sizeof(Header)) {
      *err = "segment '" + name + "' is " + std::to_string(st.st_size) +
             " bytes, smaller than a shmkv header: not initialised (its creator died?) or not a "
             "shmkv segment";
      return Status::kCorrupt;
    }
    Status s = map(uint64_t(st.st_size));
    if (s != Status::kOk) return s;
    auto* h = reinterpret_cast<Header*>(base);
    uint64_t magic = h->magic.load(std::memory_order_acquire);
    if (magic != kMagic) {
      *err = "segment '" + name + "' has no shmkv magic (found 0x" + [&] {
        char b[32];
        std::snprintf(b, sizeof b, "%016llx", static_cast<unsigned long long>(magic));
        return std::string(b);
      }() + "): not a shmkv segment, or its creator died before finishing";
      return Status::kMismatch;
    }
    if (h->format_version != kFormatVersion) {
      *err = "segment '" + name + "' has format version " + std::to_string(h->format_version) +
             ", this build of shmkv uses " + std::to_string(kFormatVersion);
      return Status::kMismatch;
    }
    if (h->build_fingerprint != build_fingerprint() || h->header_bytes != sizeof(Header)) {
      *err = "segment '" + name +
             "' was made by a shmkv build with a different memory layout (struct sizes or "
             "offsets differ: header " + std::to_string(h->header_bytes) + " vs " +
             std::to_string(sizeof(Header)) + " bytes); rebuild both sides from the same version";
      return Status::kMismatch;
    }
    const Geometry& g = h->geo;
    if (h->layout_fingerprint != layout_fingerprint(g)) {
      *err = "segment '" + name + "' header is damaged: its geometry does not match its layout "
             "fingerprint (capacity " + std::to_string(g.capacity_bytes) + " bytes, " +
             std::to_string(g.max_entries) + " entries); unlink it (python -m shmkv.stats shows "
             "who is attached) and start again";
      return Status::kCorrupt;
    }
    if (g.capacity_bytes != uint64_t(st.st_size)) {
      *err = "segment '" + name + "' file is " + std::to_string(st.st_size) +
             " bytes but its header says " + std::to_string(g.capacity_bytes) +
             (uint64_t(st.st_size) < g.capacity_bytes
                  ? ": it was truncated (by a process of this user); the maintainer restores the "
                    "size, or unlink it and start again"
                  : ": it was extended by something other than shmkv");
      return Status::kCorrupt;
    }
    if (want && std::memcmp(&g, want, sizeof(Geometry)) != 0) {
      *err = "segment '" + name + "' exists with a different configuration:" +
             describe_geometry_diff(g, *want);
      return Status::kMismatch;
    }
    return Status::kOk;
  }

  Status run(std::shared_ptr<Segment>* out) {
    Geometry want;
    bool have_want = false;
    if (mode != OpenMode::kAttach) {
      Status s = Segment::compute_geometry(cfg, &want, err);
      if (s != Status::kOk) return s;
      have_want = true;
    }
    OpenOutcome outcome = OpenOutcome::kAttached;
    for (int attempt = 0;; ++attempt) {
      bool created = false;
      if (mode != OpenMode::kAttach) {
        fd = place.open_file(name, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
        if (fd >= 0) {
          created = true;
          fchmod(fd, 0600);  // whatever the umask did
        } else if (errno != EEXIST) {
          int e = errno;
          *err = errno_text(("creating segment " + place.display(name)).c_str(), e);
          return e == EACCES ? Status::kPermission : Status::kSystem;
        }
      }
      if (!created) {
        fd = place.open_file(name, O_RDWR | O_CLOEXEC, 0);
        if (fd < 0) {
          int e = errno;
          if (e == ENOENT && mode != OpenMode::kAttach && attempt < 8) continue;  // raced unlink
          if (e == ENOENT) {
            *err = "no shmkv segment named '" + name + "' (" + place.display(name) + ")";
            return Status::kNotFound;
          }
          struct stat st;
          if (e == EACCES && place.stat_file(name, &st) && st.st_uid != geteuid()) {
            *err = foreign_owner_text("segment " + place.display(name), st);
            return Status::kPermission;
          }
          *err = errno_text(("cannot open shared-memory segment " + place.display(name)).c_str(), e);
          return (e == EACCES || e == ELOOP) ? Status::kPermission : Status::kSystem;
        }
        struct stat st;
        if (fstat(fd, &st) == 0 && (!S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 0077) != 0)) {
          char mode_s[16];
          std::snprintf(mode_s, sizeof mode_s, "%04o", unsigned(st.st_mode & 07777));
          *err = "segment " + place.display(name) + " is owned by uid " + std::to_string(st.st_uid) +
                 " with mode " + mode_s + "; shmkv only uses segments owned by its own uid (" +
                 std::to_string(geteuid()) + ") with mode 0600";
          return Status::kPermission;
        }
      }
      if (!ofd_lock_within(fd, kInitByte, F_WRLCK, cfg.init_wait_ns)) {
        if (errno == ETIMEDOUT) {
          char waited[32];
          std::snprintf(waited, sizeof waited, "%.1f", double(cfg.init_wait_ns) / 1e9);
          *err = "another process has been initialising segment " + place.display(name) + " for over " + waited +
                 " s (still creating a large segment, or stopped while doing so: `fuser -v " + place.display(name) +
                 "` names it); try again, or stop it";
          return Status::kTimedOut;
        }
        *err = errno_text("locking the segment's init byte", errno);
        return Status::kSystem;
      }
      bool alone = ofd_lock(fd, kAliveByte, F_WRLCK, false);
      Status s = Status::kOk;
      if (alone) {
        if (created) {
          s = initialise_fresh(want);
          outcome = OpenOutcome::kCreated;
        } else if (mode == OpenMode::kCreate) {
          s = initialise_fresh(want);
          outcome = OpenOutcome::kReinitialisedStale;
        } else {
          std::string why;
          std::string* saved = err;
          err = &why;
          Status v = validate(have_want ? &want : nullptr);
          err = saved;
          if (v == Status::kOk) {
            outcome = OpenOutcome::kAdoptedStale;
            // Nobody is attached (we hold the alive byte alone, under the init
            // lock), so nobody can hold the table mutex: a fresh one replaces
            // whatever its bytes say (a dead holder, or garbage that would
            // make pthread_mutex_lock fail or wait forever).
            init_mutex(&reinterpret_cast<Header*>(base)->lock);
            reinterpret_cast<Header*>(base)->lock_holder_pid.store(0);
          } else if (mode == OpenMode::kOpenOrCreate) {
            s = initialise_fresh(want);
            outcome = OpenOutcome::kReinitialisedStale;
          } else {
            *err = why;
            s = v;
          }
        }
        if (s == Status::kOk && !ofd_lock(fd, kAliveByte, F_RDLCK, false)) {
          *err = errno_text("downgrading the segment's alive lock", errno);
          s = Status::kSystem;
        }
      } else {
        if (mode == OpenMode::kCreate) {
          *err = "segment '" + name + "' already exists and is attached by live processes; "
                 "attach to it, or stop them (and unlink it) first";
          s = Status::kAlreadyExists;
        } else if (!ofd_lock(fd, kAliveByte, F_RDLCK, true)) {
          *err = errno_text("taking the segment's alive lock", errno);
          s = Status::kSystem;
        } else {
          s = validate(have_want ? &want : nullptr);
          outcome = OpenOutcome::kAttached;
        }
      }
      if (s != Status::kOk) {
        if (created) place.unlink_file(name);
        return s;  // destructor closes fd: our locks go with it
      }
      ofd_lock(fd, kInitByte, F_UNLCK, false);
      prefault_reserved();  // after the init lock: attachers waiting need not wait for this
      auto seg = std::shared_ptr<Segment>(new Segment());
      seg->name_ = name;
      seg->where_ = place.where();
      seg->fd_ = fd;
      seg->base_ = base;
      seg->mapped_bytes_ = mapped;
      seg->geo_ = reinterpret_cast<Header*>(base)->geo;  // validated or just written
      seg->outcome_ = outcome;
      fd = -1;
      base = nullptr;
      *out = std::move(seg);
      return Status::kOk;
    }
  }
};

Status Segment::open(const std::string& name, const std::string& dir, OpenMode mode, const SegmentConfig& cfg,
                     bool populate, std::shared_ptr<Segment>* out, std::string* err) {
  if (!valid_name(name)) {
    *err = "invalid cache name '" + name + "': use 1-" + std::to_string(kCacheNameMax) +
           " characters from [A-Za-z0-9._-], not starting with '.'";
    return Status::kInvalidArgument;
  }
  SegmentPlace place;
  Status ps = open_place(dir, &place, err);
  if (ps != Status::kOk) return ps;
  SegmentOpener op{name, place, mode, cfg, populate, err};
  return op.run(out);
}

Status Segment::unlink(const std::string& name, const std::string& dir, std::string* err) {
  if (!valid_name(name)) {
    *err = "invalid cache name '" + name + "'";
    return Status::kInvalidArgument;
  }
  SegmentPlace place;
  Status ps = open_place(dir, &place, err);
  if (ps != Status::kOk) return ps;
  if (place.unlink_file(name) != 0) {
    int e = errno;
    if (e == ENOENT) {
      *err = "no shmkv segment named '" + name + "'";
      return Status::kNotFound;
    }
    *err = errno_text(("unlinking " + place.display(name)).c_str(), e);
    return e == EACCES ? Status::kPermission : Status::kSystem;
  }
  return Status::kOk;
}

int64_t Segment::file_bytes() const {
  struct stat st;
  if (fstat(fd_, &st) != 0) return -1;
  return int64_t(st.st_size);
}

Status Segment::restore_size(std::string* err) {
  if (ftruncate(fd_, off_t(geo_.capacity_bytes)) != 0) {
    *err = errno_text(("ftruncate of segment '" + name_ + "'").c_str(), errno);
    return Status::kSystem;
  }
  uint64_t reserved = std::min(header()->arena_reserved.load(std::memory_order_acquire), geo_.arena_bytes);
  int rc = posix_fallocate(fd_, 0, off_t(geo_.arena_offset + reserved));
  if (rc != 0) {
    *err = "cannot reserve the pages of segment '" + name_ + "' again (posix_fallocate: " +
           std::strerror(rc) + ")";
    return rc == ENOSPC ? Status::kNoSpace : Status::kSystem;
  }
  return Status::kOk;
}

bool Segment::map_arena(uint64_t offset, uint64_t bytes) {
  uint64_t reserved = std::min(header()->arena_reserved.load(std::memory_order_acquire), geo_.arena_bytes);
  if (offset >= reserved) return true;
  return prefault(arena() + offset, std::min(bytes, reserved - offset));
}

Status Segment::reserve_more(uint64_t max_bytes, bool map_pages, uint64_t* reserved_now, std::string* err) {
  std::atomic<uint64_t>& reserved = header()->arena_reserved;
  uint64_t from = std::min(reserved.load(std::memory_order_acquire), geo_.arena_bytes);
  *reserved_now = from;
  if (from >= geo_.arena_bytes || max_bytes == 0) return Status::kOk;
  uint64_t len = std::min(max_bytes, geo_.arena_bytes - from);
  int rc = posix_fallocate(fd_, off_t(geo_.arena_offset + from), off_t(len));
  if (rc != 0) {
    header()->counters.reserve_errors.fetch_add(1, std::memory_order_relaxed);
    *err = "cannot reserve " + format_bytes(len) + " more of segment '" + name_ + "' (" + format_bytes(from) +
           " of its " + format_bytes(geo_.arena_bytes) + " arena reserved; " + where_ + " has " +
           format_bytes(free_bytes_of(fd_)) + " free; posix_fallocate: " + std::strerror(rc) +
           "): the cache works with the part reserved";
    return rc == ENOSPC ? Status::kNoSpace : Status::kSystem;
  }
  // Publish, then map: another process may already have gone further (both reserved the same pages).
  uint64_t to = from + len, cur = reserved.load(std::memory_order_relaxed);
  while (cur < to && !reserved.compare_exchange_weak(cur, to, std::memory_order_release)) {
  }
  *reserved_now = std::max(cur, to);
  if (map_pages) prefault(arena() + from, len);  // without MADV_POPULATE_WRITE: first touch maps them
  return Status::kOk;
}

Segment::~Segment() {
  if (base_) munmap(base_, mapped_bytes_);
  if (fd_ >= 0) close(fd_);  // releases the alive lock
}

}  // namespace shmkv
