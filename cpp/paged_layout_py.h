// paged_layout_py.h — one reading of a copy geometry from Python, for both
// extension modules (shmkv._C and shmkv._C_cuda): the geometry is one object,
// shmkv.layout.LayoutGeometry, whose field names are the PagedLayout fields
// (copy_kernels.h). Included by binding files only (it needs pybind11).
#pragma once

#include <pybind11/pybind11.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "copy_kernels.h"

namespace shmkv {

// A PagedLayout over `bases` (which must outlive it) from a geometry object.
inline PagedLayout paged_layout_from(const pybind11::handle& geometry, const std::vector<uint64_t>& bases,
                                     bool* token_mode) {
  auto field = [&](const char* name) { return geometry.attr(name).cast<int64_t>(); };
  PagedLayout L;
  L.num_layers = int64_t(bases.size());
  L.layer_base = bases.data();
  L.num_blocks = field("num_blocks");
  L.block_stride = field("block_stride");
  L.block_bytes = field("block_bytes");
  L.block_size = field("block_size");
  L.token_stride = field("token_stride");
  L.runs_i = field("runs_i");
  L.stride_i = field("stride_i");
  L.runs_j = field("runs_j");
  L.stride_j = field("stride_j");
  L.run_bytes = field("run_bytes");
  *token_mode = geometry.attr("token_mode").cast<bool>();
  return L;
}

}  // namespace shmkv
