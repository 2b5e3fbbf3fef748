// segment_locks.cpp — the Segment's lock bytes (segment.h): a slot's byte
// held by its process, exclusive roles (the maintainer, the daemon), and a
// fresh open file description after a fork (so the child's locks are its own).
#include "segment.h"
#include "segment_files.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>

namespace shmkv {

using segment_files::kAliveByte;
using segment_files::kRoleByteBase;
using segment_files::kSlotByteBase;
using segment_files::ofd_held_elsewhere;
using segment_files::ofd_lock;

bool Segment::hold_slot(uint32_t slot) { return ofd_lock(fd_, kSlotByteBase + off_t(slot), F_RDLCK, false); }

void Segment::release_slot(uint32_t slot) { ofd_lock(fd_, kSlotByteBase + off_t(slot), F_UNLCK, false); }


int Segment::slot_held(uint32_t slot) const { return ofd_held_elsewhere(fd_, kSlotByteBase + off_t(slot)); }

bool Segment::role_held_elsewhere(uint32_t role) const {
  return ofd_held_elsewhere(fd_, kRoleByteBase + off_t(role)) != 0;
}

bool Segment::renew_description() {
  char path[64];
  std::snprintf(path, sizeof path, "/proc/self/fd/%d", fd_);
  // NOTE: a magic link to this very file (checked below by inode): a new description of it
  int fd = ::open(path, O_RDWR | O_CLOEXEC);
  if (fd < 0) return false;
  struct stat a, b;
  if (fstat(fd, &a) != 0 || fstat(fd_, &b) != 0 || a.st_ino != b.st_ino || a.st_dev != b.st_dev ||
      !ofd_lock(fd, kAliveByte, F_RDLCK, false)) {
    close(fd);
    return false;
  }
  // NOTE: the same fd number, atomically: another thread's fstat or fallocate on fd_ meets
  // one description of the file or the other, never a closed or reused number. The old
  // description stays open in the parent, and its locks with it.
  bool ok = dup3(fd, fd_, O_CLOEXEC) == fd_;
  close(fd);
  return ok;
}

bool Segment::try_hold_role(uint32_t role) { return ofd_lock(fd_, kRoleByteBase + off_t(role), F_WRLCK, false); }

void Segment::release_role(uint32_t role) { ofd_lock(fd_, kRoleByteBase + off_t(role), F_UNLCK, false); }

}  // namespace shmkv
