// Host-side interface between the torch bindings (bindings.cpp, compiled by the host compiler with torch's
// headers) and the CUDA kernels (*.cu, compiled by nvcc without them). Keeping torch's headers out of the .cu
// files keeps the one-time JIT build short.
//
// The same .cu files are also compiled by NVRTC (ops/_nvrtc.py, for machines without a CUDA toolkit), which
// defines __CUDACC_RTC__ and has no host headers: there this header gives only the argument structs (passed to
// the kernels by value, so both compilers must lay them out alike: plain C types, no host-only members) and the
// fixed-width integers that <cstdint> would, and leaves out the host launchers.
#pragma once

#ifdef __CUDACC_RTC__
// <cstdint>'s widths on the data models NVRTC targets: LP64 (Linux, where __LP64__ is predefined) and LLP64
// (Windows). `long` on LP64 is what glibc's int64_t is, so kernel signatures mangle as under nvcc.
#if defined(__LP64__)
typedef long int64_t;
#else
typedef long long int64_t;
#endif
typedef int int32_t;
#else
#include <cstdint>

#include <cuda_runtime.h>
#endif

namespace diffusers_fastpath {

// The storage dtypes: the fused kernels take fp16 / bf16; the copies and the convolution bias adds of the VAEs
// (conv_bias.cu, causal_pad.cu, upsample_nearest.cu) fp32 too (an fp32 VAE, as Wan's model card loads it).
enum class DType : int { kHalf = 0, kBFloat16 = 1, kFloat32 = 2 };

// out[b, l, :] = round(round(x[b, l, :] * round(1 + scale[b, :])) + shift[b, :])
struct ModulateScaleShiftArgs {
  void* out;           // [batch, seq, dim], contiguous
  const void* x;       // [batch, seq, dim], contiguous
  const void* scale;   // [batch or 1, dim], innermost stride 1
  const void* shift;   // [batch or 1, dim], innermost stride 1
  int64_t batch;
  int64_t seq;
  int64_t dim;                 // a multiple of 16 / sizeof(element)
  int64_t scale_batch_stride;  // in elements; 0 broadcasts one row over the batch
  int64_t shift_batch_stride;
  DType dtype;
  const int32_t* index = nullptr;  // null, or indexed rows: row r's scale/shift rows are row index[r] of the tables
  int64_t table_rows = 0;          // the tables' rows where indexed: an index outside [0, table_rows) traps
};

#ifndef __CUDACC_RTC__
cudaError_t launch_modulate_scale_shift(const ModulateScaleShiftArgs& args, cudaStream_t stream);
#endif

// out[b, s, :] = round(residual[b, s, :] + round(gate[b, s or 0, :] * update[b, s, :]))
struct GatedResidualArgs {
  void* out;             // [batch, seq, dim], contiguous
  const void* residual;  // [batch, seq, dim], contiguous
  const void* gate;      // row (b, s) at gate + b * gate_batch_stride + s * gate_seq_stride; innermost stride 1
  const void* update;    // [batch, seq, dim], contiguous
  int64_t batch;
  int64_t seq;
  int64_t dim;                // a multiple of 16 / sizeof(element)
  int64_t gate_batch_stride;  // in elements; 0 broadcasts one gate over the batch
  int64_t gate_seq_stride;    // in elements; 0 for one gate row per batch (diffusers' `gate.unsqueeze(1)`)
  DType dtype;
  bool gate_fp32;             // the gate is fp32 and the math stays fp32 until the one rounding (Wan); else of dtype
  const int32_t* index;       // null, or indexed rows: (b, s)'s gate row at gate + index[b * seq + s] * gate_seq_stride
  int64_t table_rows = 0;     // the table's rows where indexed: an index outside [0, table_rows) traps
  bool tanh_gate = false;     // indexed rows of dtype: the gate is tanh(row) (the table before its `.tanh()`)
};

#ifndef __CUDACC_RTC__
cudaError_t launch_gated_residual(const GatedResidualArgs& args, cudaStream_t stream);
#endif

// out[b, s, :] = cat(attn[b, s, :], round(gelu_tanh(mlp[b, s, :]))), the tanh-GELU exactly as aten computes it
struct GeluCatArgs {
  void* out;             // [batch, seq, attn_dim + mlp_dim], contiguous
  const void* attn;      // row (b, s) at attn + b * attn_stride_b + s * attn_stride_s; unit innermost stride
  const void* mlp;       // row (b, s) at mlp + b * mlp_stride_b + s * mlp_stride_s; unit innermost stride
  int64_t batch;
  int64_t seq;
  int64_t attn_dim;      // a multiple of 16 / sizeof(element)
  int64_t mlp_dim;       // a multiple of 16 / sizeof(element)
  int64_t attn_stride_b;  // in elements, multiples of 16 / sizeof(element)
  int64_t attn_stride_s;
  int64_t mlp_stride_b;
  int64_t mlp_stride_s;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_gelu_cat(const GeluCatArgs& args, cudaStream_t stream);
#endif

// out[b, s, :] = round(round(silu(gate[b, s, :])) * up[b, s, :]), SwiGLU's elementwise half as aten computes it
// (launch_sigmoid_mul: round(round(sigmoid(gate[b, s, :])) * up[b, s, :]), a sigmoid output gate, Krea 2's)
struct SiluMulArgs {
  void* out;            // [batch, seq, dim]: row (b, s) at out + b * out_stride_b + s * out_stride_s, unit innermost
                        // stride (contiguous, or the SwiGLU columns of swiglu_cat's concatenation buffer)
  const void* gate;     // row (b, s) at gate + b * gate_stride_b + s * gate_stride_s; unit innermost stride
  const void* up;       // row (b, s) at up + b * up_stride_b + s * up_stride_s; unit innermost stride
  int64_t batch;
  int64_t seq;
  int64_t dim;            // a multiple of 16 / sizeof(element)
  int64_t gate_stride_b;  // in elements, multiples of 16 / sizeof(element)
  int64_t gate_stride_s;
  int64_t up_stride_b;
  int64_t up_stride_s;
  int64_t out_stride_b;
  int64_t out_stride_s;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream);
cudaError_t launch_sigmoid_mul(const SiluMulArgs& args, cudaStream_t stream);
#endif

// out[b, h, s, :] = s < seq_a ? a[b, h, s, :] : b[b, h, s - seq_a, :]: torch.cat([a, b], dim=2) of two [B, H, S, D]
// operands (SD3's joint attention concatenates its image and text q, k and v, each a [B, H, S, D] view of a
// [B, S, H, D] projection, so aten's cat cannot vectorise); a copy, exact by construction
struct CatHeadsArgs {
  void* out;           // [batch, heads, seq_a + seq_b, dim], contiguous
  const void* a;       // row (b, h, s) at a + b * a_stride_b + h * a_stride_h + s * a_stride_s; unit innermost stride
  const void* b;       // row (b, h, s) at b + b * b_stride_b + h * b_stride_h + s * b_stride_s; unit innermost stride
  int64_t batch;
  int64_t heads;
  int64_t seq_a;
  int64_t seq_b;
  int64_t dim;         // a multiple of 16 / sizeof(element)
  int64_t a_stride_b;  // in elements, multiples of 16 / sizeof(element)
  int64_t a_stride_h;
  int64_t a_stride_s;
  int64_t b_stride_b;
  int64_t b_stride_h;
  int64_t b_stride_s;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_cat_heads(const CatHeadsArgs& args, cudaStream_t stream);
#endif

// One [seq, batch, dim] operand: row (s, b) starts at ptr + s * stride_s + b * stride_b; unit innermost stride.
struct Rows {
  const void* ptr;
  int64_t stride_s;
  int64_t stride_b;
};

// What follows diffusers' RMSNorm in rmsnorm_scale_shift.cu (y = the norm's output; see there for every rounding point).
enum class RmsEpilogue : int32_t {
  kScaleShift = 0,    // ERNIE-Image's fp32 modulate: out = round(y * (1 + scale) + shift)
  kScale = 1,         // Z-Image, Lumina2: out = round(y * scale)
  kGatedResidual = 2,  // Z-Image, Lumina2: out = round(residual + round(gate * y))
  kRopeComplex = 3,    // Qwen-Image's QK norms + complex rotary: (out[2i], out[2i+1]) = round((y[2i] + y[2i+1] j) * f[i])
  kRopeReal = 4,       // HunyuanVideo-1.5's QK norms + real rotary: out = round(y * cos + rotate(y) * sin)
  kPlain = 5,          // SD3's QK norms: out = y
  kModulate = 6,       // LTX-Video: out = round(round(y * round(1 + scale)) + shift); the weight optional (none:
                       // y = round(x * rstd))
  kRopeComplex128 = 7,  // Lumina2's QK norms + complex rotary by complex128 factors: kRopeComplex in double, then
                        // round(float(...))
  kScaleRows = 8,         // Bria FIBO 2, Z-Image (select_per_token rows): kScale, the scale row of norm row r being
                          // row index[r] of a [table_rows, dim] table
  kGatedResidualRows = 9  // ... kGatedResidual, the gate row of norm row r being row index[r] of the table
};

// diffusers RMSNorm followed by an epilogue:
//   x   = gated ? round(residual + round(gate * update)) : x        (written to residual_out when gated; kScaleShift)
//   y   = round(round(x * rsqrt(mean(x^2) + eps)) * weight)
//   out = the epilogue of y
struct RmsNormScaleShiftArgs {
  void* out;           // [seq, batch, dim], contiguous
  void* residual_out;  // [seq, batch, dim], contiguous; gated only
  Rows x;              // the norm input, or the residual when gated
  Rows gate;           // gated: the gate before the norm; kGatedResidual(Rows): the gate after it
  Rows update;         // gated only
  Rows scale;          // kScaleShift, kScale(Rows)
  Rows shift;          // kScaleShift
  Rows residual;       // kGatedResidual(Rows): the stream the gated norm is added to
  Rows freqs;          // kRopeComplex(128): complex64 (complex128) (cos, sin) pairs, row (t, b) of [batch or 1, tokens, dim / 2] at
                       // t * stride_s + b * stride_b (in pairs), for norm row r: t = (r / heads) % tokens,
                       // b = r / (heads * tokens); kRopeReal: the float32 cos table [tokens, dim] (stride_s in floats)
  Rows sin;            // kRopeReal: the float32 sin table, laid out as cos
  const void* weight;  // [dim]; kModulate may have none (diffusers' RMSNorm without elementwise_affine)
  int64_t seq;
  int64_t batch;
  int64_t dim;         // a multiple of 128, or (not gated) a multiple of 4 in [32, 128); kPlain: any multiple of 4
  int64_t heads;       // kRopeComplex: norm rows per token (x is [batch, tokens, heads, dim] as [rows, 1, dim])
  int64_t tokens;      // kRopeComplex
  float eps;
  float mean_factor;   // what aten's mean multiplies the sum by: float(rows) / float(rows * dim)
  bool gated;
  DType dtype;
  RmsEpilogue epilogue;
  const int32_t* index;  // kScaleRows, kGatedResidualRows: [seq * batch], norm row r's table row (else null); the
                         // table is `scale` (`gate`) with its row stride as stride_s
  int64_t table_rows;    // ... the table's rows: an index outside [0, table_rows) traps
};

#ifndef __CUDACC_RTC__
cudaError_t launch_rmsnorm_scale_shift(const RmsNormScaleShiftArgs& args, cudaStream_t stream);
#endif

// torch.nn.LayerNorm without affine followed by the adaLN modulate (see layernorm_scale_shift.cu for every rounding
// point and aten's reduction order), optionally of a gated residual update computed on the way in (`gated`):
//   out[b, l, :] = round(round(round(rstd * (x - mean)) * round(1 + scale[b, :])) + shift[b, :])
struct LayerNormScaleShiftArgs {
  void* out;           // [batch, seq, dim], contiguous
  const void* x;       // [batch, seq, dim], contiguous
  const void* scale;   // [batch or 1, dim], innermost stride 1
  const void* shift;   // [batch or 1, dim], innermost stride 1; null: no shift (T's chain, scale only)
  int64_t batch;
  int64_t seq;
  int64_t dim;                 // a multiple of 4, at most 6144
  int64_t scale_batch_stride;  // in elements; 0 broadcasts one row over the batch
  int64_t shift_batch_stride;
  float eps;
  int variant;  // probe only: which reduction variant to run (production runs the default)
  bool probe;
  DType dtype;
  bool modulate_fp32;  // scale/shift are fp32 and the modulate runs in fp32, one rounding (Wan); else of dtype
  bool affine;         // with modulate_fp32: scale/shift are the norm's fp32 weight and bias rows (batch stride 0),
                       // out = round(fma(weight, y, bias)): aten's `gamma * y + beta` as nvcc contracts it (Wan's norm2)
  bool gated;          // x is a residual stream, normalised after its gated residual update, which is written too:
                       //   x_out[b, l, :] = round(x[b, l, :] + round(gate[b, :] * update[b, l, :]))  (gated_residual.cu)
                       // (the chain of dtype T only: not with modulate_fp32)
  void* x_out;         // gated: [batch, seq, dim], contiguous
  const void* gate;    // gated: [batch or 1, dim] rows, innermost stride 1 (diffusers' `gate.unsqueeze(1)`)
  const void* update;  // gated: [batch, seq, dim], contiguous
  int64_t gate_batch_stride;  // gated: in elements; 0 broadcasts one row over the batch
  int64_t scale_seq_stride;   // in elements: token l of sample b reads scale[b * scale_batch_stride + l * this]; 0: one
  int64_t shift_seq_stride;   // row per sample ([B, D]); else per-token rows ([B, S, D]: FLUX.3's adaLN, the chain of T)
  const void* norm_weight;    // the LayerNorm's own weight and bias as fp32 [dim] rows (aten's gamma, beta), applied
  const void* norm_bias;      // before the modulate of T's chain: y = round(fma(weight, normed, bias)); both null: none
  const void* row_index;      // null, or int32 [batch * seq]: token l of sample b reads scale/shift row
                              // row_index[b * seq + l] of [R, dim] tables, at scale + that * scale_seq_stride (shift
                              // likewise): Qwen-Image 2.1's where-picked rows, never materialised
  const void* gate_index;     // gated only; null, or int32 [batch * seq]: token l of sample b reads gate row
                              // gate_index[b * seq + l] of an [R, dim] table, at gate + that * gate_batch_stride (the
                              // table's row stride): Qwen-Image 2.1's where-picked tanh gate rows
  bool tanh_gate;             // with gate_index: the table holds the rows before their `.tanh()`, which the kernel
                              // takes of each value (elementwise.cuh's tanh_of: the kernel instantiated with kTanhGate)
};

#ifndef __CUDACC_RTC__
cudaError_t launch_layernorm_scale_shift(const LayerNormScaleShiftArgs& args, cudaStream_t stream);
#endif

// One [batch, seq, heads, dim] source of the rotary kernel: row (b, s, h) starts at
// ptr + b * stride_b + s * stride_s + h * stride_h; unit innermost stride.
struct RotarySource {
  const void* ptr;
  int64_t stride_b;
  int64_t stride_s;
  int64_t stride_h;
  int64_t seq;
  const void* weight;  // [dim] RMSNorm weight (norm only)
  float eps;           // RMSNorm eps as aten's float opmath sees it (norm only)
};

// diffusers' apply_rotary_emb(x, (cos, sin), sequence_dim=1) on the concatenation [txt; img] along the sequence (or
// LTX-Video's apply_rotary_emb, the same expression over [batch, seq, heads * dim] rows with per-sample tables),
// optionally after torch.nn.RMSNorm over dim of each source, or over all heads of a row (norm_rows; see rotary.cu for
// every rounding point):
//   y        = norm ? round(w * (rsqrt(sum(x^2) / dim + eps) * x)) : x
//   out[2i]   = round(y[2i] * cos[2i] + (-y[2i+1]) * sin[2i])
//   out[2i+1] = round(y[2i+1] * cos[2i+1] + y[2i] * sin[2i+1])
struct RotaryArgs {
  void* out;           // [batch, txt.seq + img.seq, heads, dim], contiguous
  RotarySource txt;    // first along the sequence; txt.seq may be 0
  RotarySource img;
  const float* cos;    // [txt.seq + img.seq, dim] contiguous (FLUX: the strides below 0, dim, 0), or the rows of
  const float* sin;    // [batch or 1, seq, heads * dim] (LTX-Video: one table across all heads, per sample)
  int64_t cos_stride_b;  // elements between samples' tables (0: one table for the batch)
  int64_t cos_stride_s;  // between positions
  int64_t cos_stride_h;  // between heads (0: every head reads the same [dim] row)
  int64_t batch;
  int64_t heads;
  int64_t dim;         // a multiple of 4; at most 128 with norm
  bool norm;
  bool wan;            // Wan's pairing (rotary.cu's rotate_pair_wan) instead of diffusers' (no norm, one table)
  bool norm_rows;      // torch.nn.RMSNorm(heads * dim) of each row first (img only; weight [heads * dim]), not `norm`
  bool norm_fp32;      // with `norm`: a float32 weight on x.float(), y and the rotary in float, one rounding (FLUX.3)
  bool norm_f32w;      // with `norm`: a float32 weight on x.float(), y rounded to T as `norm` does (Krea 2); with
                       // `norm_rows`: the row norm alone with a float32 weight, no rotary (cos, sin unused)
  DType dtype;
  int32_t norm_final;  // the row norm's mean square: 0 sum / C, 1 sum * (1 / C), 2 fma(sum, 1 / C, eps) (rotary.cu)
  // With norm_rows and norm_f32w (the row norm alone), the adaLN modulate after it (zero_centred_modulate: Krea 2's
  // `(1.0 + scale) * norm(x) + shift`), or null: out = round(round(y * round(1 + scale)) + shift) of the norm's rounded
  // y, scale and shift [batch, C] rows of x's dtype, row b read by sample b's rows (a stride of 0: one row for all).
  const void* mod_scale = nullptr;
  const void* mod_shift = nullptr;
  int64_t mod_scale_stride_b = 0;
  int64_t mod_shift_stride_b = 0;
  // With norm_rows and a weight of x's dtype (not norm_f32w), the modulate's rows picked per row of x through an
  // index (rms_norm_modulate_rows: MiniMax-H3's `norm(x) * (1.0 + scale.index_select(0, rows)) + shift.index_select(0,
  // rows)` after a torch.nn.RMSNorm), or null: row r of x (of batch * seq) reads row mod_index[r] of the
  // [mod_table_rows, C] scale and shift tables, their row strides mod_*_stride_b; an index outside the tables traps.
  const int32_t* mod_index = nullptr;
  int64_t mod_table_rows = 0;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_rotary(const RotaryArgs& args, cudaStream_t stream);
#endif

// The rotate-half rotary in the storage dtype over the first rot_dim = R channels of each head (Ideogram 4, Cosmos 3:
// `x * cos + rotate_half(x) * sin` written inline, R = dim; MiniMax-H3's partial form, R < dim, the rest passed
// through), rotate_half(x) = cat(-x[..., R/2:R], x[..., :R/2]), c = cos (of x's dtype) or round(cos) (float32 tables,
// cast to x's dtype first), the table row of x's row r being r % table_rows:
//   out[i]       = round(round(x[i] * c[i]) + round(-x[i + R/2] * s[i]))             i < R/2
//   out[i + R/2] = round(round(x[i + R/2] * c[i + R/2]) + round(x[i] * s[i + R/2]))
//   out[j]       = x[j]                                                               R <= j < dim
struct RotateHalfArgs {
  void* out;            // [rows, heads, dim], contiguous
  const void* x;        // [rows, heads, dim], contiguous
  const void* cos;      // [table_rows, rot_dim], contiguous, of x's dtype (or float32 with tables_f32)
  const void* sin;
  int64_t rows;
  int64_t heads;
  int64_t dim;
  int64_t rot_dim;      // even, at most dim
  int64_t table_rows;   // divides rows
  bool tables_f32;
  DType dtype;
  // Or null. With a weight (of x's dtype, [dim], dim a multiple of 4 and at most 128), x is first normalised per head
  // as torch.nn.RMSNorm(dim) with that weight and eps computes it on CUDA (aten's per-head order, rotary.cu's
  // head_rms_norm, the result rounded to x's dtype), and the formulas above read those normalised values
  // (qk_norm_rotary_half: MiniMax-H3's `attn.norm_q(query)` then its `_apply_rotary_emb`).
  const void* weight = nullptr;
  float eps = 0.f;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_rotate_half(const RotateHalfArgs& args, cudaStream_t stream);
#endif

// The matrix-form rotary of Kandinsky 5's and 6's processors (`apply_rotary(x, rope)`), float32 tables
// [table_rows, dim / 2, 2, 2] (rope[i] = [[cos, -sin], [sin, cos]] of pair i), the table row of x's row r being
// r % table_rows, shared by the heads: eager multiplies each table entry by the pair's float value (x_.float()
// broadcast as [..., dim / 2, 1, 2]) and sums the two products of a row of the 2x2 matrix with aten's sum, whose
// reduction starts each product from the identity: for each pair i (p = 2i) and r in {0, 1}
//   out[p + r] = round((0 + rope[i][r][0] * x[p]) + (0 + rope[i][r][1] * x[p + 1]))        (every op in float)
struct RotaryMatrixArgs {
  void* out;            // [rows, heads, dim], contiguous
  const void* x;        // [rows, heads, dim], contiguous
  const float* rope;    // [table_rows, dim / 2, 2, 2], contiguous
  int64_t rows;
  int64_t heads;
  int64_t dim;          // even
  int64_t table_rows;   // divides rows
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_rotary_matrix(const RotaryMatrixArgs& args, cudaStream_t stream);
#endif

// torch.nn.GroupNorm with weight and bias over contiguous [batch, channels, *] (HxW the product of the trailing
// dims), optionally followed by SiLU (see group_norm_silu.cu for aten's reduction order and every rounding point):
//   y   = round(fma(a, x, b)), a = rstd * gamma[c], b = fma(-a, mean, beta[c])     (mean, rstd: aten's statistics)
//   out = silu ? round(y / (1 + exp(-y))) : y
struct GroupNormSiluArgs {
  void* out;             // [batch, channels, HxW], contiguous
  const void* x;         // [batch, channels, HxW], contiguous, 16-byte aligned
  const void* gamma;     // [channels], of x's dtype
  const void* beta;      // [channels], of x's dtype
  float* partial;        // workspace: (mean, m2, nf) per aten warp of each row, [batch * groups * threads / 32, 3]
  int64_t batch;
  int64_t channels;
  int64_t groups;
  int64_t hxw;           // a multiple of 16 / sizeof(element)
  int64_t row_size;      // channels / groups * hxw: the elements of one (sample, group) row
  float eps;             // aten's static_cast<T>(eps), as float
  int32_t threads;       // aten's RowwiseMomentsCUDAKernel block: 32 (rows shorter than 512) or 512
  int32_t variant;       // which of the contraction choices (group_norm_silu.cu's bits); 0 is aten 2.11's
  bool silu;
  DType dtype;
  bool channels_last;    // out [batch, HxW, channels] (group_norm_apply_cl_kernel: a convolution's input), not like x
};

#ifndef __CUDACC_RTC__
cudaError_t launch_group_norm_silu(const GroupNormSiluArgs& args, cudaStream_t stream);
#endif

// Wan's / Qwen-Image's channel RMS norm after aten's norm: F.normalize's division onward, then SiLU if `silu`
// (channel_rmsnorm_silu.cu). Per element of x[b, c, s] (fp32 arithmetic, `round` to T after each eager kernel):
//   y = round(round(round(round(x / denom[b, s]) * scale) * gamma[c]) + bias)
//   out = silu ? round(y / (1 + exp(-y))) : y
struct ChannelRmsNormArgs {
  void* out;             // [batch, channels, spatial], contiguous
  const void* x;         // [batch, channels, spatial], contiguous, 16-byte aligned
  const float* denom;    // [batch, spatial] fp32: aten's x.float().norm(2, 1, keepdim=True).clamp_min(eps)
  const void* gamma;     // [channels] of x's dtype
  const void* bias;      // [channels] of x's dtype, or null: then `bias_value` (a python-float bias)
  int64_t batch;
  int64_t channels;
  int64_t spatial;       // any; a multiple of 16 / sizeof(element) takes the vector kernel
  float scale;           // the module's python-float scale as aten's mul takes it (cast to float)
  float bias_value;
  int32_t silu;          // 1: SiLU after the norm
  int32_t probe;         // 1: y = x (the SiLU alone, for the proof over every value of the dtype)
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_channel_rmsnorm(const ChannelRmsNormArgs& args, cudaStream_t stream);
#endif

// LTX-Video's VAE norm after aten's reduction and rsqrt (ltx_vae_rmsnorm.cu): out[b, c, s] = round(x[b, c, s] * rsqrt[b, s]);
// with `silu` the SiLU after it, round(silu(round(x * rsqrt))); in the `square` mode the fp32 x[b, c, s] * x[b, c, s]
// that aten's mean reduces; in the `probe` mode round(silu(x)) (the SiLU proof over every value of the dtype).
struct LtxRmsNormArgs {
  void* out;             // [batch, channels, spatial], contiguous
  const void* x;         // [batch, channels, spatial], each channel's spatial contiguous, 16-byte aligned
  const float* rsqrt;    // [batch, spatial] fp32: aten's torch.rsqrt(x.to(float32).pow(2).mean(C) + eps)
  int64_t batch;
  int64_t channels;
  int64_t spatial;       // a multiple of 16 / sizeof(element)
  int64_t x_batch_stride;    // elements between x's batches, a multiple of 16 / sizeof(element)
  int64_t x_channel_stride;  // elements between x's channels (>= spatial), likewise
  int32_t square;        // 1: out is fp32 x * x (rsqrt unused): the input of aten's mean
  int32_t silu;          // 1: the SiLU after the norm (the norm -> nonlinearity / norm_out -> conv_act pairs)
  int32_t probe;         // 1: out = round(silu(x)) (rsqrt unused): the SiLU alone, for the proof
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_ltx_rmsnorm(const LtxRmsNormArgs& args, cudaStream_t stream);
#endif

// LTX-2's VAE norm (diffusers' PerChannelRMSNorm) after aten's `torch.mean(x**2, 1, keepdim=True)`, then SiLU if `silu`
// (per_channel_rmsnorm.cu). Per element of x[b, c, s] (fp32 arithmetic, `round` to T after each eager kernel):
//   r = round(sqrt(round(mean[b, s] + eps)))
//   y = round(x[b, c, s] / r)
//   out = silu ? round(y / (1 + exp(-y))) : y
struct PerChannelRmsNormArgs {
  void* out;                 // [batch, channels, spatial], contiguous
  const void* x;             // [batch, channels, spatial]: each channel's spatial contiguous, channels
                             // `x_channel_stride` and batches `x_batch_stride` elements apart
  const void* mean;          // [batch, spatial] of x's dtype, contiguous: aten's mean of x**2 over the channels
  int64_t batch;
  int64_t channels;
  int64_t spatial;           // any; 16-byte vectors where it, both strides and the pointers allow
  int64_t x_batch_stride;
  int64_t x_channel_stride;
  float eps;                 // the module's python eps as aten's add takes it on the GPU (cast to float)
  int32_t silu;              // 1: SiLU after the norm
  int32_t probe;             // 1: out = silu(x) (the SiLU proof); 2: out = round(sqrt(round(x + eps))) (the rms
                             // proof); mean unused
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_per_channel_rmsnorm(const PerChannelRmsNormArgs& args, cudaStream_t stream);
// The same norm with x**2 and aten's channel mean computed in the kernel, in aten's order for `rows` and `ctas`
// (ops/per_channel_rmsnorm.py's aten_reduce_config), `factor` MeanOps' float 1 / C; args.mean is its scratch.
cudaError_t launch_per_channel_rmsnorm_fused(const PerChannelRmsNormArgs& args, int32_t rows, int32_t ctas,
                                             float factor, cudaStream_t stream);
#endif

// The fused norm's output written as the padded, channels-last input of the causal convolution after it
// (per_channel_rmsnorm.cu's pad kernel; ops/ltx_norm_conv.py): args.out is [batch, Tp, Hp, Wp, channels] memory with
// Tp = pad_t0 + frames + pad_t1 (the first and last frames repeated), Hp and Wp likewise (F.pad's reflection where
// reflect_hw, else pads 0); x's spatial is frames * height * width.
struct NormPadArgs {
  int64_t frames;
  int64_t height;
  int64_t width;
  int64_t pad_t0;
  int64_t pad_t1;
  int64_t pad_h0;
  int64_t pad_h1;
  int64_t pad_w0;
  int64_t pad_w1;
  int32_t reflect_hw;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_per_channel_rmsnorm_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad, int32_t rows,
                                              int32_t ctas, float factor, cudaStream_t stream);
// The same output from the channels-last result of the convolution before the norm, without its bias
// (per_channel_rmsnorm.cu's channels-last kernel; ops/ltx_bias_norm_conv.py): args.x is [batch, spatial, channels]
// memory (batches x_batch_stride elements apart; x_channel_stride unused), each value read as round(x + bias[c]);
// x, out and `bias` ([channels] of x's dtype) 16-byte aligned, channels a multiple of 16 bytes.
cudaError_t launch_per_channel_rmsnorm_cl_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad,
                                                 const void* bias, int32_t rows, int32_t ctas, float factor,
                                                 cudaStream_t stream);
// LTX-Video's VAE norm (and SiLU) in the same pad kernel (per_channel_rmsnorm.cu's kLtx; ops/ltx_vae_rmsnorm_conv.py):
// bf16 / fp16 x [batch, channels, spatial] as for the pad kernel, its squares and mean in fp32 (eager's pow(2) and
// mean of the fp32 upcast, aten's order from rows / ctas / factor), r = rsqrtf(m + eps), out round(x * r) then the
// SiLU where args.silu, stored as the pad kernel stores; args.probe 3 (kProbeMean): m alone, fp32 [batch, spatial].
cudaError_t launch_ltx_rmsnorm_fused_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad, int32_t rows,
                                           int32_t ctas, float factor, cudaStream_t stream);
// out[i] = rsqrtf(m[i] + eps) for n fp32 values (the kLtx pad kernel's reciprocal, for the Python op's proof).
cudaError_t launch_ltx_rsqrt_probe(const float* m, float* out, int64_t n, float eps, cudaStream_t stream);
#endif

// The 2x nearest upsampling of Wan's and Qwen-Image's VAEs (upsample_nearest.cu): x [batch, channels, height, width]
// with unit width stride, out a contiguous [batch, channels, 2 * height, 2 * width]:
//   out[n][c][2y + dy][2x + dx] = round(float(x[n][c][y][x]))
struct UpsampleNearestArgs {
  void* out;
  const void* x;
  int64_t batch;
  int64_t channels;
  int64_t height;
  int64_t width;
  int64_t stride_n;     // x's strides, in elements
  int64_t stride_c;
  int64_t stride_h;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_upsample_nearest2x(const UpsampleNearestArgs& args, cudaStream_t stream);
#endif

// A convolution's bias added in place (conv_bias.cu): x the convolution's dense output seen as [rows, cols],
//   channels-first: x[r][s] = round(float(x[r][s]) + float(bias[r % channels]))   (rows = N * C, cols = spatial)
//   channels-last:  x[r][c] = round(float(x[r][c]) + float(bias[c]))              (rows = N * spatial, cols = C)
struct ConvBiasArgs {
  void* x;
  const void* bias;     // [channels], contiguous
  int64_t rows;
  int64_t cols;
  int64_t channels;
  DType dtype;
  bool channels_last;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_conv_bias(const ConvBiasArgs& args, cudaStream_t stream);
#endif

// A causal convolution's padded input (causal_pad.cu): out a [batch, channels, pad_t0 + cache_frames + frames +
// pad_t1, pad_h0 + height + pad_h1, pad_w0 + width + pad_w1] holding the cache frames, then x's, inside a zero border
// (or the first and last frames repeated in time, replicate_t, and the rows and columns reflected, reflect_hw),
// contiguous or channels-last; x and cache with unit width stride (their other strides in elements).
struct CausalPadArgs {
  void* out;
  const void* x;
  const void* cache;    // null where cache_frames is 0
  int64_t batch;
  int64_t channels;
  int64_t frames;
  int64_t height;
  int64_t width;
  int64_t cache_frames;
  int64_t pad_t0;
  int64_t pad_t1;
  int64_t pad_h0;
  int64_t pad_h1;
  int64_t pad_w0;
  int64_t pad_w1;
  int64_t x_stride_b;
  int64_t x_stride_c;
  int64_t x_stride_t;
  int64_t x_stride_h;
  int64_t cache_stride_b;
  int64_t cache_stride_c;
  int64_t cache_stride_t;
  int64_t cache_stride_h;
  DType dtype;
  bool channels_last;   // out laid out [batch, T', H', W', channels] (channels_last_3d) instead of contiguous
  bool replicate_t;     // the time border: the first (last) source frame repeated, not zeros (LTX's forwards)
  bool reflect_hw;      // the spatial border: F.pad(mode="reflect")'s (each padding below its axis' size), not zeros
};

#ifndef __CUDACC_RTC__
cudaError_t launch_causal_pad(const CausalPadArgs& args, cudaStream_t stream);
// LTX-Video's VAE norm and the SiLU after it written as the causal convolution's padded input (causal_pad.cu's
// ltx_rmsnorm_pad_cl_kernel): args as launch_causal_pad's for x (bf16 / fp16; channels_last and replicate_t set, no
// cache), each value of x written as round(silu(round(x * rsqrt[b, s]))), `rsqrt` a contiguous fp32 [batch, frames *
// height * width] (aten's torch.rsqrt(mean + eps), which eager multiplies by).
cudaError_t launch_ltx_rmsnorm_pad_cl(const CausalPadArgs& args, const float* rsqrt, cudaStream_t stream);
// Wan's and Qwen-Image's VAE channel norm and the SiLU after it written as the causal convolution's padded input
// (causal_pad.cu's channel_rmsnorm_pad_cl_kernel): args as launch_causal_pad's for x (bf16 / fp16; channels_last set,
// no cache, the zero border), denom the contiguous fp32 [batch, frames * height * width] eager divides by, gamma (and
// bias, or the python-float bias_value) [channels] of x's dtype, scale the module's.
cudaError_t launch_channel_rmsnorm_pad_cl(const CausalPadArgs& args, const float* denom, const void* gamma,
                                         const void* bias, float scale, float bias_value, cudaStream_t stream);
#endif

// A channels-last convolution output's bias added into a new contiguous tensor (conv_bias.cu): x dense
// [batch, spatial, channels] (channels-last memory), out contiguous [batch, channels, spatial],
//   out[n][c][s] = round(float(x[n][s][c]) + float(bias[c]))
// and with a residual (contiguous [batch, channels, spatial], as out), that sum rounded and the residual added to it:
//   out[n][c][s] = round(float(round(float(x[n][s][c]) + float(bias[c]))) + float(residual[n][c][s]))
struct BiasContiguousArgs {
  void* out;
  const void* x;
  const void* bias;     // [channels], contiguous
  const void* residual; // nullptr, or [batch, channels, spatial] of x's sizes (the kernel's kResidual variant)
  int64_t batch;
  int64_t spatial;
  int64_t channels;
  // the residual's layout: 0, contiguous [batch, channels, spatial]; else time-major, a 5-D [B, C, T, H, W] laid out
  // as [B, T, C, H, W] (Wan's upsamplers' outputs, a resnet's identity shortcut after them), residual_plane = H * W
  int64_t residual_plane;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_bias_contiguous(const BiasContiguousArgs& args, cudaStream_t stream);
#endif

// A residual upsampler's output (LTX-Video's and LTX-2's LTX*VideoUpsampler3d, stride (2, 2, 2), residual) written
// from its convolution's channels-last output without the bias (conv_bias.cu): x dense [batch, frames, height, width,
// 8 * channels] (channels-last memory; channel c * 8 + dt * 4 + dh * 2 + dw is output channel c at frame 2 t + dt - 1,
// row 2 h + dh, column 2 w + dw), residual the upsampler's input [batch, 8 * groups, frames, height, width] contiguous
// (its channel (c % groups) * 8 + dt * 4 + dh * 2 + dw at (t, h, w) is the one added there), out contiguous
// [batch, channels, 2 * frames - 1, 2 * height, 2 * width] (the frame 2 t + dt - 1 = -1 dropped):
//   out[n][c][2t+dt-1][2h+dh][2w+dw] = round(float(round(float(x[n][t][h][w][8c+j]) + float(bias[8c+j])))
//                                            + float(residual[n][(c % groups) * 8 + j][t][h][w]))   (j = 4dt+2dh+dw)
struct BiasDepthToSpaceArgs {
  void* out;
  const void* x;         // 16-byte aligned
  const void* bias;      // [8 * channels], contiguous
  const void* residual;
  int64_t batch;
  int64_t channels;      // the output's (the convolution's / 8)
  int64_t groups;        // the residual's channels / 8
  int64_t frames;
  int64_t height;
  int64_t width;
  DType dtype;
};

#ifndef __CUDACC_RTC__
cudaError_t launch_bias_depth_to_space(const BiasDepthToSpaceArgs& args, cudaStream_t stream);
#endif

}  // namespace diffusers_fastpath
