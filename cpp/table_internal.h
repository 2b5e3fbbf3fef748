// table_internal.h — what the parts of the chunk table share and nothing
// outside the table needs: time and alignment helpers, and the /proc side of
// process liveness (process_liveness.cpp; the slots' OFD locks are the
// authority, ChunkTable::slot_alive).
#pragma once

#include <sys/types.h>
#include <time.h>

#include <atomic>
#include <cstdint>

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

// Whether (pid, start time) names a live process (start time 0: pid alone), in
// this process's PID namespace: only for holders that have no process slot.
bool process_alive(pid_t pid, uint64_t start_time);

// The inode of this process's PID namespace (/proc/self/ns/pid); 0 when unreadable.
uint32_t own_pid_namespace();

}  // namespace shmkv
