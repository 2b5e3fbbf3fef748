// paged_copy.h — host-side launchers of the CUDA gather/scatter (paged_copy.cu).
#pragma once

#include <cstdint>
#include <mutex>
#include <string>
#include <vector>

#include "copy_kernels.h"
#include "status.h"

namespace shmkv {

// Validates every index and the payload size on the host (nothing launched on
// failure), then copies between the device KV cache described by L (layer
// bases are device addresses) and `payload_host`, a host pointer inside memory
// registered with register_host_memory. Asynchronous on `stream_handle`
// (a cudaStream_t as an integer; 0 = the legacy default stream). Only layers
// [layer_begin, layer_end) are copied (layer_end -1: to the last); the
// payload keeps its full [layers] shape, as on the CPU (BlockWindow).
Status launch_paged_copy(const PagedLayout& L, bool token_mode, bool gather, const int64_t* idx,
                         int64_t n, uint8_t* payload_host, uint64_t payload_bytes,
                         uintptr_t stream_handle, std::string* err, int64_t layer_begin = 0,
                         int64_t layer_end = -1);

// The same copy by the GPU's copy engines instead of kernels: one DMA per
// contiguous run (adjacent runs merged), issued in bulk with
// cudaMemcpyBatchAsync (CUDA >= 12.8; else one cudaMemcpyAsync per run). It
// holds no SMs, so it overlaps compute fully (vLLM's own offloading moves
// GPU->CPU this way). On the legacy default stream (0), which the batch call
// refuses, one cudaMemcpyAsync per run. The payload must be page-locked
// (registered) host memory: a pageable one is refused, never staged.
// Token slots < 0: gathered as zeros, skipped by a scatter.
Status launch_paged_copy_dma(const PagedLayout& L, bool token_mode, bool gather, const int64_t* idx,
                             int64_t n, uint8_t* payload_host, uint64_t payload_bytes,
                             uintptr_t stream_handle, std::string* err, int64_t layer_begin = 0,
                             int64_t layer_end = -1);

// A batch of token payloads copied layer by layer with one launch per layer
// (a step's loads): the indices and payload addresses are checked and
// uploaded once (prepare), then each layer is one kernel or one batched DMA
// (launch), and the buffers go back to their pool stream-ordered (release).
//
// Per step nothing is allocated, freed or synchronized once a layout's pool
// has grown to its steps' size: the index travels through a page-locked
// staging buffer (an upload from pageable memory would make the host wait for
// the stream's earlier work), into a device array the pool keeps; a buffer
// pair is taken again only once the event recorded at its release completed.
// The copy engines' run list is built once per batch, from layer 0 (every
// layer of a layout has one geometry), and shifted per layer.
struct BatchBuffers {
  void* device = nullptr;   // slots | dev0 | pitch, read by the kernels
  void* staging = nullptr;  // the same, page-locked, read by the upload
  size_t bytes = 0;         // capacity of each
  void* done = nullptr;     // cudaEvent_t: recorded at release
};
class BatchBufferPool {
 public:
  BatchBufferPool() = default;
  BatchBufferPool(const BatchBufferPool&) = delete;
  BatchBufferPool& operator=(const BatchBufferPool&) = delete;
  ~BatchBufferPool();
  // A pair of at least `bytes` whose last use has completed, or a new one.
  Status take(size_t bytes, BatchBuffers* out, std::string* err);
  // Back to the pool once the work queued on `stream_handle` has passed it.
  void give_back(BatchBuffers b, uintptr_t stream_handle);
  size_t size();  // buffer pairs the pool has made (tests: reused, not made per step)

 private:
  std::mutex mu_;
  std::vector<BatchBuffers> free_;
  size_t made_ = 0;
};
struct BatchEntry {
  const int64_t* slots;   // [n] slots of this payload's tokens (negative: skipped)
  int64_t n;
  uint8_t* payload_host;  // [layers][n][token bytes], in registered host memory
  uint64_t payload_bytes;
};
struct TokenBatch {
  struct Entry {
    int64_t first;          // its first token in `slots`
    int64_t n;
    uint8_t* payload_host;  // [layers][n][token bytes]
  };
  // One copy-engine run of layer 0; layer l's is (dev - layer_base[0] + layer_base[l], host + l * pitch).
  struct Run0 {
    uint64_t dev;
    uint64_t host;
    uint64_t bytes;
    uint64_t pitch;  // the payload's bytes per layer
  };
  std::vector<Entry> entries;
  std::vector<int64_t> slots;   // [tokens of the batch]
  std::vector<uint64_t> dev0;   // the same, as a device address
  std::vector<uint64_t> pitch;  // bytes from one layer's payload bytes to the next
  BatchBuffers buf;             // slots | dev0 | pitch on the device (buf.device)
  BatchBufferPool* pool = nullptr;  // where buf goes back
  std::vector<Run0> runs0;      // built at the first copy-engine launch
  bool runs_built = false;
};
Status prepare_token_batch(const PagedLayout& L, const std::vector<BatchEntry>& entries, uintptr_t stream_handle,
                           BatchBufferPool& pool, TokenBatch* b, std::string* err);
// One layer of every payload, payload -> cache (a batch is a step's loads).
Status launch_token_batch(const PagedLayout& L, TokenBatch& b, int64_t layer, uintptr_t stream_handle, bool dma,
                          std::string* err);
void release_token_batch(TokenBatch* b, uintptr_t stream_handle);

// Pin (and map for the device) a host range, e.g. a whole shmkv segment; a
// stale registration at the same address is replaced.
Status register_host_memory(void* ptr, uint64_t bytes, std::string* err);
Status unregister_host_memory(void* ptr, std::string* err);

}  // namespace shmkv
