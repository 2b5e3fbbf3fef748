// The bounds of the values a caller hands the core: the one definition of
// each, exported to Python as _C.LIMITS, from which shmkv's settings table
// (shmkv/config.py) and every Python-side check take theirs. The core still
// checks what reaches it (a caller may bypass the settings), against these.
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmkv {

// A cache (segment) name: 1..kCacheNameMax characters of [A-Za-z0-9._-], not starting with '.'.
constexpr size_t kCacheNameMax = 200;

// The bound of any wait for the table lock, in seconds: [min, max].
constexpr double kLockTimeoutMinS = 0.001;
constexpr double kLockTimeoutMaxS = 60.0;

// Tokens per chunk: [min, max] (the key of a chunk covers this many tokens).
constexpr int64_t kChunkSizeMin = 16;
constexpr int64_t kChunkSizeMax = 1 << 16;

}  // namespace shmkv
