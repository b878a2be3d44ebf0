// Registers the CUDA kernels as torch operators in the `diffusers_fastpath` namespace (`_*_cuda` and their
// `_out` variants, see TORCH_LIBRARY_FRAGMENT below). These are the raw CUDA entry points; the public,
// device-generic ops (with their fake implementations for torch.compile) are defined in Python, one file per op
// in ops/; eager calls reach these directly to skip the Python custom-op layer (see ops/modulate_scale_shift.py
// for the numbers).
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

DType to_dtype(const at::Tensor& t) {
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
DType to_dtype_or_float(const at::Tensor& t) {
  return t.scalar_type() == at::kFloat ? DType::kFloat32 : to_dtype(t);
}

// The checks' messages format numbers with std::to_string, never through an ostream: on the H200 image (torch 2.11
// cu130, this file built by g++ 13.3) every failed check whose message streamed an integer or a shape (c10::str)
// segfaulted instead of raising, while those streaming only text raised (a num_put facet of another libstdc++ than
// the headers' is the likely cause). tests/test_bindings_gpu.py calls each op with bad input in a subprocess.
std::string shape_str(at::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad
// input raises instead of reading out of bounds.
void check_modulate_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
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

void modulate_scale_shift_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                              const at::Tensor& shift) {
  check_modulate_inputs(out, x, scale, shift);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  ModulateScaleShiftArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.scale = scale.data_ptr();
  args.shift = shift.data_ptr();
  args.batch = x.size(0);
  args.seq = x.size(1);
  args.dim = x.size(2);
  args.scale_batch_stride = scale.size(0) == 1 ? 0 : scale.stride(0);
  args.shift_batch_stride = shift.size(0) == 1 ? 0 : shift.stride(0);
  args.dtype = to_dtype(x);
  const cudaError_t err = launch_modulate_scale_shift(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "modulate_scale_shift: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor modulate_scale_shift(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  modulate_scale_shift_out(out, x, scale, shift);
  return out;
}

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad
// input raises instead of reading out of bounds.
void check_gated_residual_inputs(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                                 const at::Tensor& update) {
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
  TORCH_CHECK(gate.dim() == 3 && gate.size(2) == dim && (gate.size(0) == batch || gate.size(0) == 1) &&
                  (gate.size(1) == seq || gate.size(1) == 1),
              "gated_residual: gate must be [batch or 1, seq or 1, dim], got ", shape_str(gate.sizes()));
  TORCH_CHECK(gate.stride(2) == 1 && (gate.size(0) == 1 || gate.stride(0) % gate_vec == 0) &&
                  (gate.size(1) == 1 || gate.stride(1) % gate_vec == 0),
              "gated_residual: gate rows must have unit innermost stride and stay 16-byte aligned");
}

void gated_residual_out(at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                        const at::Tensor& update) {
  check_gated_residual_inputs(out, residual, gate, update);
  if (residual.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(residual.device());
  GatedResidualArgs args;
  args.out = out.data_ptr();
  args.residual = residual.data_ptr();
  args.gate = gate.data_ptr();
  args.update = update.data_ptr();
  args.batch = residual.size(0);
  args.seq = residual.size(1);
  args.dim = residual.size(2);
  args.gate_batch_stride = gate.size(0) == 1 ? 0 : gate.stride(0);
  args.gate_seq_stride = gate.size(1) == 1 ? 0 : gate.stride(1);
  args.dtype = to_dtype(residual);
  args.gate_fp32 = gate.scalar_type() == at::kFloat;
  const cudaError_t err = launch_gated_residual(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "gated_residual: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor gated_residual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& update) {
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  gated_residual_out(out, residual, gate, update);
  return out;
}

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad input
// raises instead of reading out of bounds.
at::Tensor cat_heads(const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_cuda(), "cat_heads: a must be a CUDA tensor");
  TORCH_CHECK(a.dim() == 4 && b.dim() == 4 && a.size(0) == b.size(0) && a.size(1) == b.size(1) &&
                  a.size(3) == b.size(3),
              "cat_heads: a and b must be [batch, heads, seq, dim] of one batch, heads and dim, got ",
              shape_str(a.sizes()), " and ", shape_str(b.sizes()));
  const int64_t vec = 16 / a.element_size();
  to_dtype(a);
  for (const at::Tensor* t : {&a, &b}) {
    TORCH_CHECK(t->scalar_type() == a.scalar_type(), "cat_heads: dtype mismatch");
    TORCH_CHECK(t->device() == a.device(), "cat_heads: device mismatch");
    TORCH_CHECK(aligned16(*t), "cat_heads: pointers must be 16-byte aligned");
    TORCH_CHECK(t->size(3) % vec == 0 && t->stride(3) == 1 && t->stride(2) % vec == 0 && t->stride(1) % vec == 0 &&
                    t->stride(0) % vec == 0,
                "cat_heads: rows must have unit innermost stride, stay 16-byte aligned and hold whole vectors");
  }
  at::Tensor out = at::empty({a.size(0), a.size(1), a.size(2) + b.size(2), a.size(3)}, a.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(a.device());
  CatHeadsArgs args;
  args.out = out.data_ptr();
  args.a = a.data_ptr();
  args.b = b.data_ptr();
  args.batch = a.size(0);
  args.heads = a.size(1);
  args.seq_a = a.size(2);
  args.seq_b = b.size(2);
  args.dim = a.size(3);
  args.a_stride_b = a.stride(0);
  args.a_stride_h = a.stride(1);
  args.a_stride_s = a.stride(2);
  args.b_stride_b = b.stride(0);
  args.b_stride_h = b.stride(1);
  args.b_stride_s = b.stride(2);
  args.dtype = to_dtype(a);
  const cudaError_t err = launch_cat_heads(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "cat_heads: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

void check_silu_mul_inputs(const at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.is_cuda(), "silu_mul: gate must be a CUDA tensor");
  TORCH_CHECK(gate.dim() == 3 && up.sizes() == gate.sizes() && out.sizes() == gate.sizes(),
              "silu_mul: gate, up and out must be [batch, seq, dim] of one shape, got ",
              shape_str(gate.sizes()), " and ", shape_str(up.sizes()));
  const int64_t vec = 16 / gate.element_size();
  to_dtype(gate);
  for (const at::Tensor* t : {&out, &gate, &up}) {
    TORCH_CHECK(t->scalar_type() == gate.scalar_type(), "silu_mul: dtype mismatch");
    TORCH_CHECK(t->device() == gate.device(), "silu_mul: device mismatch");
    TORCH_CHECK(aligned16(*t), "silu_mul: pointers must be 16-byte aligned");
    TORCH_CHECK(t->size(2) % vec == 0 && t->stride(2) == 1 && t->stride(1) % vec == 0 && t->stride(0) % vec == 0,
                "silu_mul: rows must have unit innermost stride, stay 16-byte aligned and hold whole vectors");
  }
  TORCH_CHECK((out.size(1) == 1 || out.stride(1) >= out.size(2)) &&
                  (out.size(0) == 1 || out.stride(0) >= out.size(1) * out.stride(1)),
              "silu_mul: out rows must not overlap");
}

void silu_mul_out(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul_inputs(out, gate, up);
  if (gate.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(gate.device());
  SiluMulArgs args;
  args.out = out.data_ptr();
  args.gate = gate.data_ptr();
  args.up = up.data_ptr();
  args.batch = gate.size(0);
  args.seq = gate.size(1);
  args.dim = gate.size(2);
  args.gate_stride_b = gate.stride(0);
  args.gate_stride_s = gate.stride(1);
  args.up_stride_b = up.stride(0);
  args.up_stride_s = up.stride(1);
  args.out_stride_b = out.stride(0);
  args.out_stride_s = out.stride(1);
  args.dtype = to_dtype(gate);
  const cudaError_t err = launch_silu_mul(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "silu_mul: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  silu_mul_out(out, gate, up);
  return out;
}

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad
// input raises instead of reading out of bounds.
void check_gelu_cat_inputs(const at::Tensor& out, const at::Tensor& attn, const at::Tensor& mlp) {
  TORCH_CHECK(attn.is_cuda(), "gelu_cat: attn must be a CUDA tensor");
  TORCH_CHECK(attn.dim() == 3 && mlp.dim() == 3 && attn.size(0) == mlp.size(0) && attn.size(1) == mlp.size(1),
              "gelu_cat: attn and mlp must be [batch, seq, dim] of one batch and seq, got ", shape_str(attn.sizes()),
              " and ", shape_str(mlp.sizes()));
  const int64_t vec = 16 / attn.element_size();
  to_dtype(attn);
  for (const at::Tensor* t : {&out, &mlp}) {
    TORCH_CHECK(t->scalar_type() == attn.scalar_type(), "gelu_cat: dtype mismatch");
    TORCH_CHECK(t->device() == attn.device(), "gelu_cat: device mismatch");
  }
  TORCH_CHECK(out.dim() == 3 && out.size(0) == attn.size(0) && out.size(1) == attn.size(1) &&
                  out.size(2) == attn.size(2) + mlp.size(2) && out.is_contiguous(),
              "gelu_cat: out must be [batch, seq, attn dim + mlp dim] and contiguous");
  for (const at::Tensor* t : {&out, &attn, &mlp}) {
    TORCH_CHECK(aligned16(*t), "gelu_cat: pointers must be 16-byte aligned");
  }
  for (const at::Tensor* t : {&attn, &mlp}) {
    TORCH_CHECK(t->size(2) % vec == 0, "gelu_cat: dims must be multiples of ", std::to_string(vec));
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) % vec == 0 && t->stride(0) % vec == 0,
                "gelu_cat: rows must have unit innermost stride and stay 16-byte aligned");
  }
}

void gelu_cat_out(at::Tensor& out, const at::Tensor& attn, const at::Tensor& mlp) {
  check_gelu_cat_inputs(out, attn, mlp);
  if (out.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(attn.device());
  GeluCatArgs args;
  args.out = out.data_ptr();
  args.attn = attn.data_ptr();
  args.mlp = mlp.data_ptr();
  args.batch = attn.size(0);
  args.seq = attn.size(1);
  args.attn_dim = attn.size(2);
  args.mlp_dim = mlp.size(2);
  args.attn_stride_b = attn.stride(0);
  args.attn_stride_s = attn.stride(1);
  args.mlp_stride_b = mlp.stride(0);
  args.mlp_stride_s = mlp.stride(1);
  args.dtype = to_dtype(attn);
  const cudaError_t err = launch_gelu_cat(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "gelu_cat: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor gelu_cat(const at::Tensor& attn, const at::Tensor& mlp) {
  TORCH_CHECK(attn.dim() == 3 && mlp.dim() == 3, "gelu_cat: attn and mlp must be [batch, seq, dim]");
  at::Tensor out = at::empty({attn.size(0), attn.size(1), attn.size(2) + mlp.size(2)}, attn.options());
  gelu_cat_out(out, attn, mlp);
  return out;
}

Rows rows_of(const at::Tensor& t) {
  return Rows{t.data_ptr(), t.stride(0), t.stride(1)};
}

// The Python guard admits [seq, batch, dim] operands with unit innermost stride, row strides that keep rows
// 8-byte aligned, dim a multiple of 128 and one dtype; these checks keep a direct call with bad input from
// reading out of bounds.
void check_rows(const at::Tensor& t, const at::Tensor& like, const char* name) {
  TORCH_CHECK(t.scalar_type() == like.scalar_type() && t.device() == like.device(), "rmsnorm_scale_shift: ", name,
              " must match x in dtype and device");
  TORCH_CHECK(t.dim() == 3 && t.sizes() == like.sizes() && t.stride(2) == 1, "rmsnorm_scale_shift: ", name,
              " must be [seq, batch, dim] with unit innermost stride");
  TORCH_CHECK(t.stride(0) % 4 == 0 && t.stride(1) % 4 == 0 && reinterpret_cast<uintptr_t>(t.data_ptr()) % 8 == 0,
              "rmsnorm_scale_shift: ", name, " rows must be 8-byte aligned");
}

// One launcher for every variant: `update` given is ERNIE-Image's gated prologue (with `gate` and `residual_out`);
// `scale`/`shift`/`gate`/`residual` are the epilogue's operands (fastpath.h's RmsEpilogue says which it reads).
void rmsnorm_launch(at::Tensor& out, const std::optional<at::Tensor>& residual_out, const at::Tensor& x,
                    const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& update,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& residual,
                    RmsEpilogue epilogue, double eps, Rows freqs = Rows{nullptr, 0, 0}, int64_t heads = 1,
                    int64_t tokens = 1, Rows sin = Rows{nullptr, 0, 0}) {
  TORCH_CHECK(x.is_cuda(), "rmsnorm_scale_shift: x must be a CUDA tensor");
  check_rows(x, x, "x");
  const int64_t dim = x.size(2);
  // rows shorter than 128: aten's scalar reduction order (see rmsnorm_scale_shift.cu), not for the gated prologue
  TORCH_CHECK(dim % 128 == 0 || (!update.has_value() && dim >= 32 && dim < 128 && dim % 4 == 0),
              "rmsnorm_scale_shift: dim must be a multiple of 128 (or, not gated, a multiple of 4 in [32, 128))");
  TORCH_CHECK(weight.has_value() || epilogue == RmsEpilogue::kModulate,
              "rmsnorm_scale_shift: only the modulate epilogue takes a norm without weight");
  TORCH_CHECK(!weight.has_value() || (weight->dim() == 1 && weight->size(0) == dim && weight->is_contiguous() &&
                                      weight->scalar_type() == x.scalar_type() && weight->device() == x.device() &&
                                      reinterpret_cast<uintptr_t>(weight->data_ptr()) % 8 == 0),
              "rmsnorm_scale_shift: weight must be a contiguous, 8-byte aligned [dim] vector of x's dtype");
  const std::pair<const std::optional<at::Tensor>*, const char*> operands[] = {
      {&scale, "scale"}, {&shift, "shift"}, {&gate, "gate"}, {&update, "update"}, {&residual, "residual"}};
  for (const auto& [t, name] : operands) {
    if (t->has_value()) check_rows(**t, x, name);
  }
  check_rows(out, x, "out");
  TORCH_CHECK(out.is_contiguous(), "rmsnorm_scale_shift: out must be contiguous");
  const bool gated = update.has_value();
  if (gated) {
    check_rows(*residual_out, x, "residual_out");
    TORCH_CHECK(residual_out->is_contiguous(), "rmsnorm_scale_shift: residual_out must be contiguous");
  }
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const auto rows_or_none = [](const std::optional<at::Tensor>& t) { return t ? rows_of(*t) : Rows{nullptr, 0, 0}; };
  RmsNormScaleShiftArgs args;
  args.out = out.data_ptr();
  args.residual_out = gated ? residual_out->data_ptr() : nullptr;
  args.x = rows_of(x);
  args.gate = rows_or_none(gate);
  args.update = rows_or_none(update);
  args.scale = rows_or_none(scale);
  args.shift = rows_or_none(shift);
  args.residual = rows_or_none(residual);
  args.freqs = freqs;
  args.sin = sin;
  args.heads = heads;
  args.tokens = tokens;
  args.weight = weight.has_value() ? weight->data_ptr() : nullptr;
  args.seq = x.size(0);
  args.batch = x.size(1);
  args.dim = dim;
  args.eps = static_cast<float>(eps);  // the Python scalar eps, as the eager add's opmath (float) sees it
  const int64_t rows = args.seq * args.batch;
  // aten's MeanOps factor: static_cast<float>(num_output_elements) / numel (an int64, converted to float)
  args.mean_factor = static_cast<float>(rows) / static_cast<float>(rows * dim);
  args.gated = gated;
  args.dtype = to_dtype(x);
  args.epilogue = epilogue;
  const cudaError_t err = launch_rmsnorm_scale_shift(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rmsnorm_scale_shift: kernel launch failed: ", cudaGetErrorString(err));
}

void rmsnorm_scale_shift_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                             const at::Tensor& shift, double eps) {
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, scale, shift, std::nullopt,
                 RmsEpilogue::kScaleShift, eps);
}

at::Tensor rmsnorm_scale_shift(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                               const at::Tensor& shift, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_scale_shift_out(out, x, weight, scale, shift, eps);
  return out;
}

void gated_rmsnorm_scale_shift_out(at::Tensor& residual_out, at::Tensor& out, const at::Tensor& residual,
                                   const at::Tensor& gate, const at::Tensor& update, const at::Tensor& weight,
                                   const at::Tensor& scale, const at::Tensor& shift, double eps) {
  rmsnorm_launch(out, residual_out, residual, gate, update, weight, scale, shift, std::nullopt,
                 RmsEpilogue::kScaleShift, eps);
}

std::tuple<at::Tensor, at::Tensor> gated_rmsnorm_scale_shift(const at::Tensor& residual, const at::Tensor& gate,
                                                             const at::Tensor& update, const at::Tensor& weight,
                                                             const at::Tensor& scale, const at::Tensor& shift,
                                                             double eps) {
  at::Tensor residual_out = at::empty(residual.sizes(), residual.options());
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  gated_rmsnorm_scale_shift_out(residual_out, out, residual, gate, update, weight, scale, shift, eps);
  return {residual_out, out};
}

void rmsnorm_scale_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                       double eps) {
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, scale, std::nullopt, std::nullopt,
                 RmsEpilogue::kScale, eps);
}

at::Tensor rmsnorm_scale(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_scale_out(out, x, weight, scale, eps);
  return out;
}

// LTX-Video's RMSNorm + modulate: norm(x) * (1 + scale) + shift, all in x's dtype, per-token scale/shift rows.
void rmsnorm_modulate_out(at::Tensor& out, const at::Tensor& x, const std::optional<at::Tensor>& weight,
                          const at::Tensor& scale, const at::Tensor& shift, double eps) {
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, scale, shift, std::nullopt,
                 RmsEpilogue::kModulate, eps);
}

at::Tensor rmsnorm_modulate(const at::Tensor& x, const std::optional<at::Tensor>& weight, const at::Tensor& scale,
                            const at::Tensor& shift, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_modulate_out(out, x, weight, scale, shift, eps);
  return out;
}

void rmsnorm_gated_residual_out(at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                                const at::Tensor& x, const at::Tensor& weight, double eps) {
  rmsnorm_launch(out, std::nullopt, x, gate, std::nullopt, weight, std::nullopt, std::nullopt, residual,
                 RmsEpilogue::kGatedResidual, eps);
}

at::Tensor rmsnorm_gated_residual(const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& x,
                                  const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_gated_residual_out(out, residual, gate, x, weight, eps);
  return out;
}

// Qwen-Image's QK norm + complex rotary: x the [batch * tokens * heads, 1, dim] rows of a contiguous
// [batch, tokens, heads, dim] q or k; freqs the float32 view of the complex64 [batch or 1, tokens, dim / 2] factors
// ([..., dim] floats, pairs adjacent), or the float64 view of complex128 ones (Lumina2's: kRopeComplex128).
void rmsnorm_rope_complex_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& freqs,
                              int64_t heads, int64_t tokens, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && heads > 0 && tokens > 0 && x.size(0) % (heads * tokens) == 0,
              "rmsnorm_rope_complex: x must be [batch * tokens * heads, 1, dim]");
  const int64_t batch = x.size(0) / (heads * tokens);
  const bool wide = freqs.scalar_type() == at::kDouble;
  TORCH_CHECK(freqs.is_cuda() && freqs.device() == x.device() && (wide || freqs.scalar_type() == at::kFloat) &&
                  freqs.dim() == 3 && (freqs.size(0) == 1 || freqs.size(0) == batch) && freqs.size(1) == tokens &&
                  freqs.size(2) == x.size(2) && freqs.stride(2) == 1 && freqs.stride(1) % 2 == 0 &&
                  freqs.stride(0) % 2 == 0 && reinterpret_cast<uintptr_t>(freqs.data_ptr()) % (wide ? 16 : 8) == 0,
              "rmsnorm_rope_complex: freqs must be the float32 (float64) [batch or 1, tokens, dim] view of complex64 "
              "(complex128) pairs");
  const Rows pairs{freqs.data_ptr(), freqs.stride(1) / 2, freqs.size(0) == 1 ? 0 : freqs.stride(0) / 2};
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, std::nullopt, std::nullopt, std::nullopt,
                 wide ? RmsEpilogue::kRopeComplex128 : RmsEpilogue::kRopeComplex, eps, pairs, heads, tokens);
}

at::Tensor rmsnorm_rope_complex(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& freqs, int64_t heads,
                                int64_t tokens, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_rope_complex_out(out, x, weight, freqs, heads, tokens, eps);
  return out;
}

// HunyuanVideo-1.5's QK norm + real rotary: x as for rmsnorm_rope_complex; cos and sin the float32 [tokens, dim]
// tables of diffusers' apply_rotary_emb (contiguous, 16-byte aligned).
void rmsnorm_rope_real_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                           const at::Tensor& sin, int64_t heads, int64_t tokens, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.size(1) == 1 && heads > 0 && tokens > 0 && x.size(0) % (heads * tokens) == 0,
              "rmsnorm_rope_real: x must be [batch * tokens * heads, 1, dim]");
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->is_cuda() && t->device() == x.device() && t->scalar_type() == at::kFloat && t->dim() == 2 &&
                    t->size(0) == tokens && t->size(1) == x.size(2) && t->is_contiguous() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "rmsnorm_rope_real: cos and sin must be contiguous, 16-byte aligned float32 [tokens, dim] tables");
  }
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, std::nullopt, std::nullopt, std::nullopt,
                 RmsEpilogue::kRopeReal, eps, Rows{cos.data_ptr(), cos.stride(0), 0}, heads, tokens,
                 Rows{sin.data_ptr(), sin.stride(0), 0});
}

at::Tensor rmsnorm_rope_real(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& cos,
                             const at::Tensor& sin, int64_t heads, int64_t tokens, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_rope_real_out(out, x, weight, cos, sin, heads, tokens, eps);
  return out;
}

// SD3's QK norm alone: x the [rows, 1, dim] rows of a q or k (the Python op views any dense layout so).
at::Tensor rmsnorm_plain(const at::Tensor& x, const at::Tensor& weight, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, std::nullopt, std::nullopt, std::nullopt,
                 RmsEpilogue::kPlain, eps);
  return out;
}

// The Python guard admits the modulate's layout (checked by check_modulate_inputs, whose messages name that op)
// with dim at most 6144, the widest row the kernel keeps in registers; fp32 scale/shift rows select the fp32
// modulate (layernorm_scale_shift_fp32, Wan's chain).
void layernorm_scale_shift_launch(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                                  const at::Tensor& shift, double eps, bool probe, int64_t variant,
                                  bool affine = false, at::Tensor* x_out = nullptr, const at::Tensor* gate = nullptr,
                                  const at::Tensor* update = nullptr, int64_t scale_seq_stride = 0,
                                  int64_t shift_seq_stride = 0, const at::Tensor* norm_weight = nullptr,
                                  const at::Tensor* norm_bias = nullptr, bool no_shift = false) {
  const bool modulate_fp32 = scale.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  check_modulate_inputs(out, x, scale, shift, modulate_fp32);
  TORCH_CHECK(x.size(2) % 4 == 0 && x.size(2) <= 6144,
              "layernorm_scale_shift: dim must be a multiple of 4, at most 6144");
  TORCH_CHECK(x.size(0) * x.size(1) <= std::numeric_limits<int32_t>::max(), "layernorm_scale_shift: too many rows");
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  LayerNormScaleShiftArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.scale = scale.data_ptr();
  args.shift = shift.data_ptr();
  args.batch = x.size(0);
  args.seq = x.size(1);
  args.dim = x.size(2);
  args.scale_batch_stride = scale.size(0) == 1 ? 0 : scale.stride(0);
  args.shift_batch_stride = shift.size(0) == 1 ? 0 : shift.stride(0);
  args.eps = static_cast<float>(eps);  // aten's LayerNormKernelImpl: static_cast<acc_t>(eps)
  args.variant = static_cast<int>(variant);
  args.probe = probe;
  args.dtype = to_dtype(x);
  args.modulate_fp32 = modulate_fp32;
  args.affine = affine;
  TORCH_CHECK(!affine || (modulate_fp32 && scale.size(0) == 1 && shift.size(0) == 1),
              "layernorm_affine_fp32: weight and bias must be float32 rows");
  args.gated = x_out != nullptr;
  args.x_out = nullptr;
  args.gate = nullptr;
  args.update = nullptr;
  args.gate_batch_stride = 0;
  args.scale_seq_stride = scale_seq_stride;
  args.shift_seq_stride = shift_seq_stride;
  if (no_shift) args.shift = nullptr;  // layernorm_modulate without a shift: `shift` stood for the scale in the checks
  args.norm_weight = norm_weight != nullptr ? norm_weight->data_ptr() : nullptr;
  args.norm_bias = norm_bias != nullptr ? norm_bias->data_ptr() : nullptr;
  if (args.gated) {  // x is the residual (gated_layernorm_scale_shift)
    check_gated_residual_inputs(*x_out, x, *gate, *update);
    TORCH_CHECK(!modulate_fp32 && gate->scalar_type() == x.scalar_type() && gate->size(1) == 1,
                "gated_layernorm_scale_shift: the gate must be [batch or 1, 1, dim] rows of x's dtype, and scale/shift "
                "of x's dtype");
    args.x_out = x_out->data_ptr();
    args.gate = gate->data_ptr();
    args.update = update->data_ptr();
    args.gate_batch_stride = gate->size(0) == 1 ? 0 : gate->stride(0);
  }
  const cudaError_t err = launch_layernorm_scale_shift(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "layernorm_scale_shift: kernel launch failed: ", cudaGetErrorString(err));
}

void layernorm_scale_shift_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                               double eps) {
  layernorm_scale_shift_launch(out, x, scale, shift, eps, /*probe=*/false, 0);
}

at::Tensor layernorm_scale_shift(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift, double eps) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  layernorm_scale_shift_out(out, x, scale, shift, eps);
  return out;
}

// FLUX's gated residual update and the LayerNorm-modulate of the new stream: (x, out) with x = residual + gate * update.
void gated_layernorm_scale_shift_out(at::Tensor& x_out, at::Tensor& out, const at::Tensor& residual,
                                     const at::Tensor& gate, const at::Tensor& update, const at::Tensor& scale,
                                     const at::Tensor& shift, double eps) {
  layernorm_scale_shift_launch(out, residual, scale, shift, eps, /*probe=*/false, 0, /*affine=*/false, &x_out, &gate,
                               &update);
}

std::tuple<at::Tensor, at::Tensor> gated_layernorm_scale_shift(const at::Tensor& residual, const at::Tensor& gate,
                                                               const at::Tensor& update, const at::Tensor& scale,
                                                               const at::Tensor& shift, double eps) {
  at::Tensor x_out = at::empty(residual.sizes(), residual.options());
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  gated_layernorm_scale_shift_out(x_out, out, residual, gate, update, scale, shift, eps);
  return {x_out, out};
}

// Wan's norm2: an FP32LayerNorm with weight and bias of the upcast stream, rounded back (x fp16/bf16 [batch, seq, dim];
// weight and bias its float32 [dim] vectors).
at::Tensor layernorm_affine_fp32(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, double eps) {
  TORCH_CHECK(weight.dim() == 1 && bias.dim() == 1, "layernorm_affine_fp32: weight and bias must be [dim] vectors");
  at::Tensor out = at::empty(x.sizes(), x.options());
  layernorm_scale_shift_launch(out, x, weight.unsqueeze(0), bias.unsqueeze(0), eps, /*probe=*/false, 0,
                               /*affine=*/true);
  return out;
}

// FLUX.3's per-token adaLN rows and the LayerNorms with their own affine (layernorm_modulate): scale/shift
// [batch or 1, seq or 1, dim] rows of x's dtype (unit innermost stride, 16-byte aligned rows); weight and bias the
// norm's fp32 [dim] rows (aten's gamma and beta as it reads them), or both absent; no shift: the scale-only modulate
// `norm(x) * (1 + scale)` (Qwen-Image 2.1).
at::Tensor layernorm_modulate(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& shift_opt,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              double eps) {
  const bool no_shift = !(shift_opt.has_value() && shift_opt->defined());
  const at::Tensor& shift = no_shift ? scale : *shift_opt;
  TORCH_CHECK(x.dim() == 3 && scale.dim() == 3 && shift.dim() == 3,
              "layernorm_modulate: x and scale/shift must be [batch, seq, dim] tensors");
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "layernorm_modulate: scale/shift must be of x's dtype");
    TORCH_CHECK((t->size(0) == x.size(0) || t->size(0) == 1) && (t->size(1) == x.size(1) || t->size(1) == 1) &&
                    t->size(2) == x.size(2),
                "layernorm_modulate: scale/shift must be [batch or 1, seq or 1, dim], got ", shape_str(t->sizes()));
    TORCH_CHECK(t->size(1) == 1 || t->stride(1) % (16 / t->element_size()) == 0,
                "layernorm_modulate: scale/shift seq stride must keep rows 16-byte aligned");
  }
  const bool affine = weight.has_value() && weight->defined();
  TORCH_CHECK(affine == (bias.has_value() && bias->defined()), "layernorm_modulate: weight and bias, both or neither");
  if (affine) {
    for (const at::Tensor* t : {&*weight, &*bias}) {
      TORCH_CHECK(t->scalar_type() == at::kFloat && t->dim() == 1 && t->size(0) == x.size(2) && t->is_contiguous() &&
                      aligned16(*t) && t->device() == x.device(),
                  "layernorm_modulate: weight and bias must be contiguous, 16-byte aligned float32 [dim] rows");
    }
  }
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (x.numel() == 0) return out;
  const int64_t scale_seq = scale.size(1) == 1 ? 0 : scale.stride(1), shift_seq = shift.size(1) == 1 ? 0 : shift.stride(1);
  layernorm_scale_shift_launch(out, x, scale.select(1, 0), shift.select(1, 0), eps, /*probe=*/false, 0,
                               /*affine=*/false, nullptr, nullptr, nullptr, scale_seq, shift_seq,
                               affine ? &*weight : nullptr, affine ? &*bias : nullptr, no_shift);
  return out;
}

// tools/layernorm_order_probe.py: the same kernel with a reduction variant chosen at run time.
at::Tensor layernorm_scale_shift_probe(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                       double eps, int64_t variant) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  layernorm_scale_shift_launch(out, x, scale, shift, eps, /*probe=*/true, variant);
  return out;
}

// The Python guards admit [batch, seq, heads, dim] sources with unit innermost stride and 8-byte aligned rows, fp32
// cos/sin [seq, dim] (or, for rotary_emb_rows, [batch or 1, seq, heads * dim]) contiguous and 16-byte aligned, dim a
// multiple of 4 (at most 128 with norm); these checks keep a direct call with bad input from reading out of bounds.
RotarySource rotary_source(const at::Tensor& x, const at::Tensor& img, const std::optional<at::Tensor>& weight,
                           double eps, const char* name, bool norm_rows = false, bool float_weight = false) {
  TORCH_CHECK(x.dim() == 4 && x.size(0) == img.size(0) && x.size(2) == img.size(2) && x.size(3) == img.size(3),
              "rotary: ", name, " must be [batch, seq, heads, dim] like the image part, got ", shape_str(x.sizes()));
  TORCH_CHECK(x.scalar_type() == img.scalar_type() && x.device() == img.device(), "rotary: ", name,
              " must match the image part in dtype and device");
  TORCH_CHECK(x.stride(3) == 1 && x.stride(0) % 4 == 0 && x.stride(1) % 4 == 0 && x.stride(2) % 4 == 0 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
              "rotary: ", name, " rows must have unit innermost stride and be 8-byte aligned");
  RotarySource src{x.data_ptr(), x.stride(0), x.stride(1), x.stride(2), x.size(1), nullptr, 0.f};
  if (weight.has_value()) {
    const at::Tensor& w = *weight;
    TORCH_CHECK(w.dim() == 1 && w.size(0) == (norm_rows ? x.size(2) * x.size(3) : x.size(3)) && w.is_contiguous() &&
                    w.scalar_type() == (float_weight ? at::kFloat : x.scalar_type()) && w.device() == x.device() &&
                    reinterpret_cast<uintptr_t>(w.data_ptr()) % (float_weight ? 16 : 8) == 0,
                "rotary: the RMSNorm weight must be a contiguous, 8-byte aligned [dim] (row norm: [heads * dim]) "
                "vector of x's dtype (norm_fp32, norm_f32w: 16-byte aligned float32)");
    src.weight = w.data_ptr();
    src.eps = static_cast<float>(eps);  // aten's static_cast<acc_t>(eps) of the module's Python float
  }
  return src;
}

// Writes into `out` ([batch, seq_txt + seq_img, heads, dim], contiguous), or allocates it when `out` is undefined.
// With norm_rows and x_txt, the row norm's pair (qk_norm_rows_rope_pair): x_img is q, x_txt is k of the same shape,
// each with its own weight, one [batch or 1, seq, heads * dim] pair of tables; out [2, batch, seq, heads, dim].
at::Tensor rotary_launch(at::Tensor out, const std::optional<at::Tensor>& x_txt,
                         const std::optional<at::Tensor>& weight_txt, double eps_txt, const at::Tensor& x_img,
                         const std::optional<at::Tensor>& weight_img, double eps_img, const at::Tensor& cos,
                         const at::Tensor& sin, bool norm, bool wan = false, bool norm_rows = false,
                         int64_t norm_final = 0, bool norm_fp32 = false, bool norm_f32w = false) {
  TORCH_CHECK(x_img.is_cuda(), "rotary: x must be a CUDA tensor");
  TORCH_CHECK(x_img.dim() == 4, "rotary: x must be [batch, seq, heads, dim], got ", shape_str(x_img.sizes()));
  const int64_t dim = x_img.size(3);
  TORCH_CHECK(dim % 4 == 0 && (!norm || dim <= 128), "rotary: dim must be a multiple of 4",
              norm ? " and at most 128" : "");
  RotaryArgs args;
  args.dtype = to_dtype(x_img);
  TORCH_CHECK(!(norm_fp32 || norm_f32w) || (norm && !(norm_fp32 && norm_f32w)),
              "rotary: norm_fp32 or norm_f32w goes with norm");
  const bool float_weight = norm_fp32 || norm_f32w;
  args.img = rotary_source(x_img, x_img, weight_img, eps_img, "x", norm_rows, float_weight);
  args.txt = x_txt.has_value() ? rotary_source(*x_txt, x_img, weight_txt, eps_txt, "x_txt", norm_rows, float_weight)
                               : RotarySource{nullptr, 0, 0, 0, 0, nullptr, 0.f};
  const bool pair = norm_rows && x_txt.has_value();
  TORCH_CHECK(!pair || (weight_txt.has_value() && args.txt.seq == args.img.seq),
              "rotary: the row norm's pair takes q and k of one shape, each with its weight");
  const int64_t seq = pair ? args.img.seq : args.txt.seq + args.img.seq;
  const int64_t heads = x_img.size(2);
  // [seq, dim] (one table for every head and sample) or, without norm or text, [batch or 1, seq, heads * dim] rows
  const bool rows = cos.dim() == 3;
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK(t->scalar_type() == at::kFloat && t->device() == x_img.device() && t->is_contiguous() &&
                    t->dim() == cos.dim() && t->sizes() == cos.sizes() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 16 == 0,
                "rotary: cos/sin must be contiguous, 16-byte aligned float32 tables of one shape on x's device");
  }
  if (rows) {
    TORCH_CHECK(!norm && (!x_txt.has_value() || pair) && (cos.size(0) == 1 || cos.size(0) == x_img.size(0)) &&
                    cos.size(1) == seq && cos.size(2) == heads * dim,
                "rotary: [batch or 1, seq, heads * dim] cos/sin take one source (or the row norm's pair) without norm");
  } else {
    TORCH_CHECK(cos.dim() == 2 && cos.size(0) == seq && cos.size(1) == dim, "rotary: cos/sin must be [seq, dim]");
  }
  args.cos_stride_b = rows && cos.size(0) != 1 ? seq * heads * dim : 0;
  args.cos_stride_s = rows ? heads * dim : dim;
  args.cos_stride_h = rows ? dim : 0;
  std::vector<int64_t> shape{x_img.size(0), seq, x_img.size(2), dim};
  if (pair) shape.insert(shape.begin(), 2);
  if (out.defined()) {
    TORCH_CHECK(out.sizes() == at::IntArrayRef(shape) && out.is_contiguous() &&
                    out.scalar_type() == x_img.scalar_type() && out.device() == x_img.device() &&
                    reinterpret_cast<uintptr_t>(out.data_ptr()) % 8 == 0,
                "rotary: out must be a contiguous, 8-byte aligned [batch, seq, heads, dim] (the pair: [2, ...]) tensor "
                "like x");
  } else {
    out = at::empty(shape, x_img.options());
  }
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x_img.device());
  args.out = out.data_ptr();
  args.cos = cos.data_ptr<float>();
  args.sin = sin.data_ptr<float>();
  args.batch = x_img.size(0);
  args.heads = heads;
  args.dim = dim;
  args.norm = norm;
  args.wan = wan;
  args.norm_rows = norm_rows;
  args.norm_fp32 = norm_fp32;
  args.norm_f32w = norm_f32w;
  args.norm_final = static_cast<int32_t>(norm_final);
  TORCH_CHECK(!wan || (!norm && !rows && !x_txt.has_value()), "rotary: Wan's pairing takes one source and one table");
  TORCH_CHECK(!norm_rows || (!norm && weight_img.has_value() && (wan || rows) && norm_final >= 0 && norm_final <= 2),
              "rotary: the row norm takes one source (or q and k) with its weight and LTX-Video's or Wan's tables");
  TORCH_CHECK(!norm_rows || (heads * dim <= (pair ? 4096 : 8192) && (!wan || 512 % dim == 0)),
              "rotary: the row norm takes rows of at most 8192 elements (the pair: 4096; Wan's: of heads whose dim "
              "divides 512)");
  const cudaError_t err = launch_rotary(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rotary: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor rotary_emb(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_launch(at::Tensor(), std::nullopt, std::nullopt, 0.0, x, std::nullopt, 0.0, cos, sin, false);
}

void rotary_emb_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(out.defined(), "rotary_emb: out must be defined");
  rotary_launch(out, std::nullopt, std::nullopt, 0.0, x, std::nullopt, 0.0, cos, sin, false);
}

// LTX-Video's rotary over [batch, seq, C] rows with [batch or 1, seq, C] tables: the rotary kernel over the rows
// split into heads of `head_dim` (the Python op's choice; every pair is computed on its own, any split is the same).
at::Tensor rotary_emb_rows(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin, int64_t head_dim) {
  TORCH_CHECK(x.dim() == 3 && head_dim > 0 && head_dim % 4 == 0 && x.size(2) % head_dim == 0,
              "rotary_emb_rows: x must be [batch, seq, C] with C a multiple of head_dim (a multiple of 4), got ",
              shape_str(x.sizes()));
  const at::Tensor heads = x.unflatten(2, {x.size(2) / head_dim, head_dim});
  return rotary_launch(at::Tensor(), std::nullopt, std::nullopt, 0.0, heads, std::nullopt, 0.0, cos, sin, false)
      .flatten(2);
}

// Wan's rotary (rotary.cu's rotate_pair_wan): x [batch, seq, heads, dim], cos/sin its [1, seq, 1, dim] tables as
// [seq, dim] views.
at::Tensor rotary_emb_wan(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotary_launch(at::Tensor(), std::nullopt, std::nullopt, 0.0, x, std::nullopt, 0.0, cos, sin, false, true);
}

// LTX-Video's and Wan's QK norm + rotary: torch.nn.RMSNorm(heads * dim) of each row of x [batch, seq, heads, dim]
// (the Python op's split of LTX-Video's [batch, seq, C] rows, Wan's heads), then LTX-Video's rotary ([batch or 1, seq,
// heads * dim] tables) or, with `wan`, Wan's ([seq, dim] views of its [1, seq, 1, dim] tables); `norm_final` the row
// norm's mean square (rotary.cu's kFinal*).
at::Tensor qk_norm_rows_rope(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                             const at::Tensor& sin, bool wan, int64_t norm_final) {
  return rotary_launch(at::Tensor(), std::nullopt, std::nullopt, 0.0, x, weight, eps, cos, sin, /*norm=*/false, wan,
                       /*norm_rows=*/true, norm_final);
}

// LTX-Video's q and k together (rotary.cu's row-norm pair): each [batch, seq, heads, dim] with its own RMSNorm weight
// [heads * dim] and eps, one [batch or 1, seq, heads * dim] pair of tables; returns [2, batch, seq, heads, dim] (q's
// result, then k's).
at::Tensor qk_norm_rows_rope_pair(const at::Tensor& q, const at::Tensor& weight_q, double eps_q, const at::Tensor& k,
                                  const at::Tensor& weight_k, double eps_k, const at::Tensor& cos,
                                  const at::Tensor& sin, int64_t norm_final) {
  return rotary_launch(at::Tensor(), k, weight_k, eps_k, q, weight_q, eps_q, cos, sin, /*norm=*/false, /*wan=*/false,
                       /*norm_rows=*/true, norm_final);
}

// Krea 2's zero-centred pre-norm (zero_centred_rmsnorm): F.rms_norm(x.float(), (C,), weight=w, eps=eps).to(x.dtype)
// of each row of x [rows, C] (contiguous, 8-byte aligned, C a multiple of 4 up to 8192), w the float32 [C] weight the
// module's forward computes (its weight + 1.0): rotary.cu's row norm without a rotary (kNoRotary), `norm_final` its
// mean square (kFinal*).
at::Tensor zero_centred_rmsnorm(const at::Tensor& x, const at::Tensor& weight, double eps, int64_t norm_final) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 2 && x.is_contiguous() && x.size(1) % 4 == 0 && x.size(1) <= 8192 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
              "zero_centred_rmsnorm: x must be a contiguous, 8-byte aligned CUDA tensor [rows, C] with C a multiple of "
              "4, at most 8192");
  TORCH_CHECK(norm_final >= 0 && norm_final <= 2, "zero_centred_rmsnorm: norm_final must be 0, 1 or 2");
  TORCH_CHECK(x.size(0) <= 0x7fffffff, "zero_centred_rmsnorm: at most 2^31 - 1 rows");
  RotaryArgs args;
  args.dtype = to_dtype(x);
  const at::Tensor rows = x.view({1, x.size(0), 1, x.size(1)});
  args.img = rotary_source(rows, rows, weight, eps, "x", /*norm_rows=*/true, /*float_weight=*/true);
  args.txt = RotarySource{nullptr, 0, 0, 0, 0, nullptr, 0.f};
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.cos = nullptr;
  args.sin = nullptr;
  args.cos_stride_b = args.cos_stride_s = args.cos_stride_h = 0;
  args.batch = 1;
  args.heads = 1;
  args.dim = x.size(1);
  args.norm = false;
  args.wan = false;
  args.norm_rows = true;
  args.norm_fp32 = false;
  args.norm_f32w = true;
  args.norm_final = static_cast<int32_t>(norm_final);
  const cudaError_t err = launch_rotary(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "zero_centred_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor qk_norm_rope_impl(at::Tensor out, const std::optional<at::Tensor>& x_txt,
                             const std::optional<at::Tensor>& weight_txt, double eps_txt, const at::Tensor& x_img,
                             const at::Tensor& weight_img, double eps_img, const at::Tensor& cos,
                             const at::Tensor& sin) {
  TORCH_CHECK(x_txt.has_value() == weight_txt.has_value(), "qk_norm_rope: x_txt and weight_txt go together");
  return rotary_launch(out, x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin, /*norm=*/true);
}

at::Tensor qk_norm_rope(const std::optional<at::Tensor>& x_txt, const std::optional<at::Tensor>& weight_txt,
                        double eps_txt, const at::Tensor& x_img, const at::Tensor& weight_img, double eps_img,
                        const at::Tensor& cos, const at::Tensor& sin) {
  return qk_norm_rope_impl(at::Tensor(), x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin);
}

void qk_norm_rope_out(at::Tensor& out, const std::optional<at::Tensor>& x_txt,
                      const std::optional<at::Tensor>& weight_txt, double eps_txt, const at::Tensor& x_img,
                      const at::Tensor& weight_img, double eps_img, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(out.defined(), "qk_norm_rope: out must be defined");
  qk_norm_rope_impl(out, x_txt, weight_txt, eps_txt, x_img, weight_img, eps_img, cos, sin);
}

// FLUX.3's fp32 QK norm + rotary, cast back: apply_rotary_emb(norm(x.float()), (cos, sin)).to(x.dtype) with the
// norm's float32 weight (rotary.cu's kHeadNormF32); with round_norm, Krea 2's: the norm's result cast back to x's
// dtype before the rotary (kHeadNormF32W, the weight Krea2RMSNorm's weight + 1.0); x [batch, seq, heads, dim]
// bf16/fp16, one source.
at::Tensor qk_norm_rope_fp32(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                             const at::Tensor& sin, bool round_norm) {
  return rotary_launch(at::Tensor(), std::nullopt, std::nullopt, 0.0, x, weight, eps, cos, sin, /*norm=*/true,
                       /*wan=*/false, /*norm_rows=*/false, /*norm_final=*/0, /*norm_fp32=*/!round_norm,
                       /*norm_f32w=*/round_norm);
}

// The rotate-half rotary (rotary.cu's rotate_half_kernel): x contiguous [rows, heads, dim] (the Python op's view),
// cos/sin contiguous [table_rows, rot_dim] of x's dtype or float32 (cast to x's dtype first), table_rows dividing rows
// (row r reads table row r % table_rows), rot_dim even and at most dim (the channels past it copied).
at::Tensor rotary_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous(),
              "rotary_half: x must be a contiguous CUDA [rows, heads, dim] tensor, got ", shape_str(x.sizes()));
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK((t->scalar_type() == x.scalar_type() || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == cos.scalar_type() && t->device() == x.device() && t->is_contiguous() &&
                    t->dim() == 2 && t->sizes() == cos.sizes() && cos.size(0) > 0 && x.size(0) % cos.size(0) == 0 &&
                    cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2),
                "rotary_half: cos/sin must be contiguous [table_rows, rot_dim] tensors of x's dtype or float32, "
                "table_rows dividing x's rows, rot_dim even and at most dim");
  }
  RotateHalfArgs args;
  args.dtype = to_dtype(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.cos = cos.data_ptr();
  args.sin = sin.data_ptr();
  args.rows = x.size(0);
  args.heads = x.size(1);
  args.dim = x.size(2);
  args.rot_dim = cos.size(1);
  args.table_rows = cos.size(0);
  args.tables_f32 = cos.scalar_type() == at::kFloat && x.scalar_type() != at::kFloat;
  const cudaError_t err = launch_rotate_half(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rotary_half: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The matrix-form rotary (rotary.cu's rotary_matrix_kernel): x contiguous [rows, heads, dim] (the Python op's view)
// of bf16/fp16, rope a contiguous float32 [table_rows, dim * 2] (the [dim / 2, 2, 2] matrices of a row), table_rows
// dividing rows (row r reads table row r % table_rows).
at::Tensor rotary_matrix(const at::Tensor& x, const at::Tensor& rope) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous() && x.size(2) % 2 == 0,
              "rotary_matrix: x must be a contiguous CUDA [rows, heads, dim] tensor, dim even, got ",
              shape_str(x.sizes()));
  TORCH_CHECK(rope.scalar_type() == at::kFloat && rope.device() == x.device() && rope.is_contiguous() &&
                  rope.dim() == 2 && rope.size(0) > 0 && x.size(0) % rope.size(0) == 0 &&
                  rope.size(1) == 2 * x.size(2) && aligned16(rope),
              "rotary_matrix: rope must be a contiguous float32 [table_rows, 2 * dim] tensor on x's device, "
              "16-byte aligned, table_rows dividing x's rows");
  RotaryMatrixArgs args;
  args.dtype = to_dtype(x);
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.rope = rope.data_ptr<float>();
  args.rows = x.size(0);
  args.heads = x.size(1);
  args.dim = x.size(2);
  args.table_rows = rope.size(0);
  const cudaError_t err = launch_rotary_matrix(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "rotary_matrix: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The 2x nearest upsampling (upsample_nearest.cu): x a CUDA [N, C, H, W] tensor of bf16/fp16 with unit W stride, the
// result a contiguous [N, C, 2H, 2W].
at::Tensor upsample_nearest2x(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1),
              "upsample_nearest2x: x must be a CUDA [N, C, H, W] tensor with unit W stride, got ", shape_str(x.sizes()));
  UpsampleNearestArgs args;
  args.dtype = to_dtype_or_float(x);
  at::Tensor out = at::empty({x.size(0), x.size(1), 2 * x.size(2), 2 * x.size(3)}, x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.height = x.size(2);
  args.width = x.size(3);
  args.stride_n = x.stride(0);
  args.stride_c = x.stride(1);
  args.stride_h = x.stride(2);
  const cudaError_t err = launch_upsample_nearest2x(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "upsample_nearest2x: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// A convolution's bias added in place (conv_bias.cu): x a dense CUDA [N, C, *] tensor of bf16/fp16, contiguous or
// channels-last (C innermost), bias a contiguous [C] of x's dtype.
void conv_bias_(at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && bias.is_cuda() && bias.dim() == 1 && bias.size(0) == x.size(1) &&
                  bias.is_contiguous() && bias.scalar_type() == x.scalar_type(),
              "conv_bias_: x must be a CUDA [N, C, *] tensor and bias a contiguous [C] of its dtype, got ",
              shape_str(x.sizes()), " and ", shape_str(bias.sizes()));
  const bool channels_last = !x.is_contiguous();
  if (channels_last) {
    TORCH_CHECK(x.is_contiguous(x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d),
                "conv_bias_: x must be contiguous or channels-last");
  }
  ConvBiasArgs args;
  args.dtype = to_dtype_or_float(x);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.x = x.data_ptr();
  args.bias = bias.data_ptr();
  args.channels = x.size(1);
  args.channels_last = channels_last;
  args.cols = channels_last ? args.channels : x.numel() / (x.size(0) * args.channels);
  args.rows = x.numel() / args.cols;
  const cudaError_t err = launch_conv_bias(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "conv_bias_: kernel launch failed: ", cudaGetErrorString(err));
}

// A channels-last convolution output's bias added into a new contiguous tensor (conv_bias.cu): x a dense CUDA
// [N, C, *] tensor of bf16/fp16 laid out channels-last (C innermost), bias a contiguous [C] of its dtype.
at::Tensor conv_bias_contiguous(const at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && (x.dim() == 4 || x.dim() == 5) && bias.is_cuda() && bias.dim() == 1 &&
                  bias.size(0) == x.size(1) && bias.is_contiguous() && bias.scalar_type() == x.scalar_type() &&
                  x.is_contiguous(x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d),
              "conv_bias_contiguous: x must be a channels-last CUDA [N, C, *] tensor and bias a contiguous [C] of its "
              "dtype, got ", shape_str(x.sizes()), " and ", shape_str(bias.sizes()));
  BiasContiguousArgs args;
  args.dtype = to_dtype_or_float(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.bias = bias.data_ptr();
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.spatial = x.numel() / (args.batch * args.channels);
  const cudaError_t err = launch_bias_contiguous(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "conv_bias_contiguous: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// A causal convolution's padded input (causal_pad.cu): x a CUDA [B, C, T, H, W] tensor of bf16/fp16 with unit W
// stride, cache (optional) the same but for its frames, padding (w0, w1, h0, h1, t0, t1) as F.pad takes it, t0 counting
// the cache frames as eager's concatenation does; the result a [B, C, T', H', W'], contiguous or channels-last. Its
// border zeros, or in time the first and last frames repeated (replicate_t: some frame needed) and in space F.pad's
// reflection (reflect_hw: each spatial padding below its axis' size, as reflection_pad3d requires).
at::Tensor causal_pad(const at::Tensor& x, const std::optional<at::Tensor>& cache, at::IntArrayRef padding,
                      bool channels_last, bool replicate_t, bool reflect_hw) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 5 && (x.size(4) <= 1 || x.stride(4) == 1) && padding.size() == 6,
              "causal_pad: x must be a CUDA [B, C, T, H, W] tensor with unit W stride, got ", shape_str(x.sizes()));
  for (const int64_t p : padding) TORCH_CHECK(p >= 0, "causal_pad: padding must be non-negative");
  TORCH_CHECK(!reflect_hw || (padding[0] < x.size(4) && padding[1] < x.size(4) && padding[2] < x.size(3) &&
                              padding[3] < x.size(3)),
              "causal_pad: a reflected padding must be below the size of its dimension");
  TORCH_CHECK(!replicate_t || x.size(2) > 0 || (cache.has_value() && cache->size(2) > 0),
              "causal_pad: repeated frames need a frame to repeat");
  CausalPadArgs args;
  args.dtype = to_dtype_or_float(x);
  const int64_t cache_frames = cache.has_value() ? cache->size(2) : 0;
  if (cache.has_value()) {
    const at::Tensor& c = *cache;
    TORCH_CHECK(c.is_cuda() && c.dim() == 5 && c.scalar_type() == x.scalar_type() && c.size(0) == x.size(0) &&
                    c.size(1) == x.size(1) && c.size(3) == x.size(3) && c.size(4) == x.size(4) &&
                    (c.size(4) <= 1 || c.stride(4) == 1) && cache_frames <= padding[4],
                "causal_pad: cache must be [B, C, t, H, W] of x's dtype with unit W stride, t <= the time padding");
  }
  const int64_t pt0 = padding[4] - cache_frames;
  at::Tensor out = at::empty({x.size(0), x.size(1), pt0 + cache_frames + x.size(2) + padding[5],
                              x.size(3) + padding[2] + padding[3], x.size(4) + padding[0] + padding[1]},
                             x.options().memory_format(channels_last ? at::MemoryFormat::ChannelsLast3d
                                                                     : at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.cache = cache.has_value() ? cache->data_ptr() : nullptr;
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.frames = x.size(2);
  args.height = x.size(3);
  args.width = x.size(4);
  args.cache_frames = cache_frames;
  args.pad_t0 = pt0;
  args.pad_t1 = padding[5];
  args.pad_h0 = padding[2];
  args.pad_h1 = padding[3];
  args.pad_w0 = padding[0];
  args.pad_w1 = padding[1];
  args.x_stride_b = x.stride(0);
  args.x_stride_c = x.stride(1);
  args.x_stride_t = x.stride(2);
  args.x_stride_h = x.stride(3);
  args.cache_stride_b = cache.has_value() ? cache->stride(0) : 0;
  args.cache_stride_c = cache.has_value() ? cache->stride(1) : 0;
  args.cache_stride_t = cache.has_value() ? cache->stride(2) : 0;
  args.cache_stride_h = cache.has_value() ? cache->stride(3) : 0;
  args.channels_last = channels_last;
  args.replicate_t = replicate_t;
  args.reflect_hw = reflect_hw;
  const cudaError_t err = launch_causal_pad(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "causal_pad: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// torch.nn.GroupNorm (weight and bias) of [N, C, *], then SiLU if `silu` (group_norm_silu.cu). `eps` is the module's:
// the kernel adds aten's static_cast<T>(eps). The Python guard admits only inputs that pass these checks.
void group_norm_silu_out(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& weight_in,
                         const at::Tensor& bias_in, int64_t groups, double eps, bool silu, int64_t variant) {
  TORCH_CHECK(x_in.is_cuda(), "group_norm_silu: x must be a CUDA tensor");
  TORCH_CHECK(x_in.dim() >= 3, "group_norm_silu: x must be [N, C, *], got ", shape_str(x_in.sizes()));
  const DType dtype = to_dtype(x_in);
  const int64_t batch = x_in.size(0), channels = x_in.size(1);
  TORCH_CHECK(groups > 0 && channels % groups == 0, "group_norm_silu: channels must be a multiple of groups");
  for (const at::Tensor* t : {&weight_in, &bias_in}) {
    TORCH_CHECK(t->scalar_type() == x_in.scalar_type() && t->device() == x_in.device() && t->dim() == 1 &&
                    t->size(0) == channels,
                "group_norm_silu: weight and bias must be [C] tensors of x's dtype and device");
  }
  const int64_t hxw = x_in.numel() / (batch * channels > 0 ? batch * channels : 1);
  const int64_t vec = 16 / x_in.element_size();
  TORCH_CHECK(hxw > 1 && hxw % vec == 0, "group_norm_silu: HxW must be above 1 and a multiple of ",
              std::to_string(vec));
  TORCH_CHECK(batch * groups <= 65535, "group_norm_silu: at most 65535 rows (N * groups)");
  const int64_t row_size = channels / groups * hxw;
  TORCH_CHECK(row_size < (int64_t{1} << 31), "group_norm_silu: rows too long");
  TORCH_CHECK(variant >= 0 && variant <= 255, "group_norm_silu: no such variant");
  const at::Tensor x = x_in.contiguous();  // aten's group_norm makes a CUDA input contiguous too
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  TORCH_CHECK(aligned16(x), "group_norm_silu: x must be 16-byte aligned");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.device() == x.device() &&
                  out.is_contiguous() && aligned16(out),
              "group_norm_silu: out must be a contiguous, 16-byte aligned tensor of x's shape, dtype and device");
  if (x.numel() == 0) return;
  const int32_t threads = row_size < 512 ? 32 : 512;  // RowwiseMomentsCUDAKernel's block
  at::Tensor partial = at::empty({batch * groups * (threads / 32) * 3}, x.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard device_guard(x.device());
  GroupNormSiluArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.gamma = weight.data_ptr();
  args.beta = bias.data_ptr();
  args.partial = partial.data_ptr<float>();
  args.batch = batch;
  args.channels = channels;
  args.groups = groups;
  args.hxw = hxw;
  args.row_size = row_size;
  // aten's GroupNormKernelImpl: static_cast<scalar_t>(eps) (a double, converted to float, then to T)
  args.eps = dtype == DType::kHalf ? static_cast<float>(c10::Half(static_cast<float>(eps)))
                                   : static_cast<float>(c10::BFloat16(static_cast<float>(eps)));
  args.threads = threads;
  args.variant = static_cast<int32_t>(variant);
  args.silu = silu;
  args.dtype = dtype;
  const cudaError_t err = launch_group_norm_silu(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "group_norm_silu: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor group_norm_silu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t groups,
                           double eps, bool silu, int64_t variant) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  group_norm_silu_out(out, x, weight, bias, groups, eps, silu, variant);
  return out;
}

// Wan's / Qwen-Image's channel RMS norm from F.normalize's division on, then SiLU if `silu`
// (channel_rmsnorm_silu.cu): x [B, C, *] contiguous (any trailing size: 16-byte vectors where it holds a multiple of
// them, elements elsewhere), denom the fp32 [B, 1, *] that eager divides by, gamma (and bias,
// or the python-float `bias_value`) [C] of x's dtype. `probe`: the SiLU alone (y = x). The Python guard admits only
// inputs that pass these checks.
at::Tensor channel_rmsnorm(const at::Tensor& x, const at::Tensor& denom, const at::Tensor& gamma,
                           const std::optional<at::Tensor>& bias, double scale, double bias_value, bool silu,
                           bool probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && x.is_contiguous() && aligned16(x),
              "channel_rmsnorm: x must be a contiguous, 16-byte aligned CUDA tensor [B, C, *]");
  const DType dtype = to_dtype_or_float(x);
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t spatial = x.numel() / (batch * channels > 0 ? batch * channels : 1);
  TORCH_CHECK(denom.scalar_type() == at::kFloat && denom.device() == x.device() && denom.is_contiguous() &&
                  denom.numel() == batch * spatial && aligned16(denom),
              "channel_rmsnorm: denom must be a contiguous fp32 [B, 1, *] tensor on x's device");
  TORCH_CHECK(gamma.scalar_type() == x.scalar_type() && gamma.device() == x.device() && gamma.dim() == 1 &&
                  gamma.size(0) == channels && gamma.is_contiguous(),
              "channel_rmsnorm: gamma must be a contiguous [C] tensor of x's dtype and device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->device() == x.device() && bias->dim() == 1 &&
                    bias->size(0) == channels && bias->is_contiguous(),
                "channel_rmsnorm: bias must be a contiguous [C] tensor of x's dtype and device");
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  ChannelRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.denom = denom.data_ptr<float>();
  args.gamma = gamma.data_ptr();
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.batch = batch;
  args.channels = channels;
  args.spatial = spatial;
  args.scale = static_cast<float>(scale);  // aten's mul casts the python scalar to its float opmath
  args.bias_value = static_cast<float>(bias_value);
  args.silu = silu ? 1 : 0;
  args.probe = probe ? 1 : 0;
  args.dtype = dtype;
  const cudaError_t err = launch_channel_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "channel_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-Video's VAE norm from eager's multiply on (ltx_vae_rmsnorm.cu): x [B, C, *] (the channel-first memory of the
// norm's channel-last view) with each channel's trailing elements contiguous, rsqrt the fp32 [B, *] that eager
// multiplies by; `silu`: the SiLU after the norm; `square`: the fp32 x * x for aten's mean instead; `probe`: the SiLU of
// x alone (the Python op's proof; rsqrt unused). The Python guard admits only inputs that pass these checks.
at::Tensor ltx_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& rsqrt, bool square, bool silu,
                       bool probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && aligned16(x), "ltx_rmsnorm: x must be a 16-byte aligned CUDA tensor [B, C, *]");
  int64_t expected = 1;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    TORCH_CHECK(x.size(d) == 1 || x.stride(d) == expected, "ltx_rmsnorm: each channel of x must be contiguous");
    expected *= x.size(d);
  }
  const DType dtype = to_dtype(x);
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t spatial = x.numel() / (batch * channels > 0 ? batch * channels : 1);
  const int64_t vec = 16 / x.element_size();
  TORCH_CHECK(spatial % vec == 0 && x.stride(0) % vec == 0 && x.stride(1) % vec == 0 && x.stride(1) >= spatial,
              "ltx_rmsnorm: the trailing sizes and x's strides must be multiples of ", std::to_string(vec), " elements");
  TORCH_CHECK(int(square) + int(silu) + int(probe) <= 1, "ltx_rmsnorm: at most one of square, silu and probe");
  TORCH_CHECK(square || probe ||
                  (rsqrt.has_value() && rsqrt->scalar_type() == at::kFloat && rsqrt->device() == x.device() &&
                   rsqrt->is_contiguous() && rsqrt->numel() == batch * spatial && aligned16(*rsqrt)),
              "ltx_rmsnorm: rsqrt must be a contiguous fp32 [B, *] tensor on x's device");
  at::Tensor out = at::empty(x.sizes(), x.options()
                                            .dtype(square ? at::kFloat : x.scalar_type())
                                            .memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  LtxRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.rsqrt = square || probe ? nullptr : rsqrt->data_ptr<float>();
  args.batch = batch;
  args.channels = channels;
  args.spatial = spatial;
  args.x_batch_stride = x.stride(0);
  args.x_channel_stride = x.stride(1);
  args.square = square ? 1 : 0;
  args.silu = silu ? 1 : 0;
  args.probe = probe ? 1 : 0;
  args.dtype = dtype;
  const cudaError_t err = launch_ltx_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ltx_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-2's VAE norm from aten's mean on, then SiLU if `silu` (per_channel_rmsnorm.cu): x [B, C, S] with each channel's S
// elements contiguous (channels and batches at any strides), mean the [B, 1, S] (any view of B * S contiguous values)
// of x's dtype that aten's torch.mean(x**2, 1, keepdim=True) gave; `probe` 1: the SiLU of x alone, 2: the kernel's
// round(sqrt(round(x + eps))) of x alone (the Python op's proofs; mean unused). The Python guard admits only inputs
// that pass these checks.
at::Tensor per_channel_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& mean, double eps, bool silu,
                               int64_t probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "per_channel_rmsnorm: x must be a CUDA tensor [B, C, S] with unit stride along S");
  TORCH_CHECK(probe >= 0 && probe <= 2 && (probe == 0 || !silu),
              "per_channel_rmsnorm: probe must be 0, 1 or 2 (0 with silu)");
  const DType dtype = to_dtype_or_float(x);
  const int64_t batch = x.size(0), channels = x.size(1), spatial = x.size(2);
  TORCH_CHECK(probe != 0 || (mean.has_value() && mean->scalar_type() == x.scalar_type() &&
                             mean->device() == x.device() && mean->is_contiguous() && mean->numel() == batch * spatial),
              "per_channel_rmsnorm: mean must be a contiguous [B, 1, S] tensor of x's dtype and device");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  PerChannelRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.mean = probe == 0 ? mean->data_ptr() : nullptr;
  args.batch = batch;
  args.channels = channels;
  args.spatial = spatial;
  args.x_batch_stride = x.stride(0);
  args.x_channel_stride = x.stride(1);
  args.eps = static_cast<float>(eps);  // aten's CUDA add casts the python scalar (a double) to its float opmath
  args.silu = silu ? 1 : 0;
  args.probe = static_cast<int32_t>(probe);
  args.dtype = dtype;
  const cudaError_t err = launch_per_channel_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "per_channel_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
  m.def("_modulate_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift) -> Tensor");
  m.def("_modulate_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()");
  m.def("_rmsnorm_scale_shift_cuda(Tensor x, Tensor weight, Tensor scale, Tensor shift, float eps) -> Tensor");
  m.def(
      "_rmsnorm_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, Tensor shift, "
      "float eps) -> ()");
  m.def(
      "_gated_rmsnorm_scale_shift_cuda(Tensor residual, Tensor gate, Tensor update, Tensor weight, Tensor scale, "
      "Tensor shift, float eps) -> (Tensor, Tensor)");
  m.def(
      "_gated_rmsnorm_scale_shift_cuda_out(Tensor(a!) residual_out, Tensor(b!) out, Tensor residual, Tensor gate, "
      "Tensor update, Tensor weight, Tensor scale, Tensor shift, float eps) -> ()");
  m.def("_rmsnorm_modulate_cuda(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps) -> Tensor");
  m.def("_rmsnorm_modulate_cuda_out(Tensor(a!) out, Tensor x, Tensor? weight, Tensor scale, Tensor shift, "
        "float eps) -> ()");
  m.def("_rmsnorm_scale_cuda(Tensor x, Tensor weight, Tensor scale, float eps) -> Tensor");
  m.def("_rmsnorm_scale_cuda_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor scale, float eps) -> ()");
  m.def("_rmsnorm_rope_complex_cuda(Tensor x, Tensor weight, Tensor freqs, int heads, int tokens, float eps) -> Tensor");
  m.def("_rmsnorm_rope_complex_cuda_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor freqs, int heads, int tokens, "
        "float eps) -> ()");
  m.def("_rmsnorm_rope_real_cuda(Tensor x, Tensor weight, Tensor cos, Tensor sin, int heads, int tokens, float eps) -> "
        "Tensor");
  m.def("_rmsnorm_plain_cuda(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("_rmsnorm_gated_residual_cuda(Tensor residual, Tensor gate, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def(
      "_rmsnorm_gated_residual_cuda_out(Tensor(a!) out, Tensor residual, Tensor gate, Tensor x, Tensor weight, "
      "float eps) -> ()");
  m.def("_layernorm_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift, float eps) -> Tensor");
  m.def("_layernorm_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift, float eps) -> ()");
  m.def("_layernorm_scale_shift_probe_cuda(Tensor x, Tensor scale, Tensor shift, float eps, int variant) -> Tensor");
  m.def(
      "_gated_layernorm_scale_shift_cuda(Tensor residual, Tensor gate, Tensor update, Tensor scale, Tensor shift, "
      "float eps) -> (Tensor, Tensor)");
  m.def(
      "_gated_layernorm_scale_shift_cuda_out(Tensor(a!) x_out, Tensor(b!) out, Tensor residual, Tensor gate, "
      "Tensor update, Tensor scale, Tensor shift, float eps) -> ()");
  m.def("_layernorm_affine_fp32_cuda(Tensor x, Tensor weight, Tensor bias, float eps) -> Tensor");
  m.def("_layernorm_modulate_cuda(Tensor x, Tensor scale, Tensor? shift, Tensor? weight, Tensor? bias, float eps) -> Tensor");
  m.def("_gated_residual_cuda(Tensor residual, Tensor gate, Tensor update) -> Tensor");
  m.def("_gated_residual_cuda_out(Tensor(a!) out, Tensor residual, Tensor gate, Tensor update) -> ()");
  m.def("_silu_mul_cuda(Tensor gate, Tensor up) -> Tensor");
  m.def("_silu_mul_cuda_out(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def("_cat_heads_cuda(Tensor a, Tensor b) -> Tensor");
  m.def("_gelu_cat_cuda(Tensor attn, Tensor mlp) -> Tensor");
  m.def("_gelu_cat_cuda_out(Tensor(a!) out, Tensor attn, Tensor mlp) -> ()");
  m.def("_rotary_emb_cuda(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("_rotary_emb_cuda_out(Tensor(a!) out, Tensor x, Tensor cos, Tensor sin) -> ()");
  m.def("_rotary_emb_rows_cuda(Tensor x, Tensor cos, Tensor sin, int head_dim) -> Tensor");
  m.def("_rotary_emb_wan_cuda(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "_qk_norm_rows_rope_cuda(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin, bool wan, int norm_final) "
      "-> Tensor");
  m.def(
      "_qk_norm_rows_rope_pair_cuda(Tensor q, Tensor weight_q, float eps_q, Tensor k, Tensor weight_k, float eps_k, "
      "Tensor cos, Tensor sin, int norm_final) -> Tensor");
  m.def("_zero_centred_rmsnorm_cuda(Tensor x, Tensor weight, float eps, int norm_final) -> Tensor");
  m.def("_rotary_half_cuda(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("_rotary_matrix_cuda(Tensor x, Tensor rope) -> Tensor");
  m.def("_upsample_nearest2x_cuda(Tensor x) -> Tensor");
  m.def("_conv_bias_cuda_(Tensor(a!) x, Tensor bias) -> ()");
  m.def("_conv_bias_contiguous_cuda(Tensor x, Tensor bias) -> Tensor");
  m.def("_causal_pad_cuda(Tensor x, Tensor? cache, int[] padding, bool channels_last=False, bool replicate_t=False, "
        "bool reflect_hw=False) -> Tensor");
  m.def(
      "_qk_norm_rope_fp32_cuda(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin, bool round_norm) -> "
      "Tensor");
  m.def(
      "_qk_norm_rope_cuda(Tensor? x_txt, Tensor? weight_txt, float eps_txt, Tensor x_img, Tensor weight_img, "
      "float eps_img, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "_qk_norm_rope_cuda_out(Tensor(a!) out, Tensor? x_txt, Tensor? weight_txt, float eps_txt, Tensor x_img, "
      "Tensor weight_img, float eps_img, Tensor cos, Tensor sin) -> ()");
  m.def("_group_norm_silu_cuda(Tensor x, Tensor weight, Tensor bias, int groups, float eps, bool silu, int variant) "
        "-> Tensor");
  m.def("_group_norm_silu_cuda_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor bias, int groups, float eps, "
        "bool silu, int variant) -> ()");
  m.def("_channel_rmsnorm_cuda(Tensor x, Tensor denom, Tensor gamma, Tensor? bias, float scale, float bias_value, "
        "bool silu, bool probe) -> Tensor");
  m.def("_ltx_rmsnorm_cuda(Tensor x, Tensor? rsqrt, bool square, bool silu, bool probe) -> Tensor");
  m.def("_per_channel_rmsnorm_cuda(Tensor x, Tensor? mean, float eps, bool silu, int probe) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
  m.impl("_modulate_scale_shift_cuda", &diffusers_fastpath::modulate_scale_shift);
  m.impl("_modulate_scale_shift_cuda_out", &diffusers_fastpath::modulate_scale_shift_out);
  m.impl("_rmsnorm_scale_shift_cuda", &diffusers_fastpath::rmsnorm_scale_shift);
  m.impl("_rmsnorm_scale_shift_cuda_out", &diffusers_fastpath::rmsnorm_scale_shift_out);
  m.impl("_gated_rmsnorm_scale_shift_cuda", &diffusers_fastpath::gated_rmsnorm_scale_shift);
  m.impl("_gated_rmsnorm_scale_shift_cuda_out", &diffusers_fastpath::gated_rmsnorm_scale_shift_out);
  m.impl("_rmsnorm_modulate_cuda", &diffusers_fastpath::rmsnorm_modulate);
  m.impl("_rmsnorm_modulate_cuda_out", &diffusers_fastpath::rmsnorm_modulate_out);
  m.impl("_rmsnorm_scale_cuda", &diffusers_fastpath::rmsnorm_scale);
  m.impl("_rmsnorm_scale_cuda_out", &diffusers_fastpath::rmsnorm_scale_out);
  m.impl("_rmsnorm_rope_complex_cuda", &diffusers_fastpath::rmsnorm_rope_complex);
  m.impl("_rmsnorm_rope_complex_cuda_out", &diffusers_fastpath::rmsnorm_rope_complex_out);
  m.impl("_rmsnorm_rope_real_cuda", &diffusers_fastpath::rmsnorm_rope_real);
  m.impl("_rmsnorm_plain_cuda", &diffusers_fastpath::rmsnorm_plain);
  m.impl("_rmsnorm_gated_residual_cuda", &diffusers_fastpath::rmsnorm_gated_residual);
  m.impl("_rmsnorm_gated_residual_cuda_out", &diffusers_fastpath::rmsnorm_gated_residual_out);
  m.impl("_layernorm_scale_shift_cuda", &diffusers_fastpath::layernorm_scale_shift);
  m.impl("_layernorm_scale_shift_cuda_out", &diffusers_fastpath::layernorm_scale_shift_out);
  m.impl("_layernorm_scale_shift_probe_cuda", &diffusers_fastpath::layernorm_scale_shift_probe);
  m.impl("_gated_layernorm_scale_shift_cuda", &diffusers_fastpath::gated_layernorm_scale_shift);
  m.impl("_gated_layernorm_scale_shift_cuda_out", &diffusers_fastpath::gated_layernorm_scale_shift_out);
  m.impl("_layernorm_affine_fp32_cuda", &diffusers_fastpath::layernorm_affine_fp32);
  m.impl("_layernorm_modulate_cuda", &diffusers_fastpath::layernorm_modulate);
  m.impl("_gated_residual_cuda", &diffusers_fastpath::gated_residual);
  m.impl("_gated_residual_cuda_out", &diffusers_fastpath::gated_residual_out);
  m.impl("_silu_mul_cuda", &diffusers_fastpath::silu_mul);
  m.impl("_silu_mul_cuda_out", &diffusers_fastpath::silu_mul_out);
  m.impl("_cat_heads_cuda", &diffusers_fastpath::cat_heads);
  m.impl("_gelu_cat_cuda", &diffusers_fastpath::gelu_cat);
  m.impl("_gelu_cat_cuda_out", &diffusers_fastpath::gelu_cat_out);
  m.impl("_rotary_emb_cuda", &diffusers_fastpath::rotary_emb);
  m.impl("_rotary_emb_cuda_out", &diffusers_fastpath::rotary_emb_out);
  m.impl("_rotary_emb_rows_cuda", &diffusers_fastpath::rotary_emb_rows);
  m.impl("_rotary_emb_wan_cuda", &diffusers_fastpath::rotary_emb_wan);
  m.impl("_qk_norm_rows_rope_cuda", &diffusers_fastpath::qk_norm_rows_rope);
  m.impl("_qk_norm_rows_rope_pair_cuda", &diffusers_fastpath::qk_norm_rows_rope_pair);
  m.impl("_zero_centred_rmsnorm_cuda", &diffusers_fastpath::zero_centred_rmsnorm);
  m.impl("_rotary_half_cuda", &diffusers_fastpath::rotary_half);
  m.impl("_rotary_matrix_cuda", &diffusers_fastpath::rotary_matrix);
  m.impl("_upsample_nearest2x_cuda", &diffusers_fastpath::upsample_nearest2x);
  m.impl("_conv_bias_cuda_", &diffusers_fastpath::conv_bias_);
  m.impl("_conv_bias_contiguous_cuda", &diffusers_fastpath::conv_bias_contiguous);
  m.impl("_causal_pad_cuda", &diffusers_fastpath::causal_pad);
  m.impl("_qk_norm_rope_fp32_cuda", &diffusers_fastpath::qk_norm_rope_fp32);
  m.impl("_qk_norm_rope_cuda", &diffusers_fastpath::qk_norm_rope);
  m.impl("_qk_norm_rope_cuda_out", &diffusers_fastpath::qk_norm_rope_out);
  m.impl("_group_norm_silu_cuda", &diffusers_fastpath::group_norm_silu);
  m.impl("_group_norm_silu_cuda_out", &diffusers_fastpath::group_norm_silu_out);
  m.impl("_channel_rmsnorm_cuda", &diffusers_fastpath::channel_rmsnorm);
  m.impl("_ltx_rmsnorm_cuda", &diffusers_fastpath::ltx_rmsnorm);
  m.impl("_per_channel_rmsnorm_cuda", &diffusers_fastpath::per_channel_rmsnorm);
}
