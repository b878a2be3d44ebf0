// The transformer blocks' RMSNorm and LayerNorm kernels (rmsnorm_scale_shift.cu, layernorm_scale_shift.cu:
// the norms with their modulates, gated residuals and rotaries), registered as torch operators in the
// `diffusers_fastpath` namespace (see bindings.cpp).
#include "bindings_common.h"

namespace diffusers_fastpath {
namespace {

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
  m.def(
      "_gated_layernorm_modulate_rows_cuda(Tensor residual, Tensor gate, Tensor gate_index, Tensor update, "
      "Tensor scale, Tensor? shift, Tensor index, Tensor? weight, Tensor? bias, float eps, bool tanh_gate=False) -> "
      "(Tensor, Tensor)");
  m.def("_layernorm_modulate_rows_cuda(Tensor x, Tensor scale, Tensor? shift, Tensor index, Tensor? weight, "
        "Tensor? bias, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
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
  m.impl("_layernorm_modulate_rows_cuda", &diffusers_fastpath::layernorm_modulate_rows);
  m.impl("_gated_layernorm_modulate_rows_cuda", &diffusers_fastpath::gated_layernorm_modulate_rows);
}
