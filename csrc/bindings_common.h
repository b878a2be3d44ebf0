// What the bindings*.cpp files share: torch's headers, fastpath.h, and the dtype and message helpers of their input
// checks (each file's own copy: internal linkage, inline).
#pragma once
#include <limits>

#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

inline DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return DType::kHalf;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "diffusers_fastpath: expected float16 or bfloat16, got ", t.scalar_type());
  }
}

// to_dtype, and fp32: the VAEs' copies, bias adds and channel norms (conv_bias.cu, causal_pad.cu, upsample_nearest.cu,
// channel_rmsnorm_silu.cu, per_channel_rmsnorm.cu) take it.
inline DType to_dtype_or_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? DType::kFloat32 : to_dtype(t);
}

// The checks' messages format numbers with std::to_string, never through an ostream: on the H200 image (torch 2.11
// cu130, this file built by g++ 13.3) every failed check whose message streamed an integer or a shape (c10::str)
// segfaulted instead of raising, while those streaming only text raised (a num_put facet of another libstdc++ than
// the headers' is the likely cause). tests/test_bindings_gpu.py calls each op with bad input in a subprocess.
inline std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

inline bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

}  // namespace
}  // namespace diffusers_fastpath
