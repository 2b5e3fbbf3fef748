// cuda_bindings.cpp — shmkv._C_cuda: the CUDA launchers for Python. Imported
// only by shmkv.transfer.copy_backends / shmkv.transfer.gpu, and only for a KV cache on a CUDA device.
#include <cuda_runtime.h>
#include <pybind11/pybind11.h>
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <vector>

#include "paged_copy.h"
#include "paged_layout_py.h"

namespace py = pybind11;
using namespace shmkv;

namespace {

// NOTE: shmkv links the shared CUDA runtime (the one torch loaded, when the
// major versions match), and every launch runs on the cache's own device
// whatever the calling thread's current device is; the previous one is restored.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    if (device < 0 || cudaGetDevice(&prev_) != cudaSuccess) return;
    if (prev_ != device && cudaSetDevice(device) == cudaSuccess) restore_ = true;
    cudaGetLastError();
  }
  ~DeviceGuard() {
    if (restore_) cudaSetDevice(prev_);
  }

 private:
  int prev_ = -1;
  bool restore_ = false;
};

void check(Status s, const std::string& err) {
  if (s == Status::kInvalidArgument) throw py::value_error(err);
  if (s != Status::kOk) throw std::runtime_error(err);
}

}  // namespace

// Indices arrive as numpy int64 arrays (no Python list conversion).
using Index = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

PYBIND11_MODULE(_C_cuda, m) {
  m.doc() = "shmkv CUDA gather/scatter kernels";
#ifdef SHMKV_CUDA_ARCHITECTURES
  // What this build carries: machine code per "NN-real" entry, PTX per "NN-virtual" (CMakeLists.txt).
  m.attr("ARCHITECTURES") = SHMKV_CUDA_ARCHITECTURES;
#endif
  m.attr("CUDA_RUNTIME_BUILT") = CUDART_VERSION;  // the runtime's version this module was built against
  // One KV-cache group on the device, built once (shmkv.transfer.copy_backends.CudaCopy).
  struct CudaLayout {
    std::vector<uint64_t> bases;
    PagedLayout L;
    bool token_mode = false;
    int device = -1;  // CUDA device index of the KV cache
    std::unique_ptr<BatchBufferPool> pool = std::make_unique<BatchBufferPool>();  // its batches' index buffers
  };
  // A prepared batch of one layout (kept alive by its layout).
  struct CudaBatch {
    const CudaLayout* layout = nullptr;
    TokenBatch batch;
    uintptr_t stream = 0;
    bool released = false;
    ~CudaBatch() {
      if (!released) release_token_batch(&batch, stream);
    }
  };
  py::class_<CudaLayout>(m, "PagedLayout")
      .def(py::init([](std::vector<uint64_t> layer_bases, py::handle geometry, int device) {
             auto* p = new CudaLayout();
             p->bases = std::move(layer_bases);
             p->L = paged_layout_from(geometry, p->bases, &p->token_mode);
             p->device = device;
             return p;
           }),
           py::arg("layer_bases"), py::arg("geometry"), py::arg("device") = -1)
      .def("copy",
           [](const CudaLayout& self, bool gather, Index idx, uintptr_t payload,
              uint64_t payload_bytes, uintptr_t stream, int64_t layer_begin, int64_t layer_end, bool dma) {
             std::string err;
             Status s;
             {
               py::gil_scoped_release nogil;
               DeviceGuard on(self.device);
               auto* p = reinterpret_cast<uint8_t*>(payload);
               auto n = int64_t(idx.size());
               s = dma ? launch_paged_copy_dma(self.L, self.token_mode, gather, idx.data(), n, p, payload_bytes,
                                               stream, &err, layer_begin, layer_end)
                       : launch_paged_copy(self.L, self.token_mode, gather, idx.data(), n, p, payload_bytes,
                                           stream, &err, layer_begin, layer_end);
             }
             check(s, err);
           },
           py::arg("gather"), py::arg("index"), py::arg("payload"), py::arg("payload_bytes"), py::arg("stream"),
           py::arg("layer_begin") = 0, py::arg("layer_end") = -1, py::arg("dma") = false,
           "Launch a gather (cache -> payload) or scatter of layers [layer_begin, layer_end) (-1: to the "
           "last) on `stream`, by kernels or (dma) by the copy engines; asynchronous.")
      .def("prepare_batch",
           [](const CudaLayout& self, const std::vector<std::tuple<Index, uintptr_t, uint64_t>>& entries,
              uintptr_t stream) {
             if (!self.token_mode) throw py::value_error("batches copy token payloads only");
             std::vector<BatchEntry> es;
             for (const auto& [idx, payload, bytes] : entries)
               es.push_back(BatchEntry{idx.data(), int64_t(idx.size()), reinterpret_cast<uint8_t*>(payload), bytes});
             auto* b = new CudaBatch();
             b->layout = &self;
             std::string err;
             Status s;
             {
               py::gil_scoped_release nogil;
               DeviceGuard on(self.device);
               s = prepare_token_batch(self.L, es, stream, *self.pool, &b->batch, &err);
             }
             if (s != Status::kOk) {
               delete b;
               check(s, err);
             }
             b->stream = stream;
             return b;
           },
           py::arg("entries"), py::arg("stream"), py::keep_alive<0, 1>(),
           "Check and upload (once, on `stream`) a batch of (slots, payload address, payload bytes); "
           "each layer is then one launch (CudaBatch.copy_layer).")
      .def_property_readonly("batch_buffers", [](const CudaLayout& self) { return self.pool->size(); },
                             "index buffers this layout's pool has made (reused step after step)");
  py::class_<CudaBatch>(m, "CudaBatch")
      .def("copy_layer",
           [](CudaBatch& b, int64_t layer, uintptr_t stream, bool dma) {
             if (b.released) throw py::value_error("the batch was released");
             std::string err;
             Status s;
             {
               py::gil_scoped_release nogil;
               DeviceGuard on(b.layout->device);
               s = launch_token_batch(b.layout->L, b.batch, layer, stream, dma, &err);
             }
             check(s, err);
           },
           py::arg("layer"), py::arg("stream"), py::arg("dma") = false,
           "One layer of every payload of the batch into the cache (a step's loads), on `stream` (ordered "
           "after prepare_batch's stream).")
      .def("release",
           [](CudaBatch& b, uintptr_t stream) {
             DeviceGuard on(b.layout->device);
             release_token_batch(&b.batch, stream);
             b.released = true;
           },
           py::arg("stream"), "Free the device arrays, ordered after the work queued on `stream`.");
  // Pinning faults in and locks every page (seconds per many GiB): other Python threads run meanwhile.
  m.def("register_host", [](uintptr_t ptr, uint64_t bytes) {
    std::string err;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = register_host_memory(reinterpret_cast<void*>(ptr), bytes, &err);
    }
    check(s, err);
  });
  m.def("unregister_host", [](uintptr_t ptr) {
    std::string err;
    Status s;
    {
      py::gil_scoped_release nogil;
      s = unregister_host_memory(reinterpret_cast<void*>(ptr), &err);
    }
    check(s, err);
  });
}
