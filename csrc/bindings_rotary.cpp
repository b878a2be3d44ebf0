// The rotary embeddings' raw CUDA ops (rotary.cu: diffusers' pairing, LTX-Video's rows, Wan's, the QK norm and
// the row norm before them, the rotate-half and matrix forms; Krea 2's zero-centred row norm, the row norm without
// a rotary, alone or with its modulate; torch.nn.RMSNorm with the modulate of rows picked through an index),
// registered as torch operators in the `diffusers_fastpath` namespace (see bindings.cpp).
#include "bindings_common.h"

namespace diffusers_fastpath {
namespace {

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

// Krea 2's zero-centred row norm of x [batch, seq, C] (contiguous, 8-byte aligned, C a multiple of 4 up to 8192):
// rotary.cu's row norm without a rotary, one block per (s, b) row, `norm_final` its mean square (kFinal*), with the
// float32 weight (Krea 2's); with `scale` and `shift` ([batch or 1, C] rows of x's dtype, checked by the caller), the
// modulate after it (kNoRotaryModulate), else the norm alone (kNoRotary). With `index` (an int32 [batch * seq] tensor,
// checked by the caller), torch.nn.RMSNorm's weight of x's dtype and the modulate of `scale` and `shift` [rows, C]
// tables read through the index (kNormModulateRows).
at::Tensor zero_centred_launch(const char* op, const at::Tensor& x, const at::Tensor& weight, double eps,
                               int64_t norm_final, const at::Tensor* scale = nullptr,
                               const at::Tensor* shift = nullptr, const at::Tensor* index = nullptr) {
  TORCH_CHECK(norm_final >= 0 && norm_final <= 2, op, ": norm_final must be 0, 1 or 2");
  TORCH_CHECK(x.size(0) <= 65535 && x.size(1) <= 0x7fffffff, op, ": at most 65535 x (2^31 - 1) rows");
  RotaryArgs args;
  args.dtype = to_dtype(x);
  const at::Tensor rows = x.view({x.size(0), x.size(1), 1, x.size(2)});
  args.img = rotary_source(rows, rows, weight, eps, "x", /*norm_rows=*/true, /*float_weight=*/index == nullptr);
  args.txt = RotarySource{nullptr, 0, 0, 0, 0, nullptr, 0.f};
  at::Tensor out = at::empty(x.sizes(), x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.cos = nullptr;
  args.sin = nullptr;
  args.cos_stride_b = args.cos_stride_s = args.cos_stride_h = 0;
  args.batch = x.size(0);
  args.heads = 1;
  args.dim = x.size(2);
  args.norm = false;
  args.wan = false;
  args.norm_rows = true;
  args.norm_fp32 = false;
  args.norm_f32w = index == nullptr;
  args.norm_final = static_cast<int32_t>(norm_final);
  if (scale != nullptr) {
    args.mod_scale = scale->data_ptr();
    args.mod_shift = shift->data_ptr();
    args.mod_scale_stride_b = scale->size(0) == 1 && index == nullptr ? 0 : scale->stride(0);
    args.mod_shift_stride_b = shift->size(0) == 1 && index == nullptr ? 0 : shift->stride(0);
  }
  if (index != nullptr) {
    args.mod_index = index->data_ptr<int32_t>();
    args.mod_table_rows = scale->size(0);
  }
  const cudaError_t err = launch_rotary(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, op, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
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
  TORCH_CHECK(x.size(0) <= 0x7fffffff, "zero_centred_rmsnorm: at most 2^31 - 1 rows");
  return zero_centred_launch("zero_centred_rmsnorm", x.view({1, x.size(0), x.size(1)}), weight, eps, norm_final)
      .view(x.sizes());
}

// The same norm with the adaLN modulate that reads it (zero_centred_modulate: Krea 2's `(1.0 + scale) * norm(x) +
// shift`): x [batch, seq, C] as above, scale and shift [batch or 1, C] rows of x's dtype (unit innermost stride, rows
// 8-byte aligned; one row for every sample where there is one): rotary.cu's kNoRotaryModulate form.
at::Tensor zero_centred_modulate(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                 const at::Tensor& shift, double eps, int64_t norm_final) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous() && x.size(2) % 4 == 0 && x.size(2) <= 8192 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
              "zero_centred_modulate: x must be a contiguous, 8-byte aligned CUDA tensor [batch, seq, C] with C a "
              "multiple of 4, at most 8192");
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->dim() == 2 && (t->size(0) == 1 || t->size(0) == x.size(0)) && t->size(1) == x.size(2) &&
                    t->stride(1) == 1 && t->stride(0) % 4 == 0 && t->scalar_type() == x.scalar_type() &&
                    t->device() == x.device() && reinterpret_cast<uintptr_t>(t->data_ptr()) % 8 == 0,
                "zero_centred_modulate: scale and shift must be [batch or 1, C] rows of x's dtype and device, unit "
                "innermost stride, 8-byte aligned");
  }
  return zero_centred_launch("zero_centred_modulate", x, weight, eps, norm_final, &scale, &shift);
}

// torch.nn.RMSNorm(C) and the modulate of rows picked per token (rms_norm_modulate_rows: MiniMax-H3's `norm(x) * (1.0 +
// scale.index_select(0, rows)) + shift.index_select(0, rows)`): x [batch, seq, C] as above, weight [C] of x's dtype
// (contiguous, 8-byte aligned), scale and shift [rows, C] tables of x's dtype and of one shape (unit innermost stride,
// rows 8-byte aligned), index int32 [batch * seq] on x's device, contiguous (its values are checked in the kernel,
// which traps): rotary.cu's kNormModulateRows form.
at::Tensor rms_norm_modulate_rows(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& scale,
                                  const at::Tensor& shift, const at::Tensor& index, double eps, int64_t norm_final) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous() && x.size(2) % 4 == 0 && x.size(2) <= 8192 &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
              "rms_norm_modulate_rows: x must be a contiguous, 8-byte aligned CUDA tensor [batch, seq, C] with C a "
              "multiple of 4, at most 8192");
  TORCH_CHECK(scale.dim() == 2 && scale.sizes() == shift.sizes() && scale.size(0) > 0 &&
                  scale.size(0) <= 0x7fffffff && scale.size(1) == x.size(2),
              "rms_norm_modulate_rows: scale and shift must be [rows, C] tables of one shape");
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->stride(1) == 1 && (t->size(0) == 1 || t->stride(0) % 4 == 0) &&
                    t->scalar_type() == x.scalar_type() && t->device() == x.device() &&
                    reinterpret_cast<uintptr_t>(t->data_ptr()) % 8 == 0,
                "rms_norm_modulate_rows: scale and shift must be tables of x's dtype and device, unit innermost "
                "stride, rows 8-byte aligned");
  }
  TORCH_CHECK(index.scalar_type() == at::kInt && index.dim() == 1 && index.size(0) == x.size(0) * x.size(1) &&
                  index.is_contiguous() && index.device() == x.device(),
              "rms_norm_modulate_rows: index must be a contiguous int32 [batch * seq] tensor on x's device");
  return zero_centred_launch("rms_norm_modulate_rows", x, weight, eps, norm_final, &scale, &shift, &index);
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
// (row r reads table row r % table_rows), rot_dim even and at most dim (the channels past it copied). With a weight,
// the QK norm of each head first (head_norm_rotate_half_kernel: qk_norm_rotary_half): dim a multiple of 4 and at most
// 128, x 8-byte aligned, the weight a contiguous, 8-byte aligned [dim] of x's dtype (torch.nn.RMSNorm(dim)'s, with its
// eps).
at::Tensor rotate_half_launch(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                              const at::Tensor* weight, double eps, const char* name) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && x.is_contiguous(),
              name, ": x must be a contiguous CUDA [rows, heads, dim] tensor, got ", shape_str(x.sizes()));
  if (weight != nullptr) {
    TORCH_CHECK(x.size(2) % 4 == 0 && x.size(2) <= 128 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 8 == 0,
                name, ": x must be 8-byte aligned, dim a multiple of 4 and at most 128, got ", shape_str(x.sizes()));
    TORCH_CHECK(weight->scalar_type() == x.scalar_type() && weight->device() == x.device() &&
                    weight->is_contiguous() && weight->dim() == 1 && weight->size(0) == x.size(2) &&
                    reinterpret_cast<uintptr_t>(weight->data_ptr()) % 8 == 0,
                name, ": weight must be a contiguous, 8-byte aligned [dim] tensor of x's dtype on x's device");
  }
  for (const at::Tensor* t : {&cos, &sin}) {
    TORCH_CHECK((t->scalar_type() == x.scalar_type() || t->scalar_type() == at::kFloat) &&
                    t->scalar_type() == cos.scalar_type() && t->device() == x.device() && t->is_contiguous() &&
                    t->dim() == 2 && t->sizes() == cos.sizes() && cos.size(0) > 0 && x.size(0) % cos.size(0) == 0 &&
                    cos.size(1) % 2 == 0 && cos.size(1) <= x.size(2),
                name, ": cos/sin must be contiguous [table_rows, rot_dim] tensors of x's dtype or float32, "
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
  if (weight != nullptr) {
    args.weight = weight->data_ptr();
    args.eps = static_cast<float>(eps);  // aten's static_cast<acc_t>(eps) of the module's Python float
  }
  const cudaError_t err = launch_rotate_half(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor rotary_half(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  return rotate_half_launch(x, cos, sin, nullptr, 0.0, "rotary_half");
}

at::Tensor qk_norm_rotary_half(const at::Tensor& x, const at::Tensor& weight, double eps, const at::Tensor& cos,
                               const at::Tensor& sin) {
  return rotate_half_launch(x, cos, sin, &weight, eps, "qk_norm_rotary_half");
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

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
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
  m.def(
      "_zero_centred_modulate_cuda(Tensor x, Tensor weight, Tensor scale, Tensor shift, float eps, int norm_final) -> "
      "Tensor");
  m.def(
      "_rms_norm_modulate_rows_cuda(Tensor x, Tensor weight, Tensor scale, Tensor shift, Tensor index, float eps, "
      "int norm_final) -> Tensor");
  m.def("_rotary_half_cuda(Tensor x, Tensor cos, Tensor sin) -> Tensor");
  m.def("_qk_norm_rotary_half_cuda(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin) -> Tensor");
  m.def("_rotary_matrix_cuda(Tensor x, Tensor rope) -> Tensor");
  m.def(
      "_qk_norm_rope_fp32_cuda(Tensor x, Tensor weight, float eps, Tensor cos, Tensor sin, bool round_norm) -> "
      "Tensor");
  m.def(
      "_qk_norm_rope_cuda(Tensor? x_txt, Tensor? weight_txt, float eps_txt, Tensor x_img, Tensor weight_img, "
      "float eps_img, Tensor cos, Tensor sin) -> Tensor");
  m.def(
      "_qk_norm_rope_cuda_out(Tensor(a!) out, Tensor? x_txt, Tensor? weight_txt, float eps_txt, Tensor x_img, "
      "Tensor weight_img, float eps_img, Tensor cos, Tensor sin) -> ()");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
  m.impl("_rotary_emb_cuda", &diffusers_fastpath::rotary_emb);
  m.impl("_rotary_emb_cuda_out", &diffusers_fastpath::rotary_emb_out);
  m.impl("_rotary_emb_rows_cuda", &diffusers_fastpath::rotary_emb_rows);
  m.impl("_rotary_emb_wan_cuda", &diffusers_fastpath::rotary_emb_wan);
  m.impl("_qk_norm_rows_rope_cuda", &diffusers_fastpath::qk_norm_rows_rope);
  m.impl("_qk_norm_rows_rope_pair_cuda", &diffusers_fastpath::qk_norm_rows_rope_pair);
  m.impl("_zero_centred_rmsnorm_cuda", &diffusers_fastpath::zero_centred_rmsnorm);
  m.impl("_zero_centred_modulate_cuda", &diffusers_fastpath::zero_centred_modulate);
  m.impl("_rms_norm_modulate_rows_cuda", &diffusers_fastpath::rms_norm_modulate_rows);
  m.impl("_rotary_half_cuda", &diffusers_fastpath::rotary_half);
  m.impl("_qk_norm_rotary_half_cuda", &diffusers_fastpath::qk_norm_rotary_half);
  m.impl("_rotary_matrix_cuda", &diffusers_fastpath::rotary_matrix);
  m.impl("_qk_norm_rope_fp32_cuda", &diffusers_fastpath::qk_norm_rope_fp32);
  m.impl("_qk_norm_rope_cuda", &diffusers_fastpath::qk_norm_rope);
  m.impl("_qk_norm_rope_cuda_out", &diffusers_fastpath::qk_norm_rope_out);
}
