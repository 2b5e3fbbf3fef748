// table_parts_test.cpp — C++-level tests of the chunk table's parts (index,
// extent allocator, LRU, leases, recovery, process liveness) through
// ChunkTable's API on a real segment, checking the derived structures with
// check_consistency() after each. Built and run by
// tests/store/test_cpp_table_parts.py (plain c++, no framework): exit 0 when
// every check holds; each failed check prints its line.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "../chunk_table.h"
#include "../segment.h"
#include "../table_internal.h"

using namespace shmkv;

static int g_failures = 0;
#define CHECK(cond)                                                        \
  do {                                                                     \
    if (!(cond)) {                                                         \
      std::fprintf(stderr, "%s:%d: CHECK(%s) failed\n", __FILE__, __LINE__, #cond); \
      ++g_failures;                                                        \
    }                                                                      \
  } while (0)

static Key key(uint64_t i) { return Key{i * 0x9E3779B97F4A7C15ull + 1, ~i}; }

struct Fixture {
  std::string name;
  std::shared_ptr<ChunkTable> t;
  explicit Fixture(const char* tag, uint64_t capacity = 1 << 20, uint32_t max_entries = 0) {
    name = std::string("shmkv-cpptest-") + tag + "-" + std::to_string(getpid());
    SegmentConfig cfg;
    cfg.capacity_bytes = capacity;
    cfg.alignment = 4096;
    cfg.max_entries = max_entries;
    std::shared_ptr<Segment> seg;
    std::string err;
    Status s = Segment::open(name, "", OpenMode::kCreate, cfg, false, &seg, &err);
    if (s != Status::kOk) {
      std::fprintf(stderr, "cannot create segment %s: %s\n", name.c_str(), err.c_str());
      std::exit(2);
    }
    t = std::make_shared<ChunkTable>(seg);
  }
  ~Fixture() {
    t.reset();
    std::string err;
    Segment::unlink(name, "", &err);
  }
  bool put(uint64_t i, uint64_t size, Reservation* out = nullptr) {
    Reservation r;
    if (t->reserve(key(i), size, &r) != Status::kOk) return false;
    std::memset(t->payload(r.offset), int(i & 0xff), size);
    if (out) *out = r;
    return t->commit(r) == Status::kOk;
  }
  bool has(uint64_t i) {
    Key k = key(i);
    uint8_t out = 0;
    t->contains(&k, 1, &out);
    return out == 1;  // READY (2: a live writer holds it)
  }
  bool consistent() {
    auto bad = t->check_consistency();
    for (auto& b : bad) std::fprintf(stderr, "  inconsistent: %s\n", b.c_str());
    return bad.empty();
  }
};

// Allocator: freed neighbours coalesce, so a chunk as large as two freed
// neighbours fits exactly where they were.
static void test_allocator_coalesces_freed_neighbours() {
  Fixture f("alloc");
  Reservation a, b, c;
  CHECK(f.put(1, 4096, &a) && f.put(2, 4096, &b) && f.put(3, 4096, &c));
  CHECK(b.offset == a.offset + 4096 && c.offset == b.offset + 4096);
  CHECK(f.t->erase(key(2)) == Status::kOk);
  CHECK(f.t->erase(key(1)) == Status::kOk);
  Reservation d;
  CHECK(f.put(4, 8192, &d));
  CHECK(d.offset == a.offset);
  CHECK(f.has(3) && f.has(4) && !f.has(1) && !f.has(2));
  CHECK(f.consistent());
}

// Index: many inserts and erases (tombstones) keep every lookup exact.
static void test_index_survives_churn() {
  Fixture f("index", 4 << 20, 64);
  for (uint64_t round = 0; round < 20; ++round) {
    for (uint64_t i = 0; i < 40; ++i) CHECK(f.put(round * 100 + i, 64));
    for (uint64_t i = 0; i < 40; i += 2) CHECK(f.t->erase(key(round * 100 + i)) == Status::kOk);
    for (uint64_t i = 0; i < 40; ++i) CHECK(f.has(round * 100 + i) == (i % 2 == 1));
    f.t->clear();
  }
  CHECK(f.consistent());
}

// LRU: a put into a full arena evicts the least recently used chunk; a read
// makes a chunk recent; a leased chunk is never evicted.
static void test_lru_evicts_the_coldest_unleased() {
  Fixture g("lru");
  uint64_t arena_chunks = g.t->stats()["arena_bytes"] / 4096;
  CHECK(arena_chunks >= 4);
  for (uint64_t i = 0; i < arena_chunks; ++i) CHECK(g.put(i, 4096));
  CHECK(g.t->stats()["evictions"] == 0);
  LeaseHandle l0, l1;
  CHECK(g.t->acquire(key(0), &l0) == Status::kOk);  // leased: not evictable
  CHECK(g.t->acquire(key(1), &l1) == Status::kOk);
  CHECK(g.t->release(l1) == Status::kOk);  // released: now the most recent
  CHECK(g.put(1000, 4096));
  CHECK(g.t->stats()["evictions"] == 1);
  CHECK(g.has(0) && g.has(1) && !g.has(2));  // key 2 was the coldest evictable
  CHECK(g.t->release(l0) == Status::kOk);
  CHECK(g.consistent());
}

// Leases: an erased leased chunk is hidden at once and freed at release; a
// handle released twice is STALE.
static void test_leases_hide_erased_and_catch_stale_handles() {
  Fixture f("lease");
  CHECK(f.put(7, 4096));
  LeaseHandle l;
  CHECK(f.t->acquire(key(7), &l) == Status::kOk);
  CHECK(f.t->erase(key(7)) == Status::kBusy);
  CHECK(!f.has(7));
  CHECK(f.t->stats()["entries"] == 1);
  CHECK(f.t->release(l) == Status::kOk);
  CHECK(f.t->stats()["entries"] == 0);
  CHECK(f.t->release(l) == Status::kStale);
  CHECK(f.consistent());
}

// Recovery: derived state damaged in place is rebuilt from the records; every
// READY chunk is still found with its bytes.
static void test_rebuild_restores_derived_state_from_records() {
  Fixture f("recover");
  for (uint64_t i = 0; i < 10; ++i) CHECK(f.put(i, 4096));
  Header* hd = f.t->segment()->header();
  hd->lru_head = 12345;  // derived: the rebuild must not trust it
  hd->num_extents = 0;
  f.t->rebuild();
  CHECK(f.consistent());
  for (uint64_t i = 0; i < 10; ++i) {
    LeaseHandle l;
    CHECK(f.t->acquire(key(i), &l) == Status::kOk);
    CHECK(f.t->payload(l.offset)[4095] == uint8_t(i & 0xff));
    CHECK(f.t->release(l) == Status::kOk);
  }
}

// Process liveness: (pid, start time) names one process; a dead child and a
// wrong start time are not alive.
static void test_process_liveness() {
  pid_t me = getpid();
  uint64_t start = proc_start_time(me);
  CHECK(start != 0);
  CHECK(process_alive(me, start));
  CHECK(!process_alive(me, start + 1));
  pid_t child = fork();
  if (child == 0) _exit(0);
  int st = 0;
  waitpid(child, &st, 0);
  CHECK(!process_alive(child, 0));
}

int main() {
  test_allocator_coalesces_freed_neighbours();
  test_index_survives_churn();
  test_lru_evicts_the_coldest_unleased();
  test_leases_hide_erased_and_catch_stale_handles();
  test_rebuild_restores_derived_state_from_records();
  test_process_liveness();
  std::printf("%s: %d failed checks\n", g_failures ? "FAILED" : "ok", g_failures);
  return g_failures ? 1 : 0;
}
