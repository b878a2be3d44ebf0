// Registers the CUDA kernels as torch operators in the `diffusers_fastpath` namespace (`_*_cuda` and their
// `_out` variants, see TORCH_LIBRARY_FRAGMENT below). These are the raw CUDA entry points; the public,
// device-generic ops (with their fake implementations for torch.compile) are defined in Python, one file per op
// in ops/; eager calls reach these directly to skip the Python custom-op layer (see ops/modulate_scale_shift.py
// for the numbers). One file per family of ops, each registering its own (a fragment of the library each):
// this one the transformer blocks' chains (modulates, gated residuals, SiLU / GELU products, the RMSNorm and
// LayerNorm kernels), bindings_rotary.cpp the rotary embeddings and the QK / row norms before them,
// bindings_vae.cpp the VAEs' ops; bindings_common.h what they share.
#include "bindings_common.h"

namespace diffusers_fastpath {
namespace {

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

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad
// input raises instead of reading out of bounds.
void check_gated_residual_inputs(const at::Tensor& out, const at::Tensor& residual, const at::Tensor& gate,
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
void check_row_index(const at::Tensor& index, const at::Tensor& x, const char* op) {
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 2 && index.size(0) == x.size(0) &&
                  index.size(1) == x.size(1) && index.is_contiguous() && index.device() == x.device(),
              op, ": index must be a contiguous int32 [batch, seq] tensor on x's device");
}

// A [rows, dim] table as the [1, rows, dim] rows whose seq stride is the table's row stride (the indexed form's).
at::Tensor table_rows(const at::Tensor& table, const char* op) {
  TORCH_CHECK(table.dim() == 2, op, ": the table must be [rows, dim], got ", shape_str(table.sizes()));
  return table.unsqueeze(0);
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

// The indexed epilogues' operand (kScaleRows, kGatedResidualRows): a [rows, dim] table of x's dtype and device, unit
// innermost stride, rows 8-byte aligned, and the int32 [seq, batch] index of x's rows into it (its values are checked
// in the kernel, which traps on one outside the table).
struct IndexedTable {
  Rows rows;  // the table as the epilogue reads it: row t at ptr + t * stride_s
  const int32_t* index;
  int64_t table_rows;
};

IndexedTable indexed_table(const at::Tensor& table, const at::Tensor& index, const at::Tensor& x, const char* op) {
  TORCH_CHECK(x.dim() == 3, op, ": x must be three-dimensional, got ", shape_str(x.sizes()));
  check_row_index(index, x, op);
  TORCH_CHECK(table.dim() == 2 && table.size(0) > 0 && table.size(1) == x.size(2) && table.stride(1) == 1 &&
                  (table.size(0) == 1 || table.stride(0) % 4 == 0) &&
                  reinterpret_cast<uintptr_t>(table.data_ptr()) % 8 == 0,
              op, ": the table must be [rows, dim] with unit innermost stride and 8-byte aligned rows, got ",
              shape_str(table.sizes()));
  TORCH_CHECK(table.scalar_type() == x.scalar_type() && table.device() == x.device(), op,
              ": the table must match x in dtype and device");
  return IndexedTable{Rows{table.data_ptr(), table.stride(0), 0}, index.data_ptr<int32_t>(), table.size(0)};
}

// One launcher for every variant: `update` given is ERNIE-Image's gated prologue (with `gate` and `residual_out`);
// `scale`/`shift`/`gate`/`residual` are the epilogue's operands (fastpath.h's RmsEpilogue says which it reads); the
// indexed epilogues' scale (gate) is `indexed`'s table instead.
void rmsnorm_launch(at::Tensor& out, const std::optional<at::Tensor>& residual_out, const at::Tensor& x,
                    const std::optional<at::Tensor>& gate, const std::optional<at::Tensor>& update,
                    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& scale,
                    const std::optional<at::Tensor>& shift, const std::optional<at::Tensor>& residual,
                    RmsEpilogue epilogue, double eps, Rows freqs = Rows{nullptr, 0, 0}, int64_t heads = 1,
                    int64_t tokens = 1, Rows sin = Rows{nullptr, 0, 0}, const IndexedTable* indexed = nullptr) {
  const bool indexed_epilogue = epilogue == RmsEpilogue::kScaleRows || epilogue == RmsEpilogue::kGatedResidualRows;
  TORCH_CHECK((indexed != nullptr) == indexed_epilogue,
              "rmsnorm_scale_shift: the indexed epilogues take an indexed table, the others none");
  TORCH_CHECK(x.is_cuda(), "rmsnorm_scale_shift: x must be a CUDA tensor");
  check_rows(x, x, "x");
  const int64_t dim = x.size(2);
  // rows shorter than 128: aten's scalar reduction order (see rmsnorm_scale_shift.cu), not for the gated prologue
  TORCH_CHECK(dim % 128 == 0 ||
                  (!update.has_value() && dim >= 32 && dim % 4 == 0 && (dim < 128 || epilogue == RmsEpilogue::kPlain)),
              "rmsnorm_scale_shift: dim must be a multiple of 128 (or, not gated, a multiple of 4 in [32, 128); the "
              "plain norm: any multiple of 4 from 32)");
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
  args.index = nullptr;
  args.table_rows = 0;
  if (indexed != nullptr) {
    (epilogue == RmsEpilogue::kScaleRows ? args.scale : args.gate) = indexed->rows;
    args.index = indexed->index;
    args.table_rows = indexed->table_rows;
  }
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

// Bria FIBO 2's and Z-Image's per-token rows (select_per_token): the scale (gate) of x's row (b, s) is row
// index[b, s] of the [rows, dim] table (the rows the model's torch.where picks, never written out).
at::Tensor rmsnorm_scale_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& table,
                              const at::Tensor& index, double eps) {
  const IndexedTable indexed = indexed_table(table, index, x, "rmsnorm_scale_rows");
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, std::nullopt, std::nullopt, std::nullopt,
                 RmsEpilogue::kScaleRows, eps, Rows{nullptr, 0, 0}, 1, 1, Rows{nullptr, 0, 0}, &indexed);
  return out;
}

at::Tensor rmsnorm_gated_residual_rows(const at::Tensor& residual, const at::Tensor& table, const at::Tensor& index,
                                       const at::Tensor& x, const at::Tensor& weight, double eps) {
  const IndexedTable indexed = indexed_table(table, index, x, "rmsnorm_gated_residual_rows");
  at::Tensor out = at::empty(x.sizes(), x.options());
  rmsnorm_launch(out, std::nullopt, x, std::nullopt, std::nullopt, weight, std::nullopt, std::nullopt, residual,
                 RmsEpilogue::kGatedResidualRows, eps, Rows{nullptr, 0, 0}, 1, 1, Rows{nullptr, 0, 0}, &indexed);
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
                                  const at::Tensor* norm_bias = nullptr, bool no_shift = false,
                                  const at::Tensor* row_index = nullptr, const at::Tensor* gate_index = nullptr,
                                  bool tanh_gate = false) {
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
  args.row_index = row_index != nullptr ? row_index->data_ptr() : nullptr;
  args.gate_index = nullptr;
  TORCH_CHECK(gate_index == nullptr || args.gated, "layernorm_scale_shift: an indexed gate needs the gated form");
  TORCH_CHECK(!tanh_gate || gate_index != nullptr, "layernorm_scale_shift: the gate's tanh needs an indexed gate");
  args.tanh_gate = tanh_gate;
  if (args.gated) {  // x is the residual (gated_layernorm_scale_shift)
    // gate_index (gated_layernorm_modulate_rows): the gate is the [1, rows, dim] view of a [rows, dim] table
    const bool indexed_gate = gate_index != nullptr;
    check_gated_residual_inputs(*x_out, x, *gate, *update, indexed_gate);
    if (indexed_gate) check_row_index(*gate_index, x, "gated_layernorm_modulate_rows");
    TORCH_CHECK(!modulate_fp32 && gate->scalar_type() == x.scalar_type() &&
                    (indexed_gate ? gate->size(0) == 1 : gate->size(1) == 1),
                "gated_layernorm_scale_shift: the gate must be [batch or 1, 1, dim] rows of x's dtype (or an indexed "
                "[rows, dim] table), and scale/shift of x's dtype");
    args.x_out = x_out->data_ptr();
    args.gate = gate->data_ptr();
    args.update = update->data_ptr();
    args.gate_batch_stride = indexed_gate ? (gate->size(1) == 1 ? 0 : gate->stride(1))
                                          : (gate->size(0) == 1 ? 0 : gate->stride(0));
    args.gate_index = indexed_gate ? gate_index->data_ptr() : nullptr;
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
// row_index (layernorm_modulate_rows): scale/shift are [1, rows, dim] views of [rows, dim] tables, any rows.
at::Tensor layernorm_modulate_launch(const at::Tensor& x, const at::Tensor& scale,
                                     const std::optional<at::Tensor>& shift_opt, const std::optional<at::Tensor>& weight,
                                     const std::optional<at::Tensor>& bias, double eps,
                                     const at::Tensor* row_index, at::Tensor* x_out = nullptr,
                                     const at::Tensor* gate = nullptr, const at::Tensor* update = nullptr,
                                     const at::Tensor* gate_index = nullptr, bool tanh_gate = false) {
  const bool no_shift = !(shift_opt.has_value() && shift_opt->defined());
  const at::Tensor& shift = no_shift ? scale : *shift_opt;
  TORCH_CHECK(x.dim() == 3 && scale.dim() == 3 && shift.dim() == 3,
              "layernorm_modulate: x and scale/shift must be [batch, seq, dim] tensors");
  if (row_index != nullptr) check_row_index(*row_index, x, "layernorm_modulate_rows");
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "layernorm_modulate: scale/shift must be of x's dtype");
    TORCH_CHECK((t->size(0) == x.size(0) || t->size(0) == 1) &&
                    (t->size(1) == x.size(1) || t->size(1) == 1 || (row_index != nullptr && t->size(0) == 1)) &&
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
                               /*affine=*/false, x_out, gate, update, scale_seq, shift_seq,
                               affine ? &*weight : nullptr, affine ? &*bias : nullptr, no_shift, row_index, gate_index,
                               tanh_gate);
  return out;
}

at::Tensor layernorm_modulate(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& shift,
                              const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                              double eps) {
  return layernorm_modulate_launch(x, scale, shift, weight, bias, eps, nullptr);
}

// Qwen-Image 2.1's scale rows: token s of sample b reads row index[b, s] of the [rows, dim] scale (and shift) tables.
at::Tensor layernorm_modulate_rows(const at::Tensor& x, const at::Tensor& scale, const std::optional<at::Tensor>& shift,
                                   const at::Tensor& index, const std::optional<at::Tensor>& weight,
                                   const std::optional<at::Tensor>& bias, double eps) {
  const std::optional<at::Tensor> shift_rows =
      shift.has_value() && shift->defined() ? std::optional<at::Tensor>(table_rows(*shift, "layernorm_modulate_rows"))
                                            : std::nullopt;
  return layernorm_modulate_launch(x, table_rows(scale, "layernorm_modulate_rows"), shift_rows, weight, bias, eps,
                                   &index);
}

// Qwen-Image 2.1's in-block pair (gated_layernorm_scale_rows): x = residual + gate[gate_index] * update, written out,
// then the LayerNorm-modulate of x with the scale (and shift) rows of the [rows, dim] tables at index; (x, out).
// tanh_gate: the gate table holds the rows before their `.tanh()`, which the kernel takes (kTanhGate).
std::tuple<at::Tensor, at::Tensor> gated_layernorm_modulate_rows(
    const at::Tensor& residual, const at::Tensor& gate, const at::Tensor& gate_index, const at::Tensor& update,
    const at::Tensor& scale, const std::optional<at::Tensor>& shift, const at::Tensor& index,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps, bool tanh_gate) {
  const char* op = "gated_layernorm_modulate_rows";
  at::Tensor x_out = at::empty(residual.sizes(), residual.options());
  const at::Tensor gate_rows = table_rows(gate, op);
  const std::optional<at::Tensor> shift_rows =
      shift.has_value() && shift->defined() ? std::optional<at::Tensor>(table_rows(*shift, op)) : std::nullopt;
  at::Tensor out = layernorm_modulate_launch(residual, table_rows(scale, op), shift_rows, weight, bias, eps, &index,
                                             &x_out, &gate_rows, &update, &gate_index, tanh_gate);
  return {x_out, out};
}

// tools/layernorm_order_probe.py: the same kernel with a reduction variant chosen at run time.
at::Tensor layernorm_scale_shift_probe(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift,
                                       double eps, int64_t variant) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  layernorm_scale_shift_launch(out, x, scale, shift, eps, /*probe=*/true, variant);
  return out;
}

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
  m.def("_modulate_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift) -> Tensor");
  m.def("_modulate_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()");
  m.def("_modulate_scale_shift_rows_cuda(Tensor x, Tensor scale, Tensor shift, Tensor index) -> Tensor");
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
  m.def("_rmsnorm_scale_rows_cuda(Tensor x, Tensor weight, Tensor table, Tensor index, float eps) -> Tensor");
  m.def(
      "_rmsnorm_gated_residual_rows_cuda(Tensor residual, Tensor table, Tensor index, Tensor x, Tensor weight, "
      "float eps) -> Tensor");
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
  m.def(
      "_gated_residual_rows_cuda(Tensor residual, Tensor table, Tensor index, Tensor update, bool tanh_gate=False) "
      "-> Tensor");
  m.def(
      "_gated_layernorm_modulate_rows_cuda(Tensor residual, Tensor gate, Tensor gate_index, Tensor update, "
      "Tensor scale, Tensor? shift, Tensor index, Tensor? weight, Tensor? bias, float eps, bool tanh_gate=False) -> "
      "(Tensor, Tensor)");
  m.def("_layernorm_modulate_rows_cuda(Tensor x, Tensor scale, Tensor? shift, Tensor index, Tensor? weight, "
        "Tensor? bias, float eps) -> Tensor");
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
  m.impl("_rmsnorm_scale_rows_cuda", &diffusers_fastpath::rmsnorm_scale_rows);
  m.impl("_rmsnorm_gated_residual_rows_cuda", &diffusers_fastpath::rmsnorm_gated_residual_rows);
  m.impl("_rmsnorm_gated_residual_cuda_out", &diffusers_fastpath::rmsnorm_gated_residual_out);
  m.impl("_layernorm_scale_shift_cuda", &diffusers_fastpath::layernorm_scale_shift);
  m.impl("_layernorm_scale_shift_cuda_out", &diffusers_fastpath::layernorm_scale_shift_out);
  m.impl("_layernorm_scale_shift_probe_cuda", &diffusers_fastpath::layernorm_scale_shift_probe);
  m.impl("_gated_layernorm_scale_shift_cuda", &diffusers_fastpath::gated_layernorm_scale_shift);
  m.impl("_gated_layernorm_scale_shift_cuda_out", &diffusers_fastpath::gated_layernorm_scale_shift_out);
  m.impl("_layernorm_affine_fp32_cuda", &diffusers_fastpath::layernorm_affine_fp32);
  m.impl("_layernorm_modulate_cuda", &diffusers_fastpath::layernorm_modulate);
  m.impl("_gated_residual_cuda", &diffusers_fastpath::gated_residual);
  m.impl("_gated_residual_rows_cuda", &diffusers_fastpath::gated_residual_rows);
  m.impl("_layernorm_modulate_rows_cuda", &diffusers_fastpath::layernorm_modulate_rows);
  m.impl("_gated_layernorm_modulate_rows_cuda", &diffusers_fastpath::gated_layernorm_modulate_rows);
  m.impl("_gated_residual_cuda_out", &diffusers_fastpath::gated_residual_out);
  m.impl("_silu_mul_cuda", &diffusers_fastpath::silu_mul);
  m.impl("_silu_mul_cuda_out", &diffusers_fastpath::silu_mul_out);
  m.impl("_sigmoid_mul_cuda", &diffusers_fastpath::sigmoid_mul);
  m.impl("_sigmoid_mul_cuda_out", &diffusers_fastpath::sigmoid_mul_out);
  m.impl("_cat_heads_cuda", &diffusers_fastpath::cat_heads);
  m.impl("_gelu_cat_cuda", &diffusers_fastpath::gelu_cat);
  m.impl("_gelu_cat_cuda_out", &diffusers_fastpath::gelu_cat_out);
}
