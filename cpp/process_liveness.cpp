// process_liveness.cpp — is the process that holds a lease, a write or the
// table lock still alive? /proc/<pid>/stat's start time makes (pid, start)
// a name no later process can reuse.
#include "chunk_table.h"
#include "table_internal.h"

#include <cstring>

#include <signal.h>

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

}  // namespace shmkv
