// paged_copy.cu — GPU gather/scatter between vLLM's paged KV cache (device
// memory) and a chunk payload in the shmkv segment (host memory registered
// with cudaHostRegister, addressed through its device pointer: no staging
// buffer). Same PagedLayout and payload order as cpp/copy_kernels.h.
//
// Three layers, as everywhere in shmkv:
//   kernels (this file, framework-free) -> launchers (this file: validate on
//   the host, then launch on the caller's stream) -> Python (shmkv/transfer/gpu.py).
// NOTE: the launchers are asynchronous on `stream`; the payload must stay
// leased/reserved until the stream has passed the copy (the connector commits
// a stored chunk only when its CUDA event completes). A single copy (a store)
// allocates and uploads nothing: its indices ride in the launch (CopyArgs).
#include <cuda_runtime.h>

#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "copy_kernels.h"
#include "paged_copy.h"

namespace shmkv {
namespace {

constexpr int kThreads = 256;

// Copy `bytes` with the whole thread block; 16-byte vectors when both ends
// allow it (payloads and vLLM blocks are 256-byte aligned in practice).
__device__ __forceinline__ void block_copy(uint8_t* __restrict__ dst,
                                           const uint8_t* __restrict__ src, int64_t bytes) {
  bool vec = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src) |
               static_cast<uintptr_t>(bytes)) & 15) == 0;
  if (vec) {
    const uint4* s = reinterpret_cast<const uint4*>(src);
    uint4* d = reinterpret_cast<uint4*>(dst);
    int64_t n = bytes / 16;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) d[i] = s[i];
  } else {
    for (int64_t i = threadIdx.x; i < bytes; i += blockDim.x) dst[i] = src[i];
  }
}

// A single copy's arguments travel by value in its launch (CUDA >= 12.1 takes
// up to 32,764 bytes of kernel parameters on Volta and newer): the layer bases
// [num_layers], then this launch's indices (block ids or slots, as int64 bits).
// Nothing is allocated or uploaded per copy, and nothing waits on the host.
// Two sizes, so that a small copy's launch does not carry 32 KB.
template <int kWords>
struct CopyArgs {
  uint64_t w[kWords];
};
constexpr int kSmallArgWords = 480;   // 3,840 bytes: a 256-token chunk of a 96-layer model
constexpr int kLargeArgWords = 4000;  // 32,000 bytes

// grid: (indices of this launch, layers copied); layer l = l0 + blockIdx.y.
// a: layer bases then ids; index k of this launch is k0 + k of the whole copy
// (n_total indices): payload [layers][n_total][block_bytes]
template <bool kGather, int kWords>
__global__ void copy_blocks_kernel(const CopyArgs<kWords> a, int64_t num_layers, int64_t n_total, int64_t k0,
                                   int64_t block_stride, int64_t block_bytes, uint8_t* __restrict__ payload,
                                   int64_t l0) {
  int64_t k = blockIdx.x, l = l0 + blockIdx.y;
  int64_t id = static_cast<int64_t>(a.w[num_layers + k]);
  uint8_t* blk = reinterpret_cast<uint8_t*>(a.w[l]) + id * block_stride;
  uint8_t* p = payload + (l * n_total + k0 + k) * block_bytes;
  if (kGather) block_copy(p, blk, block_bytes);
  else block_copy(blk, p, block_bytes);
}

// One token of one layer, by the whole thread block: its runs between the
// paged cache (layer at `layer`) and its payload bytes `p` [runs_i][runs_j][run_bytes].
template <bool kGather>
__device__ __forceinline__ void copy_one_token(const PagedLayout& L, uint64_t layer, int64_t slot,
                                               uint8_t* __restrict__ p) {
  int64_t tok_bytes = L.runs_i * L.runs_j * L.run_bytes;
  if (slot < 0) {
    if (kGather)
      for (int64_t i = threadIdx.x; i < tok_bytes; i += blockDim.x) p[i] = 0;
    return;
  }
  uint8_t* tok = reinterpret_cast<uint8_t*>(layer) + (slot / L.block_size) * L.block_stride +
                 (slot % L.block_size) * L.token_stride;
  for (int64_t i = 0; i < L.runs_i; ++i) {
    for (int64_t j = 0; j < L.runs_j; ++j) {
      uint8_t* run = tok + i * L.stride_i + j * L.stride_j;
      uint8_t* q = p + (i * L.runs_j + j) * L.run_bytes;
      if (kGather) block_copy(q, run, L.run_bytes);
      else block_copy(run, q, L.run_bytes);
    }
  }
}

// grid: (tokens of this launch, layers copied); layer l = l0 + blockIdx.y.
// a: layer bases then slots (negative: skipped); token t of this launch is
// k0 + t of the whole copy (n_total): payload [layers][n_total][runs_i][runs_j][run_bytes]
template <bool kGather, int kWords>
__global__ void copy_tokens_kernel(const CopyArgs<kWords> a, int64_t num_layers, int64_t n_total, int64_t k0,
                                   PagedLayout L, uint8_t* __restrict__ payload, int64_t l0) {
  int64_t t = blockIdx.x, l = l0 + blockIdx.y;
  int64_t tok_bytes = L.runs_i * L.runs_j * L.run_bytes;
  int64_t slot = static_cast<int64_t>(a.w[num_layers + t]);
  copy_one_token<kGather>(L, a.w[l], slot, payload + (l * n_total + k0 + t) * tok_bytes);
}

// Launch one copy as launches of at most kWords - num_layers indices each,
// their arguments by value (no device buffer, no upload).
template <int kWords>
cudaError_t launch_by_value(const PagedLayout& L, bool token_mode, bool gather, const int64_t* idx, int64_t n,
                            uint8_t* payload, int64_t l0, int64_t l1, cudaStream_t stream) {
  const int64_t per_launch = kWords - L.num_layers;
  CopyArgs<kWords> a;
  std::memcpy(a.w, L.layer_base, size_t(L.num_layers) * sizeof(uint64_t));
  for (int64_t k0 = 0; k0 < n; k0 += per_launch) {
    int64_t m = n - k0 < per_launch ? n - k0 : per_launch;
    std::memcpy(a.w + L.num_layers, idx + k0, size_t(m) * sizeof(int64_t));
    dim3 grid(unsigned(m), unsigned(l1 - l0));
    if (token_mode) {
      if (gather) copy_tokens_kernel<true, kWords><<<grid, kThreads, 0, stream>>>(a, L.num_layers, n, k0, L, payload, l0);
      else copy_tokens_kernel<false, kWords><<<grid, kThreads, 0, stream>>>(a, L.num_layers, n, k0, L, payload, l0);
    } else {
      int64_t bs = L.block_stride, bb = L.block_bytes;
      if (gather)
        copy_blocks_kernel<true, kWords><<<grid, kThreads, 0, stream>>>(a, L.num_layers, n, k0, bs, bb, payload, l0);
      else
        copy_blocks_kernel<false, kWords><<<grid, kThreads, 0, stream>>>(a, L.num_layers, n, k0, bs, bb, payload, l0);
    }
    cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  return cudaSuccess;
}

// A batch of payloads loaded, one layer: grid (batch tokens); token t's
// payload bytes of layer l at payload0[t] + l * pitch[t] (device addresses).
// slots, payload0, pitch: [n]
__global__ void load_token_batch_kernel(uint64_t layer, const int64_t* __restrict__ slots,
                                        const uint64_t* __restrict__ payload0,
                                        const uint64_t* __restrict__ pitch, PagedLayout L, int64_t l) {
  int64_t t = blockIdx.x;
  copy_one_token</*kGather=*/false>(L, layer, slots[t],
                                    reinterpret_cast<uint8_t*>(payload0[t] + uint64_t(l) * pitch[t]));
}

std::string cuda_error(const char* what, cudaError_t e) {
  return std::string(what) + ": " + cudaGetErrorString(e);
}

// The checks both launchers make before anything is issued: the layer range
// (layer_end -1: to the last, resolved here), every index, the payload size.
Status check_copy(const PagedLayout& L, bool token_mode, const int64_t* idx, int64_t n, uint64_t payload_bytes,
                  int64_t layer_begin, int64_t* layer_end, std::string* err) {
  if (*layer_end < 0) *layer_end = L.num_layers;
  if (layer_begin < 0 || layer_begin >= *layer_end || *layer_end > L.num_layers) {
    *err = "layer range [" + std::to_string(layer_begin) + ", " + std::to_string(*layer_end) +
           ") is not within the " + std::to_string(L.num_layers) + " layers";
    return Status::kInvalidArgument;
  }
  if (L.num_layers >= kLargeArgWords) {  // launch_paged_copy's arguments hold every layer's base
    *err = std::to_string(L.num_layers) + " layers in one layout: at most " + std::to_string(kLargeArgWords - 1) +
           " fit a kernel launch's arguments";
    return Status::kInvalidArgument;
  }
  BlockWindow w;  // whole payload (the connector's CUDA path uses token payloads)
  return token_mode ? check_token_copy(L, idx, n, payload_bytes, err)
                    : check_block_copy(L, idx, n, payload_bytes, &w, err);
}

}  // namespace

Status launch_paged_copy(const PagedLayout& L, bool token_mode, bool gather, const int64_t* idx,
                         int64_t n, uint8_t* payload_host, uint64_t payload_bytes,
                         uintptr_t stream_handle, std::string* err, int64_t layer_begin,
                         int64_t layer_end) {
  Status s = check_copy(L, token_mode, idx, n, payload_bytes, layer_begin, &layer_end, err);
  if (s != Status::kOk) return s;
  if (n == 0) return Status::kOk;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  void* payload_dev = nullptr;
  cudaError_t e = cudaHostGetDevicePointer(&payload_dev, payload_host, 0);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (e == cudaErrorInvalidValue) {
      *err = cuda_error("payload is not registered host memory (cudaHostRegister the segment first)", e);
      return Status::kInvalidArgument;
    }
    *err = cuda_error("cudaHostGetDevicePointer of the payload", e);
    return Status::kSystem;
  }
  // NOTE: the layer bases and indices travel in the launches themselves (CopyArgs)
  auto* p = static_cast<uint8_t*>(payload_dev);
  e = L.num_layers + n <= kSmallArgWords
          ? launch_by_value<kSmallArgWords>(L, token_mode, gather, idx, n, p, layer_begin, layer_end, stream)
          : launch_by_value<kLargeArgWords>(L, token_mode, gather, idx, n, p, layer_begin, layer_end, stream);
  if (e != cudaSuccess) {
    *err = cuda_error("paged copy launch", e);
    return Status::kSystem;
  }
  return Status::kOk;
}

namespace {

// One contiguous copy: device address, payload offset, bytes.
struct Run {
  uint64_t dev;
  uint64_t off;
  uint64_t bytes;
};

// NOTE: copy engines read and write host memory directly only when it is
// page-locked; a pageable payload would be staged by the driver, silently and
// synchronously. Refuse it instead.
Status check_registered(const uint8_t* payload, std::string* err) {
  cudaPointerAttributes a{};
  cudaError_t e = cudaPointerGetAttributes(&a, payload);
  if (e != cudaSuccess) {
    cudaGetLastError();
    *err = cuda_error("cudaPointerGetAttributes of the payload", e);
    return Status::kSystem;
  }
  if (a.type != cudaMemoryTypeHost) {
    *err = "payload is not registered host memory (cudaHostRegister the segment first); memory type " +
           std::to_string(int(a.type));
    return Status::kInvalidArgument;
  }
  return Status::kOk;
}

cudaError_t issue_batch(const std::vector<Run>& runs, bool gather, uint8_t* payload, cudaStream_t stream) {
  std::vector<void*> dsts(runs.size());
  std::vector<const void*> srcs(runs.size());
  std::vector<size_t> sizes(runs.size());
  for (size_t i = 0; i < runs.size(); ++i) {
    void* dev = reinterpret_cast<void*>(runs[i].dev);
    void* host = reinterpret_cast<void*>(reinterpret_cast<uintptr_t>(payload) + runs[i].off);
    dsts[i] = gather ? host : dev;
    srcs[i] = gather ? dev : host;
    sizes[i] = runs[i].bytes;
  }
#if CUDART_VERSION >= 12080
  // NOTE: the batch call refuses the legacy default stream (handle 0): one
  // cudaMemcpyAsync per run there, which it accepts.
  if (stream != nullptr) {
  cudaMemcpyAttributes attr{};
  attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
  attr.flags = cudaMemcpyFlagPreferOverlapWithCompute;
  size_t attr_idx = 0;
#if CUDART_VERSION >= 13000
  cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), runs.size(), &attr, &attr_idx, 1,
                                       stream);
#else
  size_t fail_idx = 0;
  cudaError_t e = cudaMemcpyBatchAsync(dsts.data(), const_cast<void**>(srcs.data()), sizes.data(), runs.size(),
                                       &attr, &attr_idx, 1, &fail_idx, stream);
#endif
  if (e == cudaSuccess) return e;
  cudaGetLastError();  // not supported here (driver, stream kind): one copy per run instead
  }
#endif
  for (size_t i = 0; i < runs.size(); ++i) {
    cudaError_t e2 = cudaMemcpyAsync(dsts[i], srcs[i], sizes[i], cudaMemcpyDefault, stream);
    if (e2 != cudaSuccess) return e2;
  }
  return cudaSuccess;
}

}  // namespace

Status launch_paged_copy_dma(const PagedLayout& L, bool token_mode, bool gather, const int64_t* idx,
                             int64_t n, uint8_t* payload_host, uint64_t payload_bytes,
                             uintptr_t stream_handle, std::string* err, int64_t layer_begin,
                             int64_t layer_end) {
  Status s = check_copy(L, token_mode, idx, n, payload_bytes, layer_begin, &layer_end, err);
  if (s != Status::kOk) return s;
  if (n == 0) return Status::kOk;
  s = check_registered(payload_host, err);
  if (s != Status::kOk) return s;
  std::vector<Run> runs;
  if (!token_mode) {
    for (int64_t l = layer_begin; l < layer_end; ++l)
      for (int64_t k = 0; k < n; ++k) {
        uint64_t dev = L.layer_base[l] + uint64_t(idx[k] * L.block_stride), off = uint64_t((l * n + k) * L.block_bytes);
        if (!runs.empty() && runs.back().dev + runs.back().bytes == dev && runs.back().off + runs.back().bytes == off)
          runs.back().bytes += uint64_t(L.block_bytes);
        else
          runs.push_back(Run{dev, off, uint64_t(L.block_bytes)});
      }
  } else {
    visit_token_runs(
        L, idx, n, layer_begin, layer_end, [&](uint64_t dev, uint64_t off, uint64_t bytes) { runs.push_back(Run{dev, off, bytes}); },
        [&](uint64_t off, uint64_t bytes) {
          if (gather) std::memset(payload_host + off, 0, size_t(bytes));  // host memory: no copy needed
        });
  }
  cudaError_t e = runs.empty() ? cudaSuccess
                               : issue_batch(runs, gather, payload_host, reinterpret_cast<cudaStream_t>(stream_handle));
  if (e != cudaSuccess) {
    *err = cuda_error("copy-engine copy", e);
    cudaGetLastError();
    return Status::kSystem;
  }
  return Status::kOk;
}

// ---- batches: one launch per layer for every payload of a step ----------

BatchBufferPool::~BatchBufferPool() {
  // NOTE: at the layout's end (the engine's shutdown): whatever still runs is the caller's to have waited for
  for (auto& b : free_) {
    cudaFree(b.device);
    cudaFreeHost(b.staging);
    cudaEventDestroy(static_cast<cudaEvent_t>(b.done));
  }
  cudaGetLastError();
}

Status BatchBufferPool::take(size_t bytes, BatchBuffers* out, std::string* err) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < free_.size(); ++i) {
      if (free_[i].bytes < bytes) continue;
      cudaError_t q = cudaEventQuery(static_cast<cudaEvent_t>(free_[i].done));
      if (q == cudaErrorNotReady) continue;  // still read by an earlier step's copies
      cudaGetLastError();
      *out = free_[i];
      free_.erase(free_.begin() + long(i));
      return Status::kOk;
    }
  }
  size_t cap = 4096;
  while (cap < bytes) cap *= 2;
  BatchBuffers b;
  b.bytes = cap;
  cudaEvent_t ev = nullptr;
  cudaError_t e = cudaMalloc(&b.device, cap);
  if (e == cudaSuccess) e = cudaHostAlloc(&b.staging, cap, cudaHostAllocDefault);
  if (e == cudaSuccess) e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
  if (e != cudaSuccess) {
    cudaGetLastError();
    if (b.device) cudaFree(b.device);
    if (b.staging) cudaFreeHost(b.staging);
    *err = cuda_error("allocating a batch's index buffers", e);
    return Status::kSystem;
  }
  b.done = ev;
  std::lock_guard<std::mutex> lock(mu_);
  ++made_;
  *out = b;
  return Status::kOk;
}

void BatchBufferPool::give_back(BatchBuffers b, uintptr_t stream_handle) {
  cudaEventRecord(static_cast<cudaEvent_t>(b.done), reinterpret_cast<cudaStream_t>(stream_handle));
  cudaGetLastError();
  std::lock_guard<std::mutex> lock(mu_);
  free_.push_back(b);
}

size_t BatchBufferPool::size() {
  std::lock_guard<std::mutex> lock(mu_);
  return made_;
}

Status prepare_token_batch(const PagedLayout& L, const std::vector<BatchEntry>& entries, uintptr_t stream_handle,
                           BatchBufferPool& pool, TokenBatch* b, std::string* err) {
  Status s = validate_layout(L, true, err);
  if (s != Status::kOk) return s;
  const int64_t tok_bytes = L.token_payload_bytes();
  TokenBatch out;
  for (size_t e = 0; e < entries.size(); ++e) {
    const BatchEntry& x = entries[e];
    s = check_token_copy(L, x.slots, x.n, x.payload_bytes, err);
    if (s != Status::kOk) {
      *err = "payload " + std::to_string(e) + " of the batch: " + *err;
      return s;
    }
    if (x.n == 0) continue;
    s = check_registered(x.payload_host, err);
    if (s != Status::kOk) return s;
    void* dev = nullptr;
    cudaError_t ce = cudaHostGetDevicePointer(&dev, x.payload_host, 0);
    if (ce != cudaSuccess) {
      cudaGetLastError();
      *err = cuda_error("cudaHostGetDevicePointer of a batch payload", ce);
      return Status::kSystem;
    }
    out.entries.push_back(TokenBatch::Entry{int64_t(out.slots.size()), x.n, x.payload_host});
    for (int64_t t = 0; t < x.n; ++t) {
      out.slots.push_back(x.slots[t]);
      out.dev0.push_back(reinterpret_cast<uint64_t>(dev) + uint64_t(t * tok_bytes));
      out.pitch.push_back(uint64_t(x.n * tok_bytes));
    }
  }
  int64_t n = int64_t(out.slots.size());
  if (n > 0) {
    // NOTE: one upload per batch, stream-ordered; every layer's launch reads the same device arrays
    cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
    size_t bytes = size_t(n) * (sizeof(int64_t) + 2 * sizeof(uint64_t));
    s = pool.take(bytes, &out.buf, err);
    if (s != Status::kOk) return s;
    out.pool = &pool;
    auto* host = static_cast<uint8_t*>(out.buf.staging);
    std::memcpy(host, out.slots.data(), size_t(n) * sizeof(int64_t));
    std::memcpy(host + n * sizeof(int64_t), out.dev0.data(), size_t(n) * sizeof(uint64_t));
    std::memcpy(host + n * (sizeof(int64_t) + sizeof(uint64_t)), out.pitch.data(), size_t(n) * sizeof(uint64_t));
    // NOTE: from page-locked staging the upload is asynchronous (from pageable memory the driver
    // would stage it, the host waiting for the stream's earlier work first)
    cudaError_t ce = cudaMemcpyAsync(out.buf.device, host, bytes, cudaMemcpyHostToDevice, stream);
    if (ce != cudaSuccess) {
      cudaGetLastError();
      release_token_batch(&out, stream_handle);
      *err = cuda_error("uploading the batch", ce);
      return Status::kSystem;
    }
  }
  *b = std::move(out);
  return Status::kOk;
}

namespace {

// The copy engines' runs of layer 0 of every payload (visited once per batch).
void build_runs0(const PagedLayout& L, TokenBatch& b) {
  const int64_t tok_bytes = L.token_payload_bytes();
  const uint64_t base0 = L.layer_base[0];
  b.runs0.clear();
  for (const auto& x : b.entries) {
    auto abs = reinterpret_cast<uint64_t>(x.payload_host);
    uint64_t pitch = uint64_t(x.n * tok_bytes);
    visit_token_runs(
        L, b.slots.data() + x.first, x.n, 0, 1,
        [&](uint64_t dev, uint64_t off, uint64_t bytes) { b.runs0.push_back({dev - base0, abs + off, bytes, pitch}); },
        [](uint64_t, uint64_t) {});
  }
  b.runs_built = true;
}

}  // namespace

Status launch_token_batch(const PagedLayout& L, TokenBatch& b, int64_t layer, uintptr_t stream_handle, bool dma,
                          std::string* err) {
  if (layer < 0 || layer >= L.num_layers) {
    *err = "layer " + std::to_string(layer) + " is not within the " + std::to_string(L.num_layers) + " layers";
    return Status::kInvalidArgument;
  }
  int64_t n = int64_t(b.slots.size());
  if (n == 0) return Status::kOk;
  cudaStream_t stream = reinterpret_cast<cudaStream_t>(stream_handle);
  cudaError_t e;
  if (dma) {
    if (!b.runs_built) build_runs0(L, b);
    std::vector<Run> runs(b.runs0.size());
    const uint64_t base = L.layer_base[layer];
    for (size_t i = 0; i < runs.size(); ++i) {
      const auto& r = b.runs0[i];  // r.dev is relative to layer 0's base (modular: any base order)
      runs[i] = Run{r.dev + base, r.host + uint64_t(layer) * r.pitch, r.bytes};
    }
    e = runs.empty() ? cudaSuccess : issue_batch(runs, /*gather=*/false, nullptr, stream);
  } else {
    auto* d = static_cast<uint8_t*>(b.buf.device);
    auto* slots = reinterpret_cast<const int64_t*>(d);
    auto* dev0 = reinterpret_cast<const uint64_t*>(d + n * sizeof(int64_t));
    auto* pitch = reinterpret_cast<const uint64_t*>(d + n * (sizeof(int64_t) + sizeof(uint64_t)));
    uint64_t base = L.layer_base[layer];
    load_token_batch_kernel<<<unsigned(n), kThreads, 0, stream>>>(base, slots, dev0, pitch, L, layer);
    e = cudaGetLastError();
  }
  if (e != cudaSuccess) {
    cudaGetLastError();
    *err = cuda_error(dma ? "copy-engine batch copy" : "batch copy launch", e);
    return Status::kSystem;
  }
  return Status::kOk;
}

void release_token_batch(TokenBatch* b, uintptr_t stream_handle) {
  if (b->buf.device != nullptr) {
    b->pool->give_back(b->buf, stream_handle);
    b->buf = BatchBuffers{};
  }
  b->slots.clear();
  b->entries.clear();
  b->dev0.clear();
  b->pitch.clear();
  b->runs0.clear();
  b->runs_built = false;
}

Status register_host_memory(void* ptr, uint64_t bytes, std::string* err) {
  cudaError_t e = cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  if (e == cudaErrorHostMemoryAlreadyRegistered) {
    // NOTE: a registration left from an earlier mapping at this address pins
    // pages that are no longer the segment's: drop it and register anew.
    // (shmkv.transfer.gpu counts this process's own registrations, so it is never ours.)
    cudaGetLastError();
    cudaHostUnregister(ptr);
    cudaGetLastError();
    e = cudaHostRegister(ptr, bytes, cudaHostRegisterMapped | cudaHostRegisterPortable);
  }
  if (e != cudaSuccess) {
    *err = cuda_error("cudaHostRegister", e);
    cudaGetLastError();
    return Status::kSystem;
  }
  return Status::kOk;
}

Status unregister_host_memory(void* ptr, std::string* err) {
  cudaError_t e = cudaHostUnregister(ptr);
  if (e != cudaSuccess && e != cudaErrorHostMemoryNotRegistered) {
    *err = cuda_error("cudaHostUnregister", e);
    cudaGetLastError();
    return Status::kSystem;
  }
  cudaGetLastError();
  return Status::kOk;
}

}  // namespace shmkv
