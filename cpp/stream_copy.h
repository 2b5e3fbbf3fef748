// stream_copy.h — copying whole chunks between the segment and a process's
// own buffers (Table.read_chunks / write_chunks / put / get_into).
//
// A chunk copied here is not read again by the copying core soon: the reader
// is another process, vLLM's DMA engine or a later request. Above
// kStreamCopyMin bytes the stores therefore bypass the cache (x86-64
// non-temporal stores): no read-for-ownership of the destination and no
// eviction of the working set, about 1.5x the bandwidth of memcpy for 256 KiB
// chunks on 4 KiB tmpfs pages. Invariant: the copy is complete and ordered
// before the function returns (sfence), so a commit or release that follows
// publishes whole bytes. Elsewhere (other ISAs, small copies) it is memcpy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

#if defined(__x86_64__) || defined(_M_X64)
#include <emmintrin.h>
#define SHMKV_STREAM_COPY 1
#endif

namespace shmkv {

constexpr size_t kStreamCopyMin = 64 << 10;

inline void stream_copy(void* dst, const void* src, size_t n) {
#ifdef SHMKV_STREAM_COPY
  if (n >= kStreamCopyMin) {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    size_t head = (16 - (reinterpret_cast<uintptr_t>(d) & 15)) & 15;  // align the destination
    std::memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t i = 0;
    for (; i + 64 <= n; i += 64) {
      __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i));
      __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 16));
      __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 32));
      __m128i e = _mm_loadu_si128(reinterpret_cast<const __m128i*>(s + i + 48));
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i), a);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 16), b);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 32), c);
      _mm_stream_si128(reinterpret_cast<__m128i*>(d + i + 48), e);
    }
    _mm_sfence();  // the streamed stores are visible before anything this thread does next
    std::memcpy(d + i, s + i, n - i);
    return;
  }
#endif
  std::memcpy(dst, src, n);
}

}  // namespace shmkv
