// bindings.cpp — the pybind11 module shmkv._C: a thin, typed surface over the
// C++ core. This file holds the module, its constants, enums and the
// segment-level functions; the chunk table's classes are in
// table_bindings.cpp, the copy kernels in kernel_bindings.cpp.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "chunk_table.h"
#include "counters.h"
#include "value_limits.h"
#include "segment.h"
#include "status.h"

namespace py = pybind11;
using namespace shmkv;

void register_table(py::module_& m);    // table_bindings.cpp
void register_kernels(py::module_& m);  // kernel_bindings.cpp

PYBIND11_MODULE(_C, m) {
  m.doc() = "shmkv C++ core: shared-memory chunk table and paged-KV copy kernels";
#ifdef SHMKV_VERSION
  m.attr("__version__") = SHMKV_VERSION;
#endif
  m.attr("FORMAT_VERSION") = kFormatVersion;
  {
    // the bounds of what callers hand the core (value_limits.h): shmkv/config.py's settings take theirs from here
    py::dict limits;
    limits["cache_name_max"] = kCacheNameMax;
    limits["lock_timeout_s"] = py::make_tuple(kLockTimeoutMinS, kLockTimeoutMaxS);
    limits["lock_timeout_default_s"] = double(ChunkTable::kDefaultLockTimeoutNs) / 1e9;
    limits["chunk_size"] = py::make_tuple(kChunkSizeMin, kChunkSizeMax);
    m.attr("LIMITS") = limits;
  }
  // The core's exceptions are the Python hierarchy's (shmkv/errors.py).
  // (RuntimeError where the module is loaded on its own, without the package.)
  py::object broken_base = py::reinterpret_borrow<py::object>(PyExc_RuntimeError), timeout_base = broken_base;
  try {
    py::module_ errors = py::module_::import("shmkv.errors");
    broken_base = errors.attr("SegmentCorruptError");
    timeout_base = errors.attr("LockTimeoutError");
  } catch (py::error_already_set&) {
  }
  py::register_exception<SegmentBroken>(m, "SegmentBrokenError", broken_base);
  py::register_exception<LockTimeout>(m, "LockTimeoutError", timeout_base);
  m.attr("FLAG_SPILLED") = kFlagSpilled;
  m.attr("FLAG_COMPRESSED") = kFlagCompressed;
  {
    // Byte offsets of header fields, for tests that damage a segment on purpose.
    py::dict off;
    off["lock"] = offsetof(Header, lock);
    off["lock_holder_pid"] = offsetof(Header, lock_holder_pid);
    off["lru_head"] = offsetof(Header, lru_head);
    off["lru_tail"] = offsetof(Header, lru_tail);
    off["free_entry_head"] = offsetof(Header, free_entry_head);
    off["free_lease_head"] = offsetof(Header, free_lease_head);
    off["num_extents"] = offsetof(Header, num_extents);
    off["evictable_bytes"] = offsetof(Header, evictable_bytes);
    off["geo_max_entries"] = offsetof(Header, geo) + offsetof(Geometry, max_entries);
    off["header_bytes"] = sizeof(Header);
    off["entry_bytes"] = sizeof(Entry);
    off["entry_offset"] = offsetof(Entry, offset);
    m.attr("LAYOUT_OFFSETS") = off;
  }

  {
    // cpp/status.h, the one list of result codes; the methods below return them as ints.
    py::enum_<Status> status(m, "Status", py::arithmetic(), "Result codes of the core (cpp/status.h)");
    py::list errors;
    for (Status s : kAllStatuses) {
      status.value(status_name(s), s);
      if (is_error(s)) errors.append(int(s));
    }
    m.attr("ERROR_CODES") = py::frozenset(errors);
  }
  {
    // cpp/counters.h, the one list of statistics: (name, help, kind, tier, bumpable, family).
    py::list counters;
    for (const CounterInfo& c : kCounters)
      counters.append(py::make_tuple(c.name, c.help, c.kind, c.tier, c.bumpable, c.family ? c.family : c.name));
    m.attr("COUNTERS") = py::tuple(counters);
    py::dict families;
    for (const FamilyInfo& f : kFamilies) families[f.name] = f.help;
    m.attr("METRIC_FAMILIES") = families;
  }

  m.def("unlink", [](const std::string& name, const std::string& segment_dir) -> py::tuple {
    std::string err;
    Status s = Segment::unlink(name, segment_dir, &err);
    return py::make_tuple(int(s), err);
  }, py::arg("name"), py::arg("segment_dir"), "Remove the segment `name` of `segment_dir` (\"\": POSIX shm).");
  m.def("valid_cache_name", &Segment::valid_name, py::arg("name"),
        "Whether `name` is a cache (segment) name the core accepts: LIMITS['cache_name_max'] characters at most "
        "of [A-Za-z0-9._-], not starting with '.'.");
  m.def("geometry", [](uint64_t capacity, uint64_t max_payload, uint64_t alignment,
                       uint32_t max_entries, uint32_t max_leases, uint32_t max_procs) -> py::tuple {
    SegmentConfig cfg{capacity, max_payload, alignment, max_entries, max_leases, max_procs};
    Geometry g;
    std::string err;
    Status s = Segment::compute_geometry(cfg, &g, &err);
    py::dict d;
    if (s != Status::kOk) return py::make_tuple(int(s), std::string(err), d);
    d["capacity_bytes"] = g.capacity_bytes;
    d["arena_bytes"] = g.arena_bytes;
    d["arena_offset"] = g.arena_offset;
    d["max_payload_bytes"] = g.max_payload_bytes;
    d["max_entries"] = g.max_entries;
    d["max_leases"] = g.max_leases;
    d["index_slots"] = g.index_slots;
    return py::make_tuple(0, std::string(), d);
  });

  register_table(m);
  register_kernels(m);
}
