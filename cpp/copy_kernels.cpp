// copy_kernels.cpp — CPU gather/scatter (see copy_kernels.h for the layout).
// NOTE: single-threaded on purpose: on vLLM's CPU backend the worker's OpenMP
// pool owns the cores, and a 2-core host leaves one core for everything else.
// Block copies are long runs (tens to hundreds of KiB), copied with streaming
// stores (stream_copy.h): neither side is read again by this core soon (a
// gathered chunk is read by another process or a tier, a scattered block by
// the forward after the whole load), and memcpy's cached stores first read
// every destination line (about 1.5x the traffic).
#include "copy_kernels.h"

#include <cstring>

#include "stream_copy.h"

namespace shmkv {
namespace {

Status bad(std::string* err, std::string msg) {
  *err = std::move(msg);
  return Status::kInvalidArgument;
}

}  // namespace

Status check_block_copy(const PagedLayout& L, const int64_t* ids, int64_t n, uint64_t payload_bytes,
                        BlockWindow* w, std::string* err) {
  Status s = validate_layout(L, false, err);
  if (s != Status::kOk) return s;
  if (n < 0) return bad(err, "number of blocks must be >= 0");
  for (int64_t k = 0; k < n; ++k) {
    if (ids[k] < 0 || ids[k] >= L.num_blocks)
      return bad(err, "block id " + std::to_string(ids[k]) + " at position " + std::to_string(k) +
                          " is out of range [0, " + std::to_string(L.num_blocks) + ")");
  }
  if (w->payload_blocks < 0) w->payload_blocks = n;
  if (w->layer_end < 0) w->layer_end = L.num_layers;
  if (w->layer_begin < 0 || w->layer_begin > w->layer_end || w->layer_end > L.num_layers)
    return bad(err, "layer range [" + std::to_string(w->layer_begin) + ", " + std::to_string(w->layer_end) +
                        ") is not inside [0, " + std::to_string(L.num_layers) + ")");
  if (w->first < 0 || w->first + n > w->payload_blocks)
    return bad(err, "block window [" + std::to_string(w->first) + ", " + std::to_string(w->first + n) +
                        ") does not fit a payload of " + std::to_string(w->payload_blocks) + " blocks");
  uint64_t want = uint64_t(L.num_layers) * uint64_t(w->payload_blocks) * uint64_t(L.block_bytes);
  if (payload_bytes != want)
    return bad(err, "payload is " + std::to_string(payload_bytes) + " bytes, " +
                        std::to_string(L.num_layers) + " layers x " + std::to_string(w->payload_blocks) +
                        " blocks x " + std::to_string(L.block_bytes) + " bytes = " +
                        std::to_string(want) + " expected");
  return Status::kOk;
}

Status check_token_copy(const PagedLayout& L, const int64_t* slots, int64_t n, uint64_t payload_bytes,
                        std::string* err) {
  Status s = validate_layout(L, true, err);
  if (s != Status::kOk) return s;
  if (n < 0) return bad(err, "number of tokens must be >= 0");
  int64_t max_slot = L.num_blocks * L.block_size;
  for (int64_t k = 0; k < n; ++k) {
    if (slots[k] >= max_slot)
      return bad(err, "slot " + std::to_string(slots[k]) + " at position " + std::to_string(k) +
                          " is out of range [0, " + std::to_string(max_slot) + ")");
  }
  uint64_t want = uint64_t(L.num_layers) * uint64_t(n) * uint64_t(L.token_payload_bytes());
  if (payload_bytes != want)
    return bad(err, "payload is " + std::to_string(payload_bytes) + " bytes, " +
                        std::to_string(L.num_layers) + " layers x " + std::to_string(n) +
                        " tokens x " + std::to_string(L.token_payload_bytes()) + " bytes = " +
                        std::to_string(want) + " expected");
  return Status::kOk;
}

namespace {

// One run of a token copy: streamed from kStreamRunMin bytes (fenced once, at the end of the copy).
template <bool kGather>
inline void copy_run(uint8_t* payload_side, uint8_t* cache_side, size_t n) {
  uint8_t* d = kGather ? payload_side : cache_side;
  const uint8_t* s = kGather ? cache_side : payload_side;
  if (n >= kStreamRunMin)
    stream_copy_unfenced(d, s, n);
  else
    std::memcpy(d, s, n);
}

// Token mode, over visit_token_runs: runs that continue on both sides are merged, so where a
// block's tokens lie back to back (MLA's [blocks, block_size, latent], NHD's token-major heads)
// a 128-token block of MLA is one 144 KiB run, not 128 copies of 1,152 bytes.
template <bool kGather>
void copy_tokens(const PagedLayout& L, const int64_t* slots, int64_t n, uint8_t* payload, int64_t l0,
                 int64_t l1) {
  visit_token_runs(
      L, slots, n, l0, l1,
      [&](uint64_t cache, uint64_t offset, uint64_t bytes) {
        copy_run<kGather>(payload + offset, reinterpret_cast<uint8_t*>(cache), size_t(bytes));
      },
      [&](uint64_t offset, uint64_t bytes) {
        if (kGather) std::memset(payload + offset, 0, size_t(bytes));
      });
  stream_fence();  // every streamed run is ordered before the caller publishes the copy
}

}  // namespace

Status validate_layout(const PagedLayout& L, bool token_mode, std::string* err) {
  if (L.num_layers <= 0 || !L.layer_base) return bad(err, "layout has no layers");
  if (L.num_blocks <= 0) return bad(err, "layout num_blocks must be > 0");
  if (L.block_stride <= 0) return bad(err, "layout block_stride must be > 0");
  if (!token_mode) {
    if (L.block_bytes <= 0 || L.block_bytes > L.block_stride)
      return bad(err, "layout block_bytes must be in (0, block_stride]");
    return Status::kOk;
  }
  if (L.block_size <= 0) return bad(err, "layout block_size must be > 0");
  if (L.run_bytes <= 0 || L.runs_i <= 0 || L.runs_j <= 0 || L.token_stride < 0 || L.stride_i < 0 ||
      L.stride_j < 0)
    return bad(err, "layout token geometry must be positive (run_bytes, runs, strides)");
  // the farthest byte of a token must stay inside its block's reach
  int64_t last = (L.block_size - 1) * L.token_stride + (L.runs_i - 1) * L.stride_i +
                 (L.runs_j - 1) * L.stride_j + L.run_bytes;
  if (L.stride_j == 0 && L.runs_j == 1 && last > L.block_stride)
    return bad(err, "layout token runs reach past the block (" + std::to_string(last) + " > " +
                        std::to_string(L.block_stride) + " bytes)");
  return Status::kOk;
}

Status gather_blocks(const PagedLayout& L, const int64_t* ids, int64_t n, uint8_t* payload,
                     uint64_t payload_bytes, BlockWindow w, std::string* err) {
  Status s = check_block_copy(L, ids, n, payload_bytes, &w, err);
  if (s != Status::kOk) return s;
  for (int64_t l = w.layer_begin; l < w.layer_end; ++l) {
    const uint8_t* layer = reinterpret_cast<const uint8_t*>(L.layer_base[l]);
    uint8_t* p = payload + (l * w.payload_blocks + w.first) * L.block_bytes;
    for (int64_t k = 0; k < n; ++k, p += L.block_bytes)
      stream_copy(p, layer + ids[k] * L.block_stride, size_t(L.block_bytes));
  }
  return Status::kOk;
}

Status scatter_blocks(const PagedLayout& L, const int64_t* ids, int64_t n, const uint8_t* payload,
                      uint64_t payload_bytes, BlockWindow w, std::string* err) {
  Status s = check_block_copy(L, ids, n, payload_bytes, &w, err);
  if (s != Status::kOk) return s;
  for (int64_t l = w.layer_begin; l < w.layer_end; ++l) {
    uint8_t* layer = reinterpret_cast<uint8_t*>(L.layer_base[l]);
    const uint8_t* p = payload + (l * w.payload_blocks + w.first) * L.block_bytes;
    for (int64_t k = 0; k < n; ++k, p += L.block_bytes)
      stream_copy(layer + ids[k] * L.block_stride, p, size_t(L.block_bytes));
  }
  return Status::kOk;
}

Status gather_tokens(const PagedLayout& L, const int64_t* slots, int64_t n, uint8_t* payload,
                     uint64_t payload_bytes, std::string* err, int64_t l0, int64_t l1) {
  Status s = check_token_copy(L, slots, n, payload_bytes, err);
  if (s != Status::kOk) return s;
  if (l1 < 0) l1 = L.num_layers;
  if (l0 < 0 || l0 > l1 || l1 > L.num_layers) return bad(err, "layer range is not inside the layout");
  copy_tokens<true>(L, slots, n, payload, l0, l1);
  return Status::kOk;
}

Status scatter_tokens(const PagedLayout& L, const int64_t* slots, int64_t n,
                      const uint8_t* payload, uint64_t payload_bytes, std::string* err, int64_t l0,
                      int64_t l1) {
  Status s = check_token_copy(L, slots, n, payload_bytes, err);
  if (s != Status::kOk) return s;
  if (l1 < 0) l1 = L.num_layers;
  if (l0 < 0 || l0 > l1 || l1 > L.num_layers) return bad(err, "layer range is not inside the layout");
  copy_tokens<false>(L, slots, n, const_cast<uint8_t*>(payload), l0, l1);
  return Status::kOk;
}

}  // namespace shmkv
