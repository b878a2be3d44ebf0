// Registers the CUDA kernels as torch operators in the `diffusers_fastpath` namespace (`_*_cuda` and their
// `_out` variants, see TORCH_LIBRARY_FRAGMENT below). These are the raw CUDA entry points; the public,
// device-generic ops (with their fake implementations for torch.compile) are defined in Python, one file per op
// in ops/; eager calls reach these directly to skip the Python custom-op layer (see ops/modulate_scale_shift.py
// for the numbers). One file per family of ops, each registering its own (a fragment of the library each):
// this one the transformer blocks' elementwise chains (modulates, gated residuals, SiLU / GELU products, the head
// concatenation), bindings_norms.cpp their RMSNorm and LayerNorm kernels, bindings_rotary.cpp the rotary embeddings
// and the QK / row norms before them, bindings_vae.cpp the VAEs' ops; bindings_common.h what they share (with the
// input checks of the modulates and gated residuals, which the norms' fused forms run too).
#include "bindings_common.h"

namespace diffusers_fastpath {
namespace {

// index: MiniMax-H3's indexed rows (modulate_scale_shift_rows): x [1, rows, dim], scale and shift the [rows, dim] tables.
void modulate_launch(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                     const at::Tensor* index) {
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
  args.scale_batch_stride = scale.size(0) == 1 && index == nullptr ? 0 : scale.stride(0);
  args.shift_batch_stride = shift.size(0) == 1 && index == nullptr ? 0 : shift.stride(0);
  args.dtype = to_dtype(x);
  if (index != nullptr) {  // (the kernel traps on an index outside the tables, as eager's index_select)
    args.index = index->data_ptr<int32_t>();
    args.table_rows = scale.size(0);
  }
  const cudaError_t err = launch_modulate_scale_shift(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "modulate_scale_shift: kernel launch failed: ", cudaGetErrorString(err));
}

void modulate_scale_shift_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                              const at::Tensor& shift) {
  check_modulate_inputs(out, x, scale, shift);
  modulate_launch(out, x, scale, shift, nullptr);
}

at::Tensor modulate_scale_shift(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  modulate_scale_shift_out(out, x, scale, shift);
  return out;
}

// MiniMax-H3's per-token rows: row r of x (of batch * seq) reads row index[r] of the [rows, dim] scale and shift
// tables (their `index_select(0, index)` rows, never written out; an index outside the tables traps in the kernel).
at::Tensor modulate_scale_shift_rows(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                     const at::Tensor& index) {
  TORCH_CHECK(scale.dim() == 2 && shift.sizes() == scale.sizes(),
              "modulate_scale_shift_rows: scale and shift must be [rows, dim] tables of one shape");
  TORCH_CHECK(x.dim() == 3, "modulate_scale_shift_rows: x must be [batch, seq, dim], got ", shape_str(x.sizes()));
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 1 && index.numel() == x.size(0) * x.size(1) &&
                  index.is_contiguous() && index.device() == x.device(),
              "modulate_scale_shift_rows: index must be a contiguous int32 [batch * seq] tensor on x's device");
  at::Tensor out = at::empty({1, x.size(0) * x.size(1), x.size(2)}, x.options());
  const at::Tensor x1 = x.view({1, -1, x.size(2)});  // one "batch" of rows: the index picks each row's table row
  check_modulate_inputs(out, x1, scale.narrow(0, 0, 1), shift.narrow(0, 0, 1));
  TORCH_CHECK(scale.size(0) == 1 || (scale.stride(0) % (16 / scale.element_size()) == 0 &&
                                     shift.stride(0) % (16 / shift.element_size()) == 0),
              "modulate_scale_shift_rows: table rows must stay 16-byte aligned");
  modulate_launch(out, x1, scale, shift, &index);
  return out.view(x.sizes());
}

void gated_residual_launch(at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                           const at::Tensor& update, const at::Tensor* index, bool tanh_gate = false) {
  check_gated_residual_inputs(out, residual, gate, update, index != nullptr);
  if (index != nullptr) check_row_index(*index, residual, "gated_residual_rows");
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
  args.index = index != nullptr ? index->data_ptr<int32_t>() : nullptr;
  if (index != nullptr) {  // the table's rows: stride 0 only where it has one row (every index 0)
    args.gate_batch_stride = 0;
    args.gate_seq_stride = gate.size(1) == 1 ? 0 : gate.stride(1);
    args.table_rows = gate.size(1);  // (the kernel traps on an index outside the table, as eager's index_select)
  }
  TORCH_CHECK(!tanh_gate || (index != nullptr && !args.gate_fp32),
              "gated_residual_rows: the gate's tanh is taken of indexed rows of x's dtype only");
  args.tanh_gate = tanh_gate;
  const cudaError_t err = launch_gated_residual(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "gated_residual: kernel launch failed: ", cudaGetErrorString(err));
}

void gated_residual_out(at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
                        const at::Tensor& update) {
  gated_residual_launch(out, residual, gate, update, nullptr);
}

// Qwen-Image 2.1's gates: the gate row of (b, s) is row index[b, s] of the [rows, dim] table (its where-picked rows);
// tanh_gate: the table holds the rows before their `.tanh()`, which the kernel takes (gated_residual.cu's kTanhGate).
at::Tensor gated_residual_rows(const at::Tensor& residual, const at::Tensor& table, const at::Tensor& index,
                               const at::Tensor& update, bool tanh_gate) {
  at::Tensor out = at::empty(residual.sizes(), residual.options());
  const at::Tensor gate = table_rows(table, "gated_residual_rows");
  gated_residual_launch(out, residual, gate, update, &index, tanh_gate);
  return out;
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

// silu_mul.cu's two kernels, one checked launch: `op` names the op in the messages, `launch` is its launcher
void check_silu_mul_inputs(const char* op, const at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  TORCH_CHECK(gate.is_cuda(), op, ": gate must be a CUDA tensor");
  TORCH_CHECK(gate.dim() == 3 && up.sizes() == gate.sizes() && out.sizes() == gate.sizes(),
              op, ": gate, up and out must be [batch, seq, dim] of one shape, got ",
              shape_str(gate.sizes()), " and ", shape_str(up.sizes()));
  const int64_t vec = 16 / gate.element_size();
  to_dtype(gate);
  for (const at::Tensor* t : {&out, &gate, &up}) {
    TORCH_CHECK(t->scalar_type() == gate.scalar_type(), op, ": dtype mismatch");
    TORCH_CHECK(t->device() == gate.device(), op, ": device mismatch");
    TORCH_CHECK(aligned16(*t), op, ": pointers must be 16-byte aligned");
    TORCH_CHECK(t->size(2) % vec == 0 && t->stride(2) == 1 && t->stride(1) % vec == 0 && t->stride(0) % vec == 0,
                op, ": rows must have unit innermost stride, stay 16-byte aligned and hold whole vectors");
  }
  TORCH_CHECK((out.size(1) == 1 || out.stride(1) >= out.size(2)) &&
                  (out.size(0) == 1 || out.stride(0) >= out.size(1) * out.stride(1)),
              op, ": out rows must not overlap");
}

void gate_mul_out(const char* op, cudaError_t (*launch)(const SiluMulArgs&, cudaStream_t), at::Tensor& out,
                  const at::Tensor& gate, const at::Tensor& up) {
  check_silu_mul_inputs(op, out, gate, up);
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
  const cudaError_t err = launch(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor gate_mul(const char* op, cudaError_t (*launch)(const SiluMulArgs&, cudaStream_t), const at::Tensor& gate,
                    const at::Tensor& up) {
  at::Tensor out = at::empty(gate.sizes(), gate.options());
  gate_mul_out(op, launch, out, gate, up);
  return out;
}

void silu_mul_out(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  gate_mul_out("silu_mul", launch_silu_mul, out, gate, up);
}

at::Tensor silu_mul(const at::Tensor& gate, const at::Tensor& up) {
  return gate_mul("silu_mul", launch_silu_mul, gate, up);
}

// round(round(sigmoid(gate)) * up): Krea 2's output gate `x * torch.sigmoid(gate)` with up = x (silu_mul.cu)
void sigmoid_mul_out(at::Tensor& out, const at::Tensor& gate, const at::Tensor& up) {
  gate_mul_out("sigmoid_mul", launch_sigmoid_mul, out, gate, up);
}

at::Tensor sigmoid_mul(const at::Tensor& gate, const at::Tensor& up) {
  return gate_mul("sigmoid_mul", launch_sigmoid_mul, gate, up);
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

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
  m.def("_modulate_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift) -> Tensor");
  m.def("_modulate_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()");
  m.def("_modulate_scale_shift_rows_cuda(Tensor x, Tensor scale, Tensor shift, Tensor index) -> Tensor");
  m.def("_gated_residual_cuda(Tensor residual, Tensor gate, Tensor update) -> Tensor");
  m.def(
      "_gated_residual_rows_cuda(Tensor residual, Tensor table, Tensor index, Tensor update, bool tanh_gate=False) "
      "-> Tensor");
  m.def("_gated_residual_cuda_out(Tensor(a!) out, Tensor residual, Tensor gate, Tensor update) -> ()");
  m.def("_silu_mul_cuda(Tensor gate, Tensor up) -> Tensor");
  m.def("_silu_mul_cuda_out(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def("_sigmoid_mul_cuda(Tensor gate, Tensor up) -> Tensor");
  m.def("_sigmoid_mul_cuda_out(Tensor(a!) out, Tensor gate, Tensor up) -> ()");
  m.def("_cat_heads_cuda(Tensor a, Tensor b) -> Tensor");
  m.def("_gelu_cat_cuda(Tensor attn, Tensor mlp) -> Tensor");
  m.def("_gelu_cat_cuda_out(Tensor(a!) out, Tensor attn, Tensor mlp) -> ()");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
  m.impl("_modulate_scale_shift_cuda", &diffusers_fastpath::modulate_scale_shift);
  m.impl("_modulate_scale_shift_cuda_out", &diffusers_fastpath::modulate_scale_shift_out);
  m.impl("_modulate_scale_shift_rows_cuda", &diffusers_fastpath::modulate_scale_shift_rows);
  m.impl("_gated_residual_cuda", &diffusers_fastpath::gated_residual);
  m.impl("_gated_residual_rows_cuda", &diffusers_fastpath::gated_residual_rows);
  m.impl("_gated_residual_cuda_out", &diffusers_fastpath::gated_residual_out);
  m.impl("_silu_mul_cuda", &diffusers_fastpath::silu_mul);
  m.impl("_silu_mul_cuda_out", &diffusers_fastpath::silu_mul_out);
  m.impl("_sigmoid_mul_cuda", &diffusers_fastpath::sigmoid_mul);
  m.impl("_sigmoid_mul_cuda_out", &diffusers_fastpath::sigmoid_mul_out);
  m.impl("_cat_heads_cuda", &diffusers_fastpath::cat_heads);
  m.impl("_gelu_cat_cuda", &diffusers_fastpath::gelu_cat);
  m.impl("_gelu_cat_cuda_out", &diffusers_fastpath::gelu_cat_out);
}
