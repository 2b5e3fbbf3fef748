// table_internal.h — what the parts of the chunk table share and nothing
// outside the table needs: time and alignment helpers, and process liveness
// (a pid together with its start time names one process, so a recycled pid
// is never mistaken for a dead lease holder). Implemented in
// process_liveness.cpp.
#pragma once

#include <sys/types.h>
#include <time.h>

#include <atomic>
#include <cstdint>
#include <unordered_map>

#include "layout.h"

namespace shmkv {

inline uint64_t align_up(uint64_t v, uint64_t a) { return (v + a - 1) / a * a; }

inline uint64_t now_unix_ns() {
  timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Field 22 of /proc/<pid>/stat (start time in clock ticks since boot); 0 when
// unreadable. Together with the pid it names one process, so a recycled pid is
// not mistaken for the process that leased a chunk.
uint64_t proc_start_time(pid_t pid);

// Whether (pid, start time) names a live process (start time 0: pid alone).
bool process_alive(pid_t pid, uint64_t start_time);

// Liveness answers cached for the duration of one scan.
struct LivenessCache {
  std::unordered_map<pid_t, bool> known;
  const ProcSlot* procs;
  uint32_t nprocs;
  bool alive(pid_t pid) {
    auto it = known.find(pid);
    if (it != known.end()) return it->second;
    uint64_t start = 0;
    for (uint32_t i = 0; i < nprocs; ++i) {
      if (procs[i].pid.load(std::memory_order_relaxed) == pid) {
        start = procs[i].start_time;
        break;
      }
    }
    bool a = process_alive(pid, start);
    known.emplace(pid, a);
    return a;
  }
};

}  // namespace shmkv
