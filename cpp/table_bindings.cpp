// table_bindings.cpp — the chunk table's part of the pybind11 module shmkv._C
// (bindings.cpp holds the module, its constants and enums): open_table and the
// Table, Reservation and Lease classes. Statuses come back as ints
// (shmkv/errors.py maps the error codes to exceptions); "miss"/"full"/
// "exists"/"busy" are plain results.
//
// Reservation and Lease objects export their payload through the buffer
// protocol (writable / read-only). They keep the mapping alive, and one that is
// garbage-collected while still open is aborted / released — but only in the
// process that made it: a forked child must never release its parent's lease.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <cstddef>
#include <cstring>

#include "chunk_table.h"
#include "value_limits.h"
#include "counters.h"
#include "segment.h"
#include "status.h"
#include "stream_copy.h"

namespace py = pybind11;
using namespace shmkv;

namespace {

bool c_contiguous(const py::buffer_info& info) {
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expect) return false;
    expect *= info.shape[d];
  }
  return true;
}

Key key_from(py::handle obj) {
  char* data = nullptr;
  Py_ssize_t len = 0;
  if (PyBytes_Check(obj.ptr())) {
    PyBytes_AsStringAndSize(obj.ptr(), &data, &len);
  } else {
    throw py::type_error("a key must be bytes of length 16, got " +
                         std::string(py::str(py::type::of(obj))));
  }
  if (len != 16) throw py::value_error("a key must be 16 bytes, got " + std::to_string(len));
  Key k;
  std::memcpy(&k, data, 16);
  return k;
}

// A list/tuple of 16-byte keys, or one bytes-like object of 16*n bytes.
std::vector<Key> keys_from(py::handle obj) {
  std::vector<Key> out;
  if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
    py::sequence seq = py::reinterpret_borrow<py::sequence>(obj);
    out.reserve(seq.size());
    for (py::handle item : seq) out.push_back(key_from(item));
    return out;
  }
  py::buffer buf = py::reinterpret_borrow<py::buffer>(obj);
  py::buffer_info info = buf.request();
  size_t nbytes = size_t(info.size) * size_t(info.itemsize);
  if (!c_contiguous(info) || nbytes % 16 != 0)
    throw py::value_error("keys must be a list of 16-byte keys or a contiguous buffer of 16*n bytes");
  out.resize(nbytes / 16);
  std::memcpy(out.data(), info.ptr, nbytes);
  return out;
}

// One offset (uint64) per key, each chunk [offset, offset + size) inside a
// buffer of `cap` bytes.
std::vector<uint64_t> chunk_offsets(py::buffer offsets, size_t n, uint64_t size, size_t cap) {
  py::buffer_info info = offsets.request();
  if (info.itemsize != 8 || !c_contiguous(info) || size_t(info.size) != n)
    throw py::value_error("offsets must be " + std::to_string(n) + " uint64 values, one per key");
  std::vector<uint64_t> out(n);
  std::memcpy(out.data(), info.ptr, n * 8);
  for (size_t i = 0; i < n; ++i)
    if (size > cap || out[i] > cap - size)
      throw py::value_error("chunk " + std::to_string(i) + " at offset " + std::to_string(out[i]) + " (+" +
                            std::to_string(size) + " bytes) lies outside the " + std::to_string(cap) +
                            "-byte buffer");
  return out;
}

void flush_events(ChunkTable& t) {
  if (!t.has_events()) return;
  auto events = t.drain_events();
  py::object log = py::module_::import("logging").attr("getLogger")("shmkv.store");
  for (auto& e : events) {
    bool warn = e.rfind("W:", 0) == 0;
    log.attr(warn ? "warning" : "info")(e.substr(2));
  }
}

struct PyTable;

struct PyReservation {
  std::shared_ptr<ChunkTable> table;
  Reservation r;
  pid_t owner;
  bool open = true;
  ~PyReservation() {
    if (open && owner == getpid()) table->abort(r);
  }
  int finish(bool commit) {
    if (!open) throw py::value_error("reservation already committed or aborted");
    open = false;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = commit ? table->commit(r) : table->abort(r);
    }
    flush_events(*table);
    return int(s);
  }
};

struct PyLease {
  std::shared_ptr<ChunkTable> table;
  LeaseHandle h;
  pid_t owner;
  bool open = true;
  ~PyLease() {
    if (open && owner == getpid()) table->release(h);
  }
  int release(bool cold) {
    if (!open) throw py::value_error("lease already released");
    open = false;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = table->release(h, cold);
    }
    flush_events(*table);
    return int(s);
  }
};

struct PyTable {
  std::shared_ptr<ChunkTable> t;

  py::tuple reserve(py::bytes key, uint64_t size, py::object ns, uint32_t tokens, uint32_t flags) {
    Key k = key_from(key);
    Key n = ns.is_none() ? Key{0, 0} : key_from(ns);
    Reservation r;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = t->reserve(k, size, &r, n, tokens, flags);
    }
    flush_events(*t);
    if (s != Status::kOk) return py::make_tuple(int(s), py::none());
    auto* pr = new PyReservation{t, r, getpid()};
    return py::make_tuple(int(s), py::cast(pr, py::return_value_policy::take_ownership));
  }

  py::object acquire(py::bytes key) {
    Key k = key_from(key);
    LeaseHandle h;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = t->acquire(k, &h);
    }
    flush_events(*t);
    if (s != Status::kOk) return py::none();
    return py::cast(new PyLease{t, h, getpid()}, py::return_value_policy::take_ownership);
  }

  py::list acquire_prefix(py::handle keys, bool count_lookup) {
    std::vector<Key> ks = keys_from(keys);
    std::vector<LeaseHandle> hs(ks.size());
    size_t n = 0;
    {
      py::gil_scoped_release nogil;
      t->acquire_prefix(ks.data(), ks.size(), hs.data(), &n, count_lookup);
    }
    flush_events(*t);
    py::list out;
    pid_t me = getpid();
    for (size_t i = 0; i < n; ++i)
      out.append(py::cast(new PyLease{t, hs[i], me}, py::return_value_policy::take_ownership));
    return out;
  }

  size_t lookup_prefix(py::handle keys, bool count_lookup) {
    std::vector<Key> ks = keys_from(keys);
    size_t n;
    {
      py::gil_scoped_release nogil;
      n = t->lookup_prefix(ks.data(), ks.size(), count_lookup);
    }
    flush_events(*t);
    return n;
  }

  py::bytes contains(py::handle keys) {
    std::vector<Key> ks = keys_from(keys);
    std::string out(ks.size(), '\0');
    {
      py::gil_scoped_release nogil;
      t->contains(ks.data(), ks.size(), reinterpret_cast<uint8_t*>(&out[0]));
    }
    flush_events(*t);
    return py::bytes(out);
  }

  // reserve + copy + commit, the copy without the GIL and without the lock.
  int put(py::bytes key, py::buffer data, py::object ns, uint32_t tokens, uint32_t flags) {
    Key k = key_from(key);
    Key n = ns.is_none() ? Key{0, 0} : key_from(ns);
    py::buffer_info info = data.request();
    size_t nbytes = size_t(info.size) * size_t(info.itemsize);
    if (!c_contiguous(info)) throw py::value_error("put() needs a C-contiguous buffer");
    Status s;
    {
      py::gil_scoped_release nogil;
      Reservation r;
      s = t->reserve(k, nbytes, &r, n, tokens, flags);
      if (s == Status::kOk) {
        stream_copy(t->payload(r.offset), info.ptr, nbytes);
        s = t->commit(r);
      }
    }
    flush_events(*t);
    return int(s);
  }

  // acquire + copy + release into `out`; returns bytes copied, -1 on a miss,
  // -2 when the lease went stale during the copy (treat as a miss).
  int64_t get_into(py::bytes key, py::buffer out) {
    Key k = key_from(key);
    py::buffer_info info = out.request(true);
    size_t cap = size_t(info.size) * size_t(info.itemsize);
    if (!c_contiguous(info)) throw py::value_error("get_into() needs a C-contiguous buffer");
    int64_t result;
    LeaseHandle h;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = t->acquire(k, &h);
      if (s != Status::kOk) {
        result = -1;
      } else if (h.size > cap) {
        t->release(h);
        result = -3;
      } else {
        stream_copy(info.ptr, t->payload(h.offset), h.size);
        result = t->release(h) == Status::kOk ? int64_t(h.size) : -2;
      }
    }
    flush_events(*t);
    if (result == -3) throw py::value_error("get_into: buffer too small for the payload");
    return result;
  }

  // Copy each key's payload into out[offsets[i], offsets[i] + size): acquire,
  // copy (without the GIL, outside the lock), release. One status byte per
  // key: kOk; kMiss; kStale (reclaimed during the copy: the bytes are not to
  // be trusted); kMismatch (another size, or a compressed payload: nothing
  // copied); kTimedOut.
  py::bytes read_chunks(py::handle keys, py::buffer out, py::buffer offsets, uint64_t size) {
    std::vector<Key> ks = keys_from(keys);
    py::buffer_info oi = out.request(true);
    if (!c_contiguous(oi)) throw py::value_error("read_chunks() needs a C-contiguous output buffer");
    std::vector<uint64_t> offs = chunk_offsets(offsets, ks.size(), size, size_t(oi.size) * size_t(oi.itemsize));
    std::string status(ks.size(), '\0');
    {
      py::gil_scoped_release nogil;
      auto* base = static_cast<uint8_t*>(oi.ptr);
      for (size_t i = 0; i < ks.size(); ++i) {
        LeaseHandle h;
        Status s = t->acquire(ks[i], &h);
        if (s == Status::kOk) {
          if (h.size != size || (h.flags & kFlagCompressed)) {
            t->release(h);
            s = Status::kMismatch;
          } else {
            stream_copy(base + offs[i], t->payload(h.offset), size);
            s = t->release(h) == Status::kOk ? Status::kOk : Status::kStale;
          }
        }
        status[i] = char(s);
      }
    }
    flush_events(*t);
    return py::bytes(status);
  }

  // Store src[offsets[i], offsets[i] + size) under each key: reserve, copy
  // (without the GIL, outside the lock), commit. One status byte per key:
  // kOk, or what reserve / commit answered (kExists, kBusy, kFull, kStale,
  // kTimedOut, kTooLarge, kInvalidArgument).
  py::bytes write_chunks(py::handle keys, py::buffer src, py::buffer offsets, uint64_t size, py::object ns,
                         uint32_t tokens) {
    std::vector<Key> ks = keys_from(keys);
    Key n = ns.is_none() ? Key{0, 0} : key_from(ns);
    py::buffer_info si = src.request();
    if (!c_contiguous(si)) throw py::value_error("write_chunks() needs a C-contiguous source buffer");
    std::vector<uint64_t> offs = chunk_offsets(offsets, ks.size(), size, size_t(si.size) * size_t(si.itemsize));
    std::string status(ks.size(), '\0');
    {
      py::gil_scoped_release nogil;
      const auto* base = static_cast<const uint8_t*>(si.ptr);
      for (size_t i = 0; i < ks.size(); ++i) {
        Reservation r;
        Status s = t->reserve(ks[i], size, &r, n, tokens, 0);
        if (s == Status::kOk) {
          stream_copy(t->payload(r.offset), base + offs[i], size);
          s = t->commit(r);
        }
        status[i] = char(s);
      }
    }
    flush_events(*t);
    return py::bytes(status);
  }

  int simple(Status (ChunkTable::*fn)(const Key&), py::bytes key) {
    Key k = key_from(key);
    Status s;
    {
      py::gil_scoped_release nogil;
      s = ((*t).*fn)(k);
    }
    flush_events(*t);
    return int(s);
  }
};

py::tuple open_table(const std::string& name, const std::string& segment_dir, int mode, uint64_t capacity, uint64_t max_payload,
                     uint64_t alignment, uint32_t max_entries, uint32_t max_leases,
                     uint32_t max_procs, bool populate, double lock_timeout_s, double init_wait_s) {
  if (!(lock_timeout_s >= kLockTimeoutMinS && lock_timeout_s <= kLockTimeoutMaxS))
    throw py::value_error("lock_timeout must be in [" + std::to_string(kLockTimeoutMinS) + ", " +
                          std::to_string(kLockTimeoutMaxS) + "] seconds");
  if (!(init_wait_s > 0 && init_wait_s <= 86400)) throw py::value_error("init_wait_s must be in (0, 86400] seconds");
  SegmentConfig cfg;
  cfg.capacity_bytes = capacity;
  cfg.max_payload_bytes = max_payload;
  cfg.alignment = alignment;
  cfg.max_entries = max_entries;
  cfg.max_leases = max_leases;
  cfg.max_procs = max_procs;
  cfg.init_wait_ns = uint64_t(init_wait_s * 1e9);
  if (mode < 0 || mode > 2) throw py::value_error("mode must be 0 (create), 1 (attach) or 2 (open_or_create)");
  std::shared_ptr<Segment> seg;
  std::string err;
  std::shared_ptr<ChunkTable> table;
  Status s;
  {
    py::gil_scoped_release nogil;
    s = Segment::open(name, segment_dir, static_cast<OpenMode>(mode), cfg, populate, &seg, &err);
    if (s == Status::kOk) {
      try {
        table = std::make_shared<ChunkTable>(seg, uint64_t(lock_timeout_s * 1e9));
      } catch (const SegmentBroken& e) {
        s = Status::kCorrupt;
        err = "segment '" + name + "': " + e.what();
      } catch (const LockTimeout& e) {
        s = Status::kTimedOut;
        err = e.what();
      }
    }
  }
  if (s != Status::kOk) return py::make_tuple(int(s), err, py::none(), 0);
  flush_events(*table);
  auto* pt = new PyTable{table};
  return py::make_tuple(int(s), std::string(), py::cast(pt, py::return_value_policy::take_ownership),
                        int(seg->outcome()));
}


}  // namespace

void register_table(py::module_& m) {
  m.def("open_table", &open_table, py::arg("name"), py::arg("segment_dir"), py::arg("mode"), py::arg("capacity_bytes"),
        py::arg("max_payload_bytes"), py::arg("alignment"), py::arg("max_entries"),
        py::arg("max_leases"), py::arg("max_procs"), py::arg("populate"),
        py::arg("lock_timeout_s") = double(ChunkTable::kDefaultLockTimeoutNs) / 1e9,
        py::arg("init_wait_s") = double(SegmentConfig{}.init_wait_ns) / 1e9,
        "Open the segment `name` in `segment_dir` (\"\": POSIX shm, /dev/shm); returns (status, message, "
        "Table | None, outcome).");

  py::class_<PyReservation>(m, "Reservation", py::buffer_protocol())
      .def_buffer([](PyReservation& r) {
        if (!r.open) throw py::buffer_error("reservation is closed");
        return py::buffer_info(r.table->payload(r.r.offset), 1, "B", 1, {py::ssize_t(r.r.size)}, {1}, false);
      })
      .def_property_readonly("size", [](const PyReservation& r) { return r.r.size; })
      .def_property_readonly("offset", [](const PyReservation& r) { return r.r.offset; })
      .def_property_readonly("address", [](const PyReservation& r) {
        return reinterpret_cast<uintptr_t>(r.table->payload(r.r.offset));
      })
      .def_property_readonly("is_open", [](const PyReservation& r) { return r.open; })
      .def("commit", [](PyReservation& r) { return r.finish(true); })
      .def("abort", [](PyReservation& r) { return r.finish(false); });

  py::class_<PyLease>(m, "Lease", py::buffer_protocol())
      .def_buffer([](PyLease& l) {
        if (!l.open) throw py::buffer_error("lease is released");
        return py::buffer_info(l.table->payload(l.h.offset), 1, "B", 1, {py::ssize_t(l.h.size)}, {1}, true);
      })
      .def_property_readonly("size", [](const PyLease& l) { return l.h.size; })
      .def_property_readonly("tokens", [](const PyLease& l) { return l.h.tokens; })
      .def_property_readonly("flags", [](const PyLease& l) { return l.h.flags; })
      .def_property_readonly("offset", [](const PyLease& l) { return l.h.offset; })
      .def_property_readonly("address", [](const PyLease& l) {
        return reinterpret_cast<uintptr_t>(l.table->payload(l.h.offset));
      })
      .def_property_readonly("is_open", [](const PyLease& l) { return l.open; })
      .def("release", &PyLease::release, py::arg("cold") = false);

  py::class_<PyTable>(m, "Table")
      .def("reserve", &PyTable::reserve, py::arg("key"), py::arg("size"), py::arg("ns") = py::none(),
           py::arg("tokens") = 0, py::arg("flags") = 0)
      .def("acquire", &PyTable::acquire, py::arg("key"))
      .def("acquire_prefix", &PyTable::acquire_prefix, py::arg("keys"), py::arg("count_lookup") = true)
      .def("lookup_prefix", &PyTable::lookup_prefix, py::arg("keys"), py::arg("count_lookup") = true)
      .def("contains", &PyTable::contains, py::arg("keys"))
      .def("put", &PyTable::put, py::arg("key"), py::arg("data"), py::arg("ns") = py::none(),
           py::arg("tokens") = 0, py::arg("flags") = 0)
      .def("get_into", &PyTable::get_into, py::arg("key"), py::arg("out"))
      .def("read_chunks", &PyTable::read_chunks, py::arg("keys"), py::arg("out"), py::arg("offsets"),
           py::arg("size"))
      .def("write_chunks", &PyTable::write_chunks, py::arg("keys"), py::arg("src"), py::arg("offsets"),
           py::arg("size"), py::arg("ns") = py::none(), py::arg("tokens") = 0)
      .def("pin", [](PyTable& t, py::bytes k) { return t.simple(&ChunkTable::pin, k); })
      .def("unpin", [](PyTable& t, py::bytes k) { return t.simple(&ChunkTable::unpin, k); })
      .def("erase", [](PyTable& t, py::bytes k) { return t.simple(&ChunkTable::erase, k); })
      .def("clear", [](PyTable& t, py::object ns) {
        bool one = !ns.is_none();
        Key n = one ? key_from(ns) : Key{0, 0};
        uint64_t removed;
        {
          py::gil_scoped_release nogil;
          removed = t.t->clear(one ? &n : nullptr);
        }
        flush_events(*t.t);
        return removed;
      }, py::arg("ns") = py::none())
      .def("reclaim", [](PyTable& t) {
        ReclaimResult r;
        {
          py::gil_scoped_release nogil;
          r = t.t->reclaim();
        }
        flush_events(*t.t);
        py::dict d;
        d["leases"] = r.leases;
        d["writes"] = r.writes;
        d["processes"] = r.procs;
        return d;
      })
      .def("rebuild", [](PyTable& t) {
        {
          py::gil_scoped_release nogil;
          t.t->rebuild();
        }
        flush_events(*t.t);
      })
      .def("coldest", [](PyTable& t, size_t n) {
        std::vector<ColdEntry> v;
        {
          py::gil_scoped_release nogil;
          v = t.t->coldest(n);
        }
        py::list out;
        for (auto& c : v)
          out.append(py::make_tuple(py::bytes(reinterpret_cast<const char*>(&c.key), 16), c.size, c.flags,
                                    py::bytes(reinterpret_cast<const char*>(&c.ns), 16), c.tokens));
        return out;
      }, py::arg("max_n"))
      .def("list_entries", [](PyTable& t) {
        std::vector<EntryInfo> v;
        {
          py::gil_scoped_release nogil;
          v = t.t->list_entries();
        }
        static const char* kStates[] = {"free", "writing", "ready", "doomed"};
        py::list out;
        for (auto& e : v) {
          py::dict d;
          d["key"] = py::bytes(reinterpret_cast<const char*>(&e.key), 16);
          d["namespace"] = py::bytes(reinterpret_cast<const char*>(&e.ns), 16);
          d["size"] = e.size;
          d["alloc_size"] = e.alloc_size;
          d["state"] = e.state < 4 ? kStates[e.state] : "unknown";
          d["pins"] = e.pin_count;
          d["leases"] = e.refcount;
          d["flags"] = e.flags;
          d["owner_pid"] = e.owner_pid;
          d["tokens"] = e.tokens;
          out.append(d);
        }
        return out;
      })
      .def("set_flags", [](PyTable& t, py::bytes k, uint32_t flags) {
        Key key = key_from(k);
        py::gil_scoped_release nogil;
        return int(t.t->set_flags(key, flags));
      })
      .def("evict_spilled", [](PyTable& t, py::bytes k) { return t.simple(&ChunkTable::evict_spilled, k); })
      .def("bump", [](PyTable& t, const std::string& name, uint64_t n) {
        if (!t.t->bump(name, n)) throw py::value_error("no tier counter named '" + name + "'");
      }, py::arg("counter"), py::arg("n") = 1)
      .def("renew_spill_guard", [](PyTable& t, double seconds) {
        if (!(seconds >= 0 && seconds <= 3600)) throw py::value_error("spill guard seconds must be in [0, 3600]");
        t.t->renew_spill_guard(uint64_t(seconds * 1e9));
      }, py::arg("seconds"), "while its spills reach the disk, the maintainer keeps puts to evicting spilled chunks")
      .def("spill_guard_active", [](PyTable& t) { return t.t->spill_guard_active(); })
      .def("open_handles", [](PyTable& t) { return t.t->open_handles(); },
           "leases and reservations of this attachment not yet released, committed or aborted")
      .def("detach", [](PyTable& t) {
        py::gil_scoped_release nogil;
        t.t->detach_process();
      })
      .def("check_consistency", [](PyTable& t) {
        std::vector<std::string> bad;
        {
          py::gil_scoped_release nogil;
          bad = t.t->check_consistency();
        }
        flush_events(*t.t);
        return bad;
      })
      .def("stats", [](PyTable& t) { return t.t->stats(); })
      // exclusive roles among every process sharing the segment, in any PID namespace
      .def("try_hold_role", [](PyTable& t, uint32_t role) { return t.t->segment()->try_hold_role(role); })
      .def("release_role", [](PyTable& t, uint32_t role) { t.t->segment()->release_role(role); })
      .def("role_held_elsewhere", [](PyTable& t, uint32_t role) { return t.t->segment()->role_held_elsewhere(role); })
      .def("removal_count", [](PyTable& t) { return t.t->removal_count(); },
           "evictions + deletes + segment resets: moves whenever a chunk may have left the table")
      .def("lock_holder", [](PyTable& t) {
        LockHolder who = t.t->lock_holder();
        return py::make_tuple(who.pid, double(who.held_ns) / 1e9);
      }, "(pid, seconds) of the process holding the table lock now; pid 0: nobody")
      .def("file_bytes", [](PyTable& t) { return t.t->file_bytes(); })
      .def("probe_lock", [](PyTable& t) {
        bool ok;
        {
          py::gil_scoped_release nogil;
          ok = t.t->probe_lock();
        }
        flush_events(*t.t);
        return ok;
      }, "Whether the table lock can be had within the bound (taken and given back).")
      .def("restore_size", [](PyTable& t) -> py::tuple {
        std::string err;
        Status s;
        {
          py::gil_scoped_release nogil;
          s = t.t->restore_size(&err);
        }
        flush_events(*t.t);
        return py::make_tuple(int(s), err);
      }, "Grow a truncated segment file back and reset the table; (status, message).")
      .def("reserve_more", [](PyTable& t, uint64_t max_bytes, bool map_pages) -> py::tuple {
        std::string err;
        uint64_t now = 0;
        Status s;
        {
          py::gil_scoped_release nogil;
          s = t.t->segment()->reserve_more(max_bytes, map_pages, &now, &err);
        }
        return py::make_tuple(int(s), err, now);
      }, py::arg("max_bytes"), py::arg("map_pages"),
         "Reserve up to max_bytes more of the arena's pages (then map them with map_pages); "
         "(status, message, arena bytes reserved now).")
      .def("map_arena", [](PyTable& t, uint64_t offset, uint64_t bytes) {
        py::gil_scoped_release nogil;
        return t.t->segment()->map_arena(offset, bytes);
      }, py::arg("offset"), py::arg("bytes"),
         "Map the reserved pages of arena bytes [offset, offset + bytes) into this process now.")
      .def_property_readonly("name", [](const PyTable& t) { return t.t->segment()->name(); })
      .def_property_readonly("arena_address", [](const PyTable& t) {
        return reinterpret_cast<uintptr_t>(t.t->segment()->arena());
      })
      .def_property_readonly("arena_bytes", [](const PyTable& t) { return t.t->segment()->geo().arena_bytes; })
      .def_property_readonly("max_payload_bytes",
                             [](const PyTable& t) { return t.t->segment()->geo().max_payload_bytes; })
      .def_property_readonly("capacity_bytes", [](const PyTable& t) {
        return t.t->segment()->geo().capacity_bytes;  // this process's copy: no page of the segment is read
      })
      .def("debug_die_holding_lock", [](PyTable& t, int fd, bool scramble) {
        py::gil_scoped_release nogil;
        t.t->debug_die_holding_lock(fd, scramble);
      });

}
