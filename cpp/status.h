// status.h — the closed vocabulary of results returned by the shmkv C++ core.
//
// Every public function of the core returns a Status. "Miss", "full", "exists"
// and "busy" are ordinary outcomes of a cache, not failures: callers branch on
// them. Only the codes from kInvalidArgument on describe something wrong with
// the call, the segment or the system, and the Python layer maps exactly those
// to its exception hierarchy (shmkv/errors.py, by name). This file is the one
// list: bindings.cpp exports it as shmkv._C.Status, and shmkv.store checks at
// import that every error code has its exception class.
#pragma once

#include <cstdint>

namespace shmkv {

enum class Status : int32_t {
  // --- ordinary outcomes -----------------------------------------------------
  kOk = 0,
  kMiss = 1,         // key not present (or not READY yet)
  kFull = 2,         // no room even after evicting everything evictable
  kExists = 3,       // reserve: key is already READY
  kBusy = 4,         // reserve: another live process is writing the key;
                     // erase: entry is leased (it is hidden, freed on release)
  kStale = 5,        // handle refers to an entry/lease that was reclaimed or reset
  kTimedOut = 6,     // the table lock stayed held by another process past the bound
  // --- errors ------------------------------------------------------------------
  kInvalidArgument = 16,  // bad size, bad name, bad handle shape, ...
  kTooLarge = 17,         // payload larger than the configured maximum
  kNoSpace = 18,          // /dev/shm cannot hold the requested segment
  kNotFound = 19,         // no segment of that name
  kAlreadyExists = 20,    // create(): a live segment of that name exists
  kMismatch = 21,         // segment built/configured differently; not attached
  kPermission = 22,       // segment owned by someone else / not accessible
  kCorrupt = 23,          // segment damaged beyond recovery
  kSystem = 24,           // an OS call failed (errno in the message)
};

// Every code, for the bindings (export) and the tests.
inline constexpr Status kAllStatuses[] = {
    Status::kOk,       Status::kMiss,          Status::kFull,      Status::kExists,   Status::kBusy,
    Status::kStale,    Status::kTimedOut,      Status::kInvalidArgument, Status::kTooLarge,
    Status::kNoSpace,  Status::kNotFound,      Status::kAlreadyExists, Status::kMismatch,
    Status::kPermission, Status::kCorrupt,     Status::kSystem,
};

inline const char* status_name(Status s) {
  switch (s) {
    case Status::kOk: return "OK";
    case Status::kMiss: return "MISS";
    case Status::kFull: return "FULL";
    case Status::kExists: return "EXISTS";
    case Status::kBusy: return "BUSY";
    case Status::kStale: return "STALE";
    case Status::kTimedOut: return "TIMED_OUT";
    case Status::kInvalidArgument: return "INVALID_ARGUMENT";
    case Status::kTooLarge: return "TOO_LARGE";
    case Status::kNoSpace: return "NO_SPACE";
    case Status::kNotFound: return "NOT_FOUND";
    case Status::kAlreadyExists: return "ALREADY_EXISTS";
    case Status::kMismatch: return "MISMATCH";
    case Status::kPermission: return "PERMISSION";
    case Status::kCorrupt: return "CORRUPT";
    case Status::kSystem: return "SYSTEM";
  }
  return "UNKNOWN";
}

inline bool is_error(Status s) { return static_cast<int32_t>(s) >= 16; }

}  // namespace shmkv
