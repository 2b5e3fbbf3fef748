// table_allocator.cpp — payload bytes: a first-fit free-extent list over the
// arena, sorted by offset and coalesced on free, so the bytes in use never
// exceed the cap. Derived state: rebuilt from the entries' extents on
// recovery. Every *_locked function expects the table lock.
#include "chunk_table.h"
#include "table_internal.h"

#include <algorithm>
#include <cstring>

namespace shmkv {

// ------------------------------------------------------------ allocator ----
// Free extents sorted by offset, always merged with their neighbours. There
// are at most (live allocations + 1) of them, so the array never overflows.

bool ChunkTable::do_alloc_locked(uint64_t need, uint64_t* offset) {
  const Geometry& g = geo();
  Extent* ex = extents();
  uint64_t n = h()->num_extents;
  // nothing beyond the reserved part of the arena (its pages may not exist yet)
  uint64_t limit = std::min(h()->arena_reserved.load(std::memory_order_acquire), g.arena_bytes);
  check(n <= uint64_t(g.max_entries) + 1, "more free extents than the extent table holds");
  for (uint64_t i = 0; i < n; ++i) {
    check(ex[i].offset <= g.arena_bytes && ex[i].length <= g.arena_bytes - ex[i].offset &&
              ex[i].offset % g.alignment == 0,
          "a free extent lies outside the arena");
    if (ex[i].offset >= limit) break;  // sorted by offset: the rest lie beyond too
    if (std::min(ex[i].length, limit - ex[i].offset) < need) continue;
    *offset = ex[i].offset;
    ex[i].offset += need;
    ex[i].length -= need;
    if (ex[i].length == 0) {
      std::memmove(&ex[i], &ex[i + 1], (n - i - 1) * sizeof(Extent));
      h()->num_extents = n - 1;
    }
    return true;
  }
  return false;
}

void ChunkTable::do_free_extent_locked(uint64_t off, uint64_t len) {
  const Geometry& g = geo();
  Extent* ex = extents();
  uint64_t n = h()->num_extents;
  check(n <= g.max_entries, "more free extents than live allocations allow");
  check(off <= g.arena_bytes && len <= g.arena_bytes - off, "a freed extent lies outside the arena");
  // first extent starting after `off`
  uint64_t lo = 0, hi = n;
  while (lo < hi) {
    uint64_t mid = (lo + hi) / 2;
    if (ex[mid].offset < off) lo = mid + 1;
    else hi = mid;
  }
  uint64_t i = lo;
  check(i == 0 || ex[i - 1].offset + ex[i - 1].length <= off, "a freed extent overlaps a free one");
  check(i == n || off + len <= ex[i].offset, "a freed extent overlaps a free one");
  bool merge_prev = i > 0 && ex[i - 1].offset + ex[i - 1].length == off;
  bool merge_next = i < n && off + len == ex[i].offset;
  if (merge_prev && merge_next) {
    ex[i - 1].length += len + ex[i].length;
    std::memmove(&ex[i], &ex[i + 1], (n - i - 1) * sizeof(Extent));
    h()->num_extents = n - 1;
  } else if (merge_prev) {
    ex[i - 1].length += len;
  } else if (merge_next) {
    ex[i].offset = off;
    ex[i].length += len;
  } else {
    std::memmove(&ex[i + 1], &ex[i], (n - i) * sizeof(Extent));
    ex[i] = Extent{off, len};
    h()->num_extents = n + 1;
  }
}

}  // namespace shmkv
