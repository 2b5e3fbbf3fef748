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
