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

// The input checks that bindings.cpp's chains and bindings_norms.cpp's norms share (the modulate's operands, the gated
// residual's, a row index and its table). The Python guard admits only inputs that pass these checks; they stay here
// so that a direct call with bad input raises instead of reading out of bounds.
inline void check_modulate_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                           const at::Tensor& shift, bool fp32_rows = false) {
  TORCH_CHECK(x.is_cuda(), "modulate_scale_shift: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 3, "modulate_scale_shift: x must be [batch, seq, dim], got ", shape_str(x.sizes()));
  const int64_t batch = x.size(0), dim = x.size(2);
  const int64_t vec = 16 / x.element_size();
  to_dtype(x);
  const int64_t row_vec = 16 / scale.element_size();  // fp32 rows (the LayerNorm's fp32 modulate) stay aligned too
  for (const at::Tensor* t : {&out, &scale, &shift}) {
    TORCH_CHECK(t->scalar_type() == (fp32_rows && t != &out ? at::kFloat : x.scalar_type()),
                "modulate_scale_shift: dtype mismatch");
    TORCH_CHECK(t->device() == x.device(), "modulate_scale_shift: device mismatch");
    TORCH_CHECK(aligned16(*t), "modulate_scale_shift: pointers must be 16-byte aligned");
  }
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && x.is_contiguous(),
              "modulate_scale_shift: x and out must be contiguous and of one shape");
  TORCH_CHECK(aligned16(x) && dim % vec == 0, "modulate_scale_shift: dim must be a multiple of ", std::to_string(vec));
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == dim && (t->size(0) == batch || t->size(0) == 1),
                "modulate_scale_shift: scale/shift must be [batch or 1, dim], got ", shape_str(t->sizes()));
    TORCH_CHECK(t->stride(1) == 1, "modulate_scale_shift: scale/shift must have unit innermost stride");
    TORCH_CHECK(t->size(0) == 1 || t->stride(0) % row_vec == 0,
                "modulate_scale_shift: scale/shift batch stride must keep rows 16-byte aligned");
  }
}

inline void check_gated_residual_inputs(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                                 const at::Tensor& update, bool table = false) {
  TORCH_CHECK(residual.is_cuda(), "gated_residual: residual must be a CUDA tensor");
  TORCH_CHECK(residual.dim() == 3, "gated_residual: residual must be [batch, seq, dim], got ",
              shape_str(residual.sizes()));
  const int64_t batch = residual.size(0), seq = residual.size(1), dim = residual.size(2);
  const int64_t vec = 16 / residual.element_size();
  const int64_t gate_vec = 16 / gate.element_size();  // an fp32 gate (Wan's chain) keeps its rows 16-byte aligned
  to_dtype(residual);
  for (const at::Tensor* t : {&out, &gate, &update}) {
    TORCH_CHECK(t->scalar_type() == residual.scalar_type() || (t == &gate && t->scalar_type() == at::kFloat),
                "gated_residual: dtype mismatch (the gate may be float32)");
    TORCH_CHECK(t->device() == residual.device(), "gated_residual: device mismatch");
  }
  for (const at::Tensor* t : {&out, &residual, &gate, &update}) {
    TORCH_CHECK(aligned16(*t), "gated_residual: pointers must be 16-byte aligned");
  }
  TORCH_CHECK(out.sizes() == residual.sizes() && update.sizes() == residual.sizes() && out.is_contiguous() &&
                  residual.is_contiguous() && update.is_contiguous(),
              "gated_residual: out, residual and update must be contiguous and of one shape");
  TORCH_CHECK(dim % vec == 0, "gated_residual: dim must be a multiple of ", std::to_string(vec));
  // table: the indexed form's [1, rows, dim] view of a [rows, dim] table (any number of rows)
  TORCH_CHECK(gate.dim() == 3 && gate.size(2) == dim && (gate.size(0) == batch || gate.size(0) == 1) &&
                  (gate.size(1) == seq || gate.size(1) == 1 || (table && gate.size(0) == 1)),
              "gated_residual: gate must be [batch or 1, seq or 1, dim], got ", shape_str(gate.sizes()));
  TORCH_CHECK(gate.stride(2) == 1 && (gate.size(0) == 1 || gate.stride(0) % gate_vec == 0) &&
                  (gate.size(1) == 1 || gate.stride(1) % gate_vec == 0),
              "gated_residual: gate rows must have unit innermost stride and stay 16-byte aligned");
}

// Indexed rows (gated_residual_rows, layernorm_modulate_rows): an int32 [batch, seq] index on x's device, contiguous;
// its values (rows of the tables) are the caller's to keep in range: they are built from a mask, never read here.
inline void check_row_index(const at::Tensor& index, const at::Tensor& x, const char* op) {
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 2 && index.size(0) == x.size(0) &&
                  index.size(1) == x.size(1) && index.is_contiguous() && index.device() == x.device(),
              op, ": index must be a contiguous int32 [batch, seq] tensor on x's device");
}

// A [rows, dim] table as the [1, rows, dim] rows whose seq stride is the table's row stride (the indexed form's).
inline at::Tensor table_rows(const at::Tensor& table, const char* op) {
  TORCH_CHECK(table.dim() == 2, op, ": the table must be [rows, dim], got ", shape_str(table.sizes()));
  return table.unsqueeze(0);
}

}  // namespace
}  // namespace diffusers_fastpath
