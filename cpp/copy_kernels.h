// copy_kernels.h — paged-KV gather/scatter between vLLM's per-layer paged KV
// caches and one contiguous chunk payload (CPU side; cuda/paged_copy.cu is the
// GPU twin and uses the same PagedLayout).
//
// A PagedLayout describes one KV-cache group of any vLLM attention layout by
// byte geometry alone (the core never links torch):
//   layer l, block b                  at layer_base[l] + b * block_stride
//   token t of block b (token mode)   at ... + t * token_stride
//   inside a token: runs_i x runs_j contiguous runs of run_bytes, run (i, j)
//                   at token + i * stride_i + j * stride_j
// Two copy granularities:
//   * block mode: whole blocks of block_bytes (layouts opaque inside a block,
//     e.g. vLLM's CPU backend). Payload = [layer][block_in_chunk][block_bytes].
//   * token mode: per-token runs (layouts whose token structure is known).
//     Payload = [layer][token][i][j][run_bytes], independent of block size.
//     Examples (es = element size, H = kv heads, D = head size, N = block size):
//       NHD [B,N,H,2D]:       runs 1x1 of H*2D*es, token_stride H*2D*es
//       HND [B,H,N,2D]:       runs Hx1 of 2D*es, stride_i N*2D*es, token_stride 2D*es
//       K/V split [2,B,N,H,D]: runs Hx2 of D*es, stride_i D*es, stride_j = K->V plane
//       MLA [B,N,L]:          runs 1x1 of L*es
// Every index is validated before the first byte moves; a bad call changes
// nothing and returns kInvalidArgument with a message.
#pragma once

#include <cstdint>
#include <string>

#include "status.h"

namespace shmkv {

struct PagedLayout {
  int64_t num_layers = 0;
  const uint64_t* layer_base = nullptr;  // [num_layers] addresses
  int64_t num_blocks = 0;                // blocks per layer
  int64_t block_stride = 0;              // bytes between consecutive blocks
  int64_t block_bytes = 0;               // block mode: bytes copied per block
  int64_t block_size = 0;                // tokens per block
  int64_t token_stride = 0;              // token mode
  int64_t runs_i = 1, stride_i = 0;
  int64_t runs_j = 1, stride_j = 0;
  int64_t run_bytes = 0;

  int64_t token_payload_bytes() const { return runs_i * runs_j * run_bytes; }
};

// Block mode may copy a window of a payload holding payload_blocks blocks per
// layer: block k of the copy is the payload's block (first + k) of each layer.
struct BlockWindow {
  int64_t first = 0;
  int64_t payload_blocks = -1;  // -1: n
  // Only layers [layer_begin, layer_end) are copied (layer-wise pipelining);
  // the payload keeps its full [layers] shape.
  int64_t layer_begin = 0;
  int64_t layer_end = -1;       // -1: all layers
};

// Visits the contiguous runs of a token-mode copy of layers [l0, l1) (the
// payload [layers][n][token bytes] at offset 0): emit(cache_address,
// payload_offset, bytes) once per maximal run, adjacent runs merged when both
// the cache and the payload continue; skip(payload_offset, bytes) for each
// negative slot. What a copy-engine copy issues, and how the engine choice
// sizes it (a fragmented block table or a head-major layout gives short runs).
template <class Emit, class Skip>
void visit_token_runs(const PagedLayout& L, const int64_t* slots, int64_t n, int64_t l0, int64_t l1, Emit emit,
                      Skip skip) {
  const int64_t tok_bytes = L.token_payload_bytes();
  uint64_t cur_dev = 0, cur_off = 0, cur_bytes = 0;
  auto add = [&](uint64_t dev, uint64_t off, uint64_t bytes) {
    if (cur_bytes && cur_dev + cur_bytes == dev && cur_off + cur_bytes == off) {
      cur_bytes += bytes;
      return;
    }
    if (cur_bytes) emit(cur_dev, cur_off, cur_bytes);
    cur_dev = dev, cur_off = off, cur_bytes = bytes;
  };
  for (int64_t l = l0; l < l1; ++l) {
    uint64_t base = L.layer_base[l];
    for (int64_t t = 0; t < n; ++t) {
      uint64_t p = uint64_t((l * n + t) * tok_bytes);
      int64_t slot = slots[t];
      if (slot < 0) {
        skip(p, uint64_t(tok_bytes));
        continue;
      }
      uint64_t tok = base + uint64_t((slot / L.block_size) * L.block_stride + (slot % L.block_size) * L.token_stride);
      for (int64_t i = 0; i < L.runs_i; ++i)
        for (int64_t j = 0; j < L.runs_j; ++j)
          add(tok + uint64_t(i * L.stride_i + j * L.stride_j), p + uint64_t((i * L.runs_j + j) * L.run_bytes),
              uint64_t(L.run_bytes));
    }
  }
  if (cur_bytes) emit(cur_dev, cur_off, cur_bytes);
}

// Checks that make a layout usable at all (sizes positive, runs inside blocks).
Status validate_layout(const PagedLayout& L, bool token_mode, std::string* err);
// Full pre-copy checks (layout, every index, payload size); shared with CUDA.
Status check_block_copy(const PagedLayout& L, const int64_t* block_ids, int64_t n,
                        uint64_t payload_bytes, BlockWindow* w, std::string* err);
Status check_token_copy(const PagedLayout& L, const int64_t* slots, int64_t n,
                        uint64_t payload_bytes, std::string* err);

// block_ids: [n] block indices into every layer.
// payload: [layers][payload_blocks][block_bytes] (BlockWindow above), so a
// load can fill a sub-range of a stored chunk; the default copies it whole.
Status gather_blocks(const PagedLayout& L, const int64_t* block_ids, int64_t n, uint8_t* payload,
                     uint64_t payload_bytes, BlockWindow w, std::string* err);
Status scatter_blocks(const PagedLayout& L, const int64_t* block_ids, int64_t n,
                      const uint8_t* payload, uint64_t payload_bytes, BlockWindow w, std::string* err);

// slots: [n] slot = block * block_size + offset; negative slots are skipped
// (gather leaves zeros in their place). payload: [layers][n][token_payload_bytes].
Status gather_tokens(const PagedLayout& L, const int64_t* slots, int64_t n, uint8_t* payload,
                     uint64_t payload_bytes, std::string* err, int64_t layer_begin = 0,
                     int64_t layer_end = -1);
Status scatter_tokens(const PagedLayout& L, const int64_t* slots, int64_t n,
                      const uint8_t* payload, uint64_t payload_bytes, std::string* err,
                      int64_t layer_begin = 0, int64_t layer_end = -1);

}  // namespace shmkv
