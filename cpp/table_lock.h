// table_lock.h — the chunk table's lock (TableLock: the only place the
// table mutex is acquired, with its bounded wait, dead-owner recovery and
// deferred operations) and the two wrappers every locked operation uses:
// guarded() (derived metadata found corrupt: rebuild, then reset, then give
// up) and with_ready_entry() (lock, find a READY entry, act on it). Included
// by the .cpp files of the table's front (chunk_table.cpp, table_admin.cpp).
#pragma once

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <string>

#include "chunk_table.h"
#include "counters.h"
#include "table_internal.h"

namespace shmkv {

inline uint64_t now_mono_ns() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return uint64_t(ts.tv_sec) * 1000000000ull + uint64_t(ts.tv_nsec);
}

// Whether a thread id (the owner a glibc robust mutex records in its first
// word) names a live thread on this host.
inline bool tid_alive(int32_t tid) {
  if (tid <= 0) return false;
  char path[64];
  std::snprintf(path, sizeof path, "/proc/%d", int(tid));
  return access(path, F_OK) == 0;
}

// Takes the table mutex, waiting at most the table's bound; on EOWNERDEAD
// rebuilds the table before the caller proceeds. ok() is false when the wait
// timed out (counted; the caller answers its ordinary fallback). A mutex whose
// bytes are not a mutex any more throws SegmentBroken.
// NOTE: this is the only place the mutex is acquired.
class TableLock {
 public:
  explicit TableLock(ChunkTable& t) : t_(t) {
    Header* hd = t.h();
    pthread_mutex_t* m = &hd->lock;
    int rc = pthread_mutex_trylock(m);
    if (rc == EBUSY) {
      int32_t pid = hd->lock_holder_pid.load(std::memory_order_acquire);
      uint64_t since = hd->lock_since_ns.load(std::memory_order_relaxed);
      if (pid != 0 && pid == t.stuck_pid_.load(std::memory_order_relaxed) &&
          since == t.stuck_since_.load(std::memory_order_relaxed)) {
        timed_out();  // the holder we already waited for has not let go
        return;
      }
      timespec deadline;
      clock_gettime(CLOCK_MONOTONIC, &deadline);
      uint64_t ns = uint64_t(deadline.tv_nsec) + t.lock_timeout_ns_;
      deadline.tv_sec += time_t(ns / 1000000000ull);
      deadline.tv_nsec = long(ns % 1000000000ull);
      rc = pthread_mutex_clocklock(m, CLOCK_MONOTONIC, &deadline);
    }
    if (rc == ETIMEDOUT) {
      int32_t pid = hd->lock_holder_pid.load(std::memory_order_acquire);
      // A robust mutex's first word is its owner's thread id (plus flag bits).
      int32_t owner_tid = int32_t(*reinterpret_cast<volatile uint32_t*>(m) & 0x3fffffffu);
      // NOTE: thread ids and pids are those of the holder's PID namespace: judged only
      // where every attached process shares ours (another container's holder is alive)
      if (!tid_alive(owner_tid) && !t.holder_alive(pid) && !t.mixed_namespaces()) {
        // Nobody alive owns it, and a dead owner would have made it EOWNERDEAD:
        // its bytes were overwritten.
        throw SegmentBroken("the segment's table lock is unusable (held by thread " +
                            std::to_string(owner_tid) + ", which does not exist): the segment was "
                            "overwritten; unlink it and start again");
      }
      t.stuck_pid_.store(pid, std::memory_order_relaxed);
      t.stuck_since_.store(hd->lock_since_ns.load(std::memory_order_relaxed), std::memory_order_relaxed);
      timed_out();
      return;
    }
    if (rc == EOWNERDEAD) {
      held_ = true;
      mark_held();
      t.c().lock_recoveries.fetch_add(1, std::memory_order_relaxed);
      try {
        t.do_rebuild_locked("a process died holding the table lock");
      } catch (const DerivedCorrupt& e) {
        t.do_reset_locked(std::string("rebuild after a dead lock holder failed: ") + e.what());
      }
      pthread_mutex_consistent(m);
    } else if (rc != 0) {
      // ENOTRECOVERABLE cannot happen with this code (we always mark the mutex
      // consistent); anything else means the mutex bytes were overwritten.
      throw SegmentBroken(std::string("the segment's table lock is unusable (pthread_mutex_lock: ") +
                          std::strerror(rc) + "): the segment was overwritten; unlink it and start again");
    } else {
      held_ = true;
      mark_held();
    }
    t.stuck_pid_.store(0, std::memory_order_relaxed);
    t.guarded([&] {
      t.do_register_self_locked();
      if (t.has_deferred_.load(std::memory_order_relaxed)) t.do_run_deferred_locked();
      return 0;
    });
  }
  ~TableLock() {
    if (!held_) return;
    t_.h()->lock_holder_pid.store(0, std::memory_order_release);
    pthread_mutex_unlock(&t_.h()->lock);
  }
  bool ok() const { return held_; }
  // For whole-table operations: no fallback answer, so a timeout is an error.
  void require(const char* what) const {
    if (held_) return;
    LockHolder who = t_.lock_holder();
    throw LockTimeout(std::string(what) + ": the table lock of segment '" + t_.segment()->name() +
                      "' is held by pid " + std::to_string(who.pid) + " for " +
                      std::to_string(who.held_ns / 1000000) + " ms (over the " +
                      std::to_string(t_.lock_timeout_ns_ / 1000000) + " ms bound); is that process stopped?" +
                      (t_.mixed_namespaces() ? " (processes of another PID namespace share this segment: the "
                                               "pid may be one of theirs, e.g. another container's)"
                                             : ""));
  }

 private:
  void mark_held() {
    Header* hd = t_.h();
    hd->lock_since_ns.store(now_mono_ns(), std::memory_order_relaxed);
    hd->lock_holder_pid.store(t_.self_pid(), std::memory_order_release);
  }
  void timed_out() { t_.c().lock_timeouts.fetch_add(1, std::memory_order_relaxed); }

  ChunkTable& t_;
  bool held_ = false;
};

template <class F>
auto ChunkTable::guarded(F&& f) -> decltype(f()) {
  for (int attempt = 0;; ++attempt) {
    try {
      return f();
    } catch (const DerivedCorrupt& e) {
      c().metadata_repairs.fetch_add(1, std::memory_order_relaxed);
      std::string why = std::string("derived metadata out of range (") + e.what() + ")";
      if (attempt >= 2) throw SegmentBroken("segment '" + seg_->name() + "': " + why + " even after a reset");
      try {
        if (attempt == 0) do_rebuild_locked(why.c_str());
        else do_reset_locked(why);
      } catch (const DerivedCorrupt& e2) {
        do_reset_locked(why + "; rebuild failed: " + e2.what());
      }
    }
  }
}


// The prologue of every operation on one READY entry: the lock (kTimedOut when
// the wait times out), the key (kMiss unless READY), then fn(entry index)
// under guarded().
template <class F>
Status ChunkTable::with_ready_entry(const Key& key, F&& fn) {
  TableLock lock(*this);
  if (!lock.ok()) return Status::kTimedOut;
  return guarded([&] {
    uint32_t e = do_find_ready_locked(key);
    return e == kNone ? Status::kMiss : fn(e);
  });
}

}  // namespace shmkv
