// byte_shuffle.cpp — see byte_shuffle.h. Element sizes 2, 4 and 8 get
// compile-time loops the compiler vectorises; reads stay sequential on one
// side and the planes are written as es sequential streams.
#include "byte_shuffle.h"

#include <cstring>

namespace shmkv {
namespace {

template <size_t ES>
void shuffle_fixed(const uint8_t* __restrict src, uint8_t* __restrict dst, size_t m) {
  for (size_t i = 0; i < m; ++i)
    for (size_t b = 0; b < ES; ++b) dst[b * m + i] = src[i * ES + b];
}

template <size_t ES>
void unshuffle_fixed(const uint8_t* __restrict src, uint8_t* __restrict dst, size_t m) {
  for (size_t i = 0; i < m; ++i)
    for (size_t b = 0; b < ES; ++b) dst[i * ES + b] = src[b * m + i];
}

}  // namespace

void byte_shuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t es) {
  if (es <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  size_t m = n / es;
  switch (es) {
    case 2: shuffle_fixed<2>(src, dst, m); break;
    case 4: shuffle_fixed<4>(src, dst, m); break;
    case 8: shuffle_fixed<8>(src, dst, m); break;
    default:
      for (size_t i = 0; i < m; ++i)
        for (size_t b = 0; b < es; ++b) dst[b * m + i] = src[i * es + b];
  }
  std::memcpy(dst + m * es, src + m * es, n - m * es);
}

void byte_unshuffle(const uint8_t* src, uint8_t* dst, size_t n, size_t es) {
  if (es <= 1) {
    std::memcpy(dst, src, n);
    return;
  }
  size_t m = n / es;
  switch (es) {
    case 2: unshuffle_fixed<2>(src, dst, m); break;
    case 4: unshuffle_fixed<4>(src, dst, m); break;
    case 8: unshuffle_fixed<8>(src, dst, m); break;
    default:
      for (size_t i = 0; i < m; ++i)
        for (size_t b = 0; b < es; ++b) dst[i * es + b] = src[b * m + i];
  }
  std::memcpy(dst + m * es, src + m * es, n - m * es);
}

}  // namespace shmkv
