// segment_files.cpp — the segment file's byte locks and where segments live
// (segment_files.h): the operating system's side of a segment, apart from its
// layout and its opening protocol (segment.cpp).
#include "segment_files.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>

namespace shmkv {
namespace segment_files {

std::string errno_text(const char* what, int e) {
  return std::string(what) + ": " + std::strerror(e);
}

// Open-file-description byte locks: released by the kernel when the last fd of
// the description closes, i.e. when the process dies.
bool ofd_lock(int fd, off_t byte, short type, bool wait) {
  struct flock fl;
  std::memset(&fl, 0, sizeof fl);
  fl.l_type = type;
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  for (;;) {
    if (fcntl(fd, wait ? F_OFD_SETLKW : F_OFD_SETLK, &fl) == 0) return true;
    if (errno == EINTR) continue;
    return false;
  }
}

// ofd_lock(..., wait=true) bounded by `wait_ns`: false with errno ETIMEDOUT past it.
bool ofd_lock_within(int fd, off_t byte, short type, uint64_t wait_ns) {
  auto deadline = std::chrono::steady_clock::now() + std::chrono::nanoseconds(wait_ns);
  useconds_t pause = 1000;
  for (;;) {
    if (ofd_lock(fd, byte, type, false)) return true;
    if (errno != EAGAIN && errno != EACCES) return false;
    if (std::chrono::steady_clock::now() >= deadline) {
      errno = ETIMEDOUT;
      return false;
    }
    usleep(pause);  // NOTE: a lock held for seconds (a creator populating GiBs): poll, backing off
    pause = pause < 50000 ? pause * 2 : pause;
  }
}

SegmentPlace::~SegmentPlace() {
  if (dirfd >= 0) close(dirfd);
}

int SegmentPlace::open_file(const std::string& name, int flags, mode_t mode) const {
  return dir.empty() ? shm_open(("/" + name).c_str(), flags, mode)
                     : openat(dirfd, name.c_str(), flags | O_NOFOLLOW, mode);
}

int SegmentPlace::unlink_file(const std::string& name) const {
  return dir.empty() ? shm_unlink(("/" + name).c_str()) : unlinkat(dirfd, name.c_str(), 0);
}

bool SegmentPlace::stat_file(const std::string& name, struct stat* st) const {
  return dir.empty() ? lstat(display(name).c_str(), st) == 0
                     : fstatat(dirfd, name.c_str(), st, AT_SYMLINK_NOFOLLOW) == 0;
}

// The one line for a segment (or segment directory) another uid owns: who owns
// it, who we are, and that every process sharing a cache runs as one uid.
std::string foreign_owner_text(const std::string& what, const struct stat& st) {
  char mode_s[16];
  std::snprintf(mode_s, sizeof mode_s, "%04o", unsigned(st.st_mode & 07777));
  std::string owner = std::to_string(st.st_uid), me = std::to_string(geteuid());
  return what + " is owned by uid " + owner + " with mode " + mode_s + " and this process runs as uid " + me +
         ": every process sharing a cache, in every container, runs as the uid that owns it (docker run --user " +
         owner + ", Kubernetes runAsUser: " + owner + ")";
}

constexpr long kTmpfsMagic = 0x01021994;
constexpr long kHugetlbfsMagic = 0x958458f6;

Status open_place(const std::string& dir, SegmentPlace* p, std::string* err) {
  p->dir = dir;
  if (p->dir.empty()) return Status::kOk;
  if (p->dir[0] != '/') {
    *err = "segment_dir=" + p->dir + " is not an absolute path";
    return Status::kInvalidArgument;
  }
  p->dirfd = ::open(p->dir.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
  if (p->dirfd < 0) {
    int e = errno;
    struct stat st;
    if (e == EACCES && lstat(p->dir.c_str(), &st) == 0 && st.st_uid != geteuid()) {
      *err = foreign_owner_text("segment_dir=" + p->dir, st);
      return Status::kPermission;
    }
    *err = errno_text(("segment_dir=" + p->dir + " (a directory of this uid, mode 0700, on a tmpfs)").c_str(), e);
    return e == EACCES ? Status::kPermission : (e == ENOENT ? Status::kNotFound : Status::kSystem);
  }
  struct stat st;
  struct statfs fs;
  if (fstat(p->dirfd, &st) != 0 || fstatfs(p->dirfd, &fs) != 0) {
    *err = errno_text(("segment_dir=" + p->dir).c_str(), errno);
    return Status::kSystem;
  }
  if (st.st_uid != geteuid() || (st.st_mode & 0077) != 0) {
    char mode_s[16];
    std::snprintf(mode_s, sizeof mode_s, "%04o", unsigned(st.st_mode & 07777));
    *err = "segment_dir=" + p->dir + " is owned by uid " + std::to_string(st.st_uid) + " with mode " + mode_s +
           "; shmkv keeps segments only in a directory of its own uid (" + std::to_string(geteuid()) +
           ") with mode 0700 (chown it, chmod 700 it)";
    return Status::kPermission;
  }
  if (long(fs.f_type) != kTmpfsMagic && long(fs.f_type) != kHugetlbfsMagic) {
    *err = "segment_dir=" + p->dir + " is not on a memory filesystem (tmpfs): a segment there would be "
           "written back to disk; mount a tmpfs there (Kubernetes: an emptyDir with medium Memory, or a hostPath "
           "of a host tmpfs)";
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

// The free space of the filesystem the segment file `fd` lives on.
uint64_t free_bytes_of(int fd) {
  struct statvfs st;
  if (fstatvfs(fd, &st) != 0) return 0;
  return uint64_t(st.f_bavail) * uint64_t(st.f_frsize);
}

int ofd_held_elsewhere(int fd, off_t byte) {
  struct flock fl;
  std::memset(&fl, 0, sizeof fl);
  fl.l_type = F_WRLCK;  // conflicts with any lock another description holds there
  fl.l_whence = SEEK_SET;
  fl.l_start = byte;
  fl.l_len = 1;
  if (fcntl(fd, F_OFD_GETLK, &fl) != 0) return -1;
  return fl.l_type == F_UNLCK ? 0 : 1;
}

}  // namespace segment_files
}  // namespace shmkv
