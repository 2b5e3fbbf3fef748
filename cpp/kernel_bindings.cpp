// kernel_bindings.cpp — exposes copy_kernels.h as shmkv._C.PagedLayout.
// A PagedLayout is built once per KV cache (shmkv/transfer/layout.py computes the
// geometry from the tensors and checks them); the copies then take index
// arrays and payload buffers, validate, and run without the GIL.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <vector>

#include "byte_shuffle.h"
#include "copy_kernels.h"
#include "paged_layout_py.h"

namespace py = pybind11;
using namespace shmkv;

namespace {

struct PyPagedLayout {
  std::vector<uint64_t> bases;
  PagedLayout L;
  bool token_mode = false;
};

// An int64 index array from any C-contiguous buffer (numpy, array, memoryview).
std::vector<int64_t> indices_from(py::buffer obj, const char* what) {
  py::buffer_info info = obj.request();
  if (info.itemsize != 8 || (info.format != "q" && info.format != "l" && info.format != "<q" &&
                             info.format != "<l"))
    throw py::type_error(std::string(what) + " must be an int64 array (got format '" + info.format + "')");
  if (info.ndim != 1 || (info.shape[0] > 1 && info.strides[0] != 8))
    throw py::value_error(std::string(what) + " must be a contiguous 1-D int64 array");
  std::vector<int64_t> out(size_t(info.shape[0]));
  if (!out.empty()) std::memcpy(out.data(), info.ptr, out.size() * 8);
  return out;
}

struct Payload {
  uint8_t* ptr;
  uint64_t bytes;
};

Payload payload_from(py::buffer obj, bool writable) {
  py::buffer_info info = obj.request(writable);
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] != 1 && info.strides[d] != expect)
      throw py::value_error("payload buffer must be C-contiguous");
    expect *= info.shape[d];
  }
  return Payload{static_cast<uint8_t*>(info.ptr), uint64_t(info.size) * uint64_t(info.itemsize)};
}

using BlockFn = Status (*)(const PagedLayout&, const int64_t*, int64_t, uint8_t*, uint64_t, std::string*);

void run_copy(const PyPagedLayout& self, py::buffer idx, py::buffer payload, bool gather, bool tokens,
              BlockWindow w = BlockWindow()) {
  if (tokens != self.token_mode)
    throw py::value_error(tokens ? "this layout copies whole blocks; use gather_blocks/scatter_blocks"
                                 : "this layout copies tokens; use gather_tokens/scatter_tokens");
  std::vector<int64_t> ids = indices_from(idx, tokens ? "slot_mapping" : "block_ids");
  Payload p = payload_from(payload, gather);
  std::string err;
  Status s;
  {
    py::gil_scoped_release nogil;
    if (tokens) {
      s = gather ? gather_tokens(self.L, ids.data(), int64_t(ids.size()), p.ptr, p.bytes, &err,
                                 w.layer_begin, w.layer_end)
                 : scatter_tokens(self.L, ids.data(), int64_t(ids.size()), p.ptr, p.bytes, &err,
                                  w.layer_begin, w.layer_end);
    } else {
      s = gather ? gather_blocks(self.L, ids.data(), int64_t(ids.size()), p.ptr, p.bytes, w, &err)
                 : scatter_blocks(self.L, ids.data(), int64_t(ids.size()), p.ptr, p.bytes, w, &err);
    }
  }
  if (s != Status::kOk) throw py::value_error(err);
}

}  // namespace

py::bytes shuffle_impl(py::buffer src, size_t es, bool forward) {
  Payload p = payload_from(src, false);
  if (es < 1 || es > 64) throw py::value_error("element_size must be in [1, 64]");
  PyObject* out = PyBytes_FromStringAndSize(nullptr, Py_ssize_t(p.bytes));
  if (!out) throw py::error_already_set();
  auto* dst = reinterpret_cast<uint8_t*>(PyBytes_AS_STRING(out));
  {
    py::gil_scoped_release nogil;
    if (forward) byte_shuffle(p.ptr, dst, p.bytes, es);
    else byte_unshuffle(p.ptr, dst, p.bytes, es);
  }
  return py::reinterpret_steal<py::bytes>(out);
}

// unshuffle `src` into the writable buffer `dst` of the same size (a reservation: no copy in between)
void unshuffle_into_impl(py::buffer src, size_t es, py::buffer dst) {
  Payload p = payload_from(src, false);
  Payload d = payload_from(dst, true);
  if (es < 1 || es > 64) throw py::value_error("element_size must be in [1, 64]");
  if (d.bytes != p.bytes)
    throw py::value_error("byte_unshuffle_into: source of " + std::to_string(p.bytes) + " bytes, destination of " +
                          std::to_string(d.bytes));
  py::gil_scoped_release nogil;
  byte_unshuffle(p.ptr, d.ptr, p.bytes, es);
}

void register_kernels(py::module_& m) {
  m.def("byte_shuffle", [](py::buffer src, size_t es) { return shuffle_impl(src, es, true); },
        py::arg("data"), py::arg("element_size"), "Byte-plane shuffle (elements -> planes).");
  m.def("byte_unshuffle", [](py::buffer src, size_t es) { return shuffle_impl(src, es, false); },
        py::arg("data"), py::arg("element_size"), "Inverse of byte_shuffle.");
  m.def("byte_unshuffle_into", &unshuffle_into_impl, py::arg("data"), py::arg("element_size"), py::arg("out"),
        "Inverse of byte_shuffle, written into `out` (same size), without the GIL.");
  py::class_<PyPagedLayout>(m, "PagedLayout")
      .def(py::init([](std::vector<uint64_t> layer_bases, py::handle geometry) {
             auto* p = new PyPagedLayout();
             p->bases = std::move(layer_bases);
             p->L = paged_layout_from(geometry, p->bases, &p->token_mode);
             std::string err;
             if (validate_layout(p->L, p->token_mode, &err) != Status::kOk) {
               delete p;
               throw py::value_error(err);
             }
             return p;
           }),
           py::arg("layer_bases"), py::arg("geometry"),
           "One KV-cache group: its layers' base addresses and its geometry (shmkv.transfer.layout.LayoutGeometry).")
      .def_property_readonly("num_layers", [](const PyPagedLayout& p) { return p.L.num_layers; })
      .def_property_readonly("token_mode", [](const PyPagedLayout& p) { return p.token_mode; })
      .def_property_readonly("token_payload_bytes", [](const PyPagedLayout& p) { return p.L.token_payload_bytes(); })
      .def_property_readonly("block_bytes", [](const PyPagedLayout& p) { return p.L.block_bytes; })
      .def("gather_blocks", [](const PyPagedLayout& s, py::buffer ids, py::buffer out, int64_t first, int64_t blocks,
                               int64_t l0, int64_t l1) {
             run_copy(s, ids, out, true, false, BlockWindow{first, blocks, l0, l1});
           }, py::arg("block_ids"), py::arg("payload"), py::arg("payload_first") = 0, py::arg("payload_blocks") = -1,
           py::arg("layer_begin") = 0, py::arg("layer_end") = -1)
      .def("scatter_blocks", [](const PyPagedLayout& s, py::buffer ids, py::buffer src, int64_t first, int64_t blocks,
                                int64_t l0, int64_t l1) {
             run_copy(s, ids, src, false, false, BlockWindow{first, blocks, l0, l1});
           }, py::arg("block_ids"), py::arg("payload"), py::arg("payload_first") = 0, py::arg("payload_blocks") = -1,
           py::arg("layer_begin") = 0, py::arg("layer_end") = -1)
      .def("gather_tokens", [](const PyPagedLayout& s, py::buffer slots, py::buffer out, int64_t l0, int64_t l1) {
             run_copy(s, slots, out, true, true, BlockWindow{0, -1, l0, l1});
           }, py::arg("slot_mapping"), py::arg("payload"), py::arg("layer_begin") = 0, py::arg("layer_end") = -1)
      .def("scatter_tokens", [](const PyPagedLayout& s, py::buffer slots, py::buffer src, int64_t l0, int64_t l1) {
             run_copy(s, slots, src, false, true, BlockWindow{0, -1, l0, l1});
           }, py::arg("slot_mapping"), py::arg("payload"), py::arg("layer_begin") = 0, py::arg("layer_end") = -1)
      .def("token_copy_runs", [](const PyPagedLayout& s, py::buffer slots, int64_t l0, int64_t l1) {
             if (!s.token_mode) throw py::value_error("runs are counted for token layouts only");
             std::vector<int64_t> idx = indices_from(slots, "slot_mapping");
             std::string err;
             Status st = check_token_copy(s.L, idx.data(), int64_t(idx.size()),
                                          uint64_t(s.L.num_layers) * idx.size() * s.L.token_payload_bytes(), &err);
             if (st != Status::kOk) throw py::value_error(err);
             if (l1 < 0) l1 = s.L.num_layers;
             if (l0 < 0 || l0 > l1 || l1 > s.L.num_layers) throw py::value_error("layer range is not inside the layout");
             int64_t runs = 0, bytes = 0;
             visit_token_runs(s.L, idx.data(), int64_t(idx.size()), l0, l1, [&](uint64_t, uint64_t, uint64_t n) {
               ++runs;
               bytes += int64_t(n);
             }, [](uint64_t, uint64_t) {});
             return py::make_tuple(runs, bytes);
           }, py::arg("slot_mapping"), py::arg("layer_begin") = 0, py::arg("layer_end") = -1,
           "(runs, bytes) a copy-engine copy of these slots would issue: contiguous runs, adjacent ones merged.");
}
