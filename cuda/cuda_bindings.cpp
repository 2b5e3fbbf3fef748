// cuda_bindings.cpp — shmkv._C_cuda: the CUDA launchers for Python. Imported
// only by shmkv.gpu, and only when torch sees a CUDA device.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <vector>

#include "paged_copy.h"

namespace py = pybind11;
using namespace shmkv;

namespace {

void check(Status s, const std::string& err) {
  if (s == Status::kInvalidArgument) throw py::value_error(err);
  if (s != Status::kOk) throw std::runtime_error(err);
}

}  // namespace

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "shmkv CUDA gather/scatter kernels";
  m.def("paged_copy",
        [](std::vector<uint64_t> layer_bases, int64_t num_blocks, int64_t block_stride,
           int64_t block_bytes, int64_t block_size, bool token_mode, int64_t token_stride,
           int64_t runs_i, int64_t stride_i, int64_t runs_j, int64_t stride_j, int64_t run_bytes,
           bool gather, std::vector<int64_t> idx, uintptr_t payload, uint64_t payload_bytes,
           uintptr_t stream) {
          PagedLayout L;
          L.num_layers = int64_t(layer_bases.size());
          L.layer_base = layer_bases.data();
          L.num_blocks = num_blocks;
          L.block_stride = block_stride;
          L.block_bytes = block_bytes;
          L.block_size = block_size;
          L.token_stride = token_stride;
          L.runs_i = runs_i;
          L.stride_i = stride_i;
          L.runs_j = runs_j;
          L.stride_j = stride_j;
          L.run_bytes = run_bytes;
          std::string err;
          Status s;
          {
            py::gil_scoped_release nogil;
            s = launch_paged_copy(L, token_mode, gather, idx.data(), int64_t(idx.size()),
                                  reinterpret_cast<uint8_t*>(payload), payload_bytes, stream, &err);
          }
          check(s, err);
        });
  m.def("register_host", [](uintptr_t ptr, uint64_t bytes) {
    std::string err;
    check(register_host_memory(reinterpret_cast<void*>(ptr), bytes, &err), err);
  });
  m.def("unregister_host", [](uintptr_t ptr) {
    std::string err;
    check(unregister_host_memory(reinterpret_cast<void*>(ptr), &err), err);
  });
}
