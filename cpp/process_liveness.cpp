// process_liveness.cpp — is the process that holds a lease, a write or the
// table lock still alive, wherever the asking process runs? Every attached
// process holds a shared OFD lock on its slot's byte of the segment file
// (Segment::hold_slot) through a description of its own; the kernel drops it
// when the process dies, in any PID namespace, so a slot is alive while its
// byte is held. A lease or a write names its holder by the holder id of the
// slot it held (ProcSlot::holder, new for each claim of a slot): it lives while
// a slot carries that id and is held. Pids are only for what has no slot (the
// process table was full) and for the table lock's holder: such a holder lives
// while any slot of its pid does; doubt means alive, and a pid with no slot is
// judged by /proc only where every attached process shares our namespace.
#include "chunk_table.h"
#include "table_internal.h"

#include <cstring>

#include <signal.h>
#include <sys/stat.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>

namespace shmkv {

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

uint32_t own_pid_namespace() {
  struct stat st;
  if (stat("/proc/self/ns/pid", &st) != 0) return 0;
  return uint32_t(st.st_ino);
}

bool ChunkTable::slot_alive(uint32_t i) {
  const ProcSlot& s = procs()[i];
  if (s.pid.load(std::memory_order_acquire) == 0) return false;
  if (i == my_slot_ && registered_pid_ == self_pid()) return true;  // this process (its own lock is not seen)
  if (seg_->slot_held(i) != 0) return true;  // -1: the kernel did not say: alive
  if (!description_shared_) return false;
  // Our description is our parent's: a lock it holds through it reads "not held" here.
  // Doubt means alive: judged by the pid where it is in our namespace, else alive.
  if (s.pid_ns != my_pid_ns_ || my_pid_ns_ == 0) return true;
  return process_alive(s.pid.load(std::memory_order_relaxed), s.start_time);
}

bool ChunkTable::mixed_namespaces() {
  self_pid();
  if (my_pid_ns_ == 0) return true;  // ours unknown: nobody else's pid can be judged
  const ProcSlot* p = procs();
  for (uint32_t i = 0; i < geo().max_procs; ++i)
    if (p[i].pid.load(std::memory_order_relaxed) != 0 && p[i].pid_ns != my_pid_ns_) return true;
  return false;
}

uint32_t ChunkTable::self_holder() const {
  return my_slot_ == kNone ? 0 : procs()[my_slot_].holder;
}

bool ChunkTable::holder_alive(pid_t pid, uint32_t holder) {
  const ProcSlot* p = procs();
  if (holder != 0) {
    for (uint32_t i = 0; i < geo().max_procs; ++i)
      if (p[i].pid.load(std::memory_order_relaxed) != 0 && p[i].holder == holder) return slot_alive(i);
    return false;  // no slot carries it any more: released when its process exited
  }
  if (pid <= 0) return false;
  bool found = false;
  for (uint32_t i = 0; i < geo().max_procs; ++i) {
    if (p[i].pid.load(std::memory_order_relaxed) != pid) continue;
    found = true;
    if (slot_alive(i)) return true;
  }
  if (found) return false;  // every slot of that pid is released: its process exited
  // no slot (the process table was full when it attached): /proc says, where it can
  return mixed_namespaces() || process_alive(pid, 0);
}

}  // namespace shmkv
