// segment_files.h — internal to the segment (segment*.cpp): the segment file's
// byte locks (open-file-description locks, released by the kernel when the last
// fd of the description closes: when the process dies), where segments live
// (POSIX shm or a directory the caller names), and the lock bytes' layout.
#pragma once

#include <sys/stat.h>
#include <sys/types.h>

#include <cstdint>
#include <string>

#include "status.h"

namespace shmkv {
namespace segment_files {

constexpr off_t kInitByte = 0;   // exclusive while (re)initialising or validating
constexpr off_t kAliveByte = 1;  // shared by every attached process
constexpr off_t kRoleByteBase = 16;             // + role: exclusive roles (the maintainer)
constexpr off_t kSlotByteBase = off_t(1) << 20;  // + slot: held (shared) by the slot's process

std::string errno_text(const char* what, int e);
// Take (or, type F_UNLCK, release) the lock on `byte`; `wait`: block until it is free.
bool ofd_lock(int fd, off_t byte, short type, bool wait);
// ofd_lock(..., wait=true) bounded by `wait_ns`: false with errno ETIMEDOUT past it.
bool ofd_lock_within(int fd, off_t byte, short type, uint64_t wait_ns);
// 1: another description holds a lock on `byte`; 0: none; -1: no answer.
int ofd_held_elsewhere(int fd, off_t byte);

// Where segments live: POSIX shared memory (/dev/shm), or the directory
// the caller names (the segment_dir setting): a tmpfs of its own that a
// container mounts alone (a hostPath), instead of the host's whole /dev/shm or
// IPC namespace. The directory must be this uid's, mode 0700, on a memory
// filesystem (open_place checks).
struct SegmentPlace {
  std::string dir;  // "" = POSIX shm
  int dirfd = -1;
  SegmentPlace() = default;
  SegmentPlace(const SegmentPlace&) = delete;
  SegmentPlace& operator=(const SegmentPlace&) = delete;
  ~SegmentPlace();
  std::string where() const { return dir.empty() ? std::string("/dev/shm") : dir; }
  std::string display(const std::string& name) const { return where() + "/" + name; }
  int open_file(const std::string& name, int flags, mode_t mode) const;
  int unlink_file(const std::string& name) const;
  // The segment's owner and mode, without following a link; false if it cannot be read.
  bool stat_file(const std::string& name, struct stat* st) const;
};

Status open_place(const std::string& dir, SegmentPlace* p, std::string* err);
// The one line for a segment (or segment directory) another uid owns.
std::string foreign_owner_text(const std::string& what, const struct stat& st);
// The free space of the filesystem the segment file `fd` lives on.
uint64_t free_bytes_of(int fd);

}  // namespace segment_files
}  // namespace shmkv
