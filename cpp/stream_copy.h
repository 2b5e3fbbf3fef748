// stream_copy.h — copying whole chunks between the segment and a process's
// own buffers (Table.read_chunks / write_chunks / put / get_into), and the
// runs of the paged gather/scatter (copy_kernels.cpp).
//
// A chunk copied here is not read again by the copying core soon: the reader
// is another process, vLLM's DMA engine or a later request. Above
// kStreamCopyMin bytes the stores therefore bypass the cache (x86-64
// non-temporal stores): no read-for-ownership of the destination and no
// eviction of the working set, about 1.5x the bandwidth of memcpy for 256 KiB
// chunks on 4 KiB tmpfs pages: 32-byte streaming stores where the CPU has
// AVX2 (asked once at run time; every x86-64 server CPU since 2013), memcpy
// on the others.
// Invariant: stream_copy's copy is complete and ordered before it returns
// (sfence), so a commit or release that follows publishes whole bytes; a
// caller of stream_copy_unfenced (many small runs) calls stream_fence() once
// after the last run, before anything that publishes them. Elsewhere (other
// ISAs, x86-64 without AVX2, small copies) it is memcpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <immintrin.h>
#define SHMKV_STREAM_COPY 1
#endif

namespace shmkv {

constexpr size_t kStreamCopyMin = 64 << 10;
// the paged copies' runs (a token's heads, one head of a token, a block) stream from this size on:
// whole cache lines, several per run, so the write-combining buffers fill
constexpr size_t kStreamRunMin = 256;

#ifdef SHMKV_STREAM_COPY
namespace detail {

__attribute__((target("avx2"))) inline void stream_avx2(uint8_t* d, const uint8_t* s, size_t n) {
  size_t head = (32 - (reinterpret_cast<uintptr_t>(d) & 31)) & 31;  // align the destination
  if (head > n) head = n;
  std::memcpy(d, s, head);
  d += head;
  s += head;
  n -= head;
  size_t i = 0;
  for (; i + 128 <= n; i += 128) {
    __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i));
    __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 32));
    __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 64));
    __m256i e = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s + i + 96));
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i), a);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 32), b);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 64), c);
    _mm256_stream_si256(reinterpret_cast<__m256i*>(d + i + 96), e);
  }
  std::memcpy(d + i, s + i, n - i);
}

inline bool has_avx2() {
  static const bool yes = __builtin_cpu_supports("avx2");
  return yes;
}

}  // namespace detail
#endif

// Streams `n` bytes (any size, any alignment) without the closing fence: see stream_fence().
inline void stream_copy_unfenced(void* dst, const void* src, size_t n) {
#ifdef SHMKV_STREAM_COPY
  auto* d = static_cast<uint8_t*>(dst);
  const auto* s = static_cast<const uint8_t*>(src);
  if (detail::has_avx2())
    detail::stream_avx2(d, s, n);
  else
    std::memcpy(d, s, n);
#else
  std::memcpy(dst, src, n);
#endif
}

// Orders every streamed store before what this thread does next.
inline void stream_fence() {
#ifdef SHMKV_STREAM_COPY
  _mm_sfence();
#endif
}

inline void stream_copy(void* dst, const void* src, size_t n) {
  if (n < kStreamCopyMin) {
    std::memcpy(dst, src, n);
    return;
  }
  stream_copy_unfenced(dst, src, n);
  stream_fence();
}

}  // namespace shmkv
