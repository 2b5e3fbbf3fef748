// byte_shuffle.h — byte-plane shuffle for the disk/remote chunk format:
// [n elements][es bytes] <-> [es planes][n bytes]; a tail shorter than one
// element is copied as is. (Format defined in shmkv/disk/format.py.)
#pragma once

#include <cstddef>
#include <cstdint>

namespace shmkv {

void byte_shuffle(const uint8_t* src, uint8_t* dst, size_t nbytes, size_t element_size);
void byte_unshuffle(const uint8_t* src, uint8_t* dst, size_t nbytes, size_t element_size);

}  // namespace shmkv
