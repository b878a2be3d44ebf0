// diffusers' rotary embedding on q or k, optionally fused with the torch.nn.RMSNorm before it and with the
// text/image concatenation of FLUX's dual blocks, bit-identical to the eager chain.
//
// RoPE, eager (diffusers.models.embeddings.apply_rotary_emb, use_real=True, use_real_unbind_dim=-1), x in T = bf16
// or fp16, cos/sin fp32 [S, D]:
//   x_rotated = stack([-x_imag, x_real], -1).flatten(3)   # T; negation is exact
//   out = (x.float() * cos + x_rotated.float() * sin).to(T)
// i.e. two fp32 products, one fp32 add (aten's add is `a + alpha * b` with alpha = 1, exact even if contracted),
// one rounding to T:
//   out[2i]   = round(x[2i] * cos[2i] + (-x[2i+1]) * sin[2i])
//   out[2i+1] = round(x[2i+1] * cos[2i+1] + x[2i] * sin[2i+1])
// with __fmul_rn/__fadd_rn so that nvcc cannot contract a product into the add. Exact by construction on any
// input: every NaN, inf and signed zero comes out of the same IEEE operations as in eager.
//
// RMSNorm (norm = true), eager torch.nn.RMSNorm(D) with a weight of x's dtype on CUDA: aten::rms_norm calls
// _fused_rms_norm, whose CUDA kernel (aten/src/ATen/native/cuda/layer_norm_kernel.cu,
// vectorized_layer_norm_kernel<T, float, rms_norm=true>, taken for 8-byte aligned rows with D % 4 == 0) runs one
// block (32, 4) per row. For D <= 128 only the first D/4 lanes of warp 0 hold data, four elements each
// (aligned_vector<T, 4>), and:
//   s_l  = fma(x3, x3, fma(x2, x2, fma(x1, x1, fma(x0, x0, 0))))  # `sigma2 + val * val`, contracted by nvcc
//   tot  = shuffle-down tree over offsets 16, 8, 4, 2, 1             # lanes without data add 0
//          (the shared-memory combine with the other 3 warps then adds exact zeros)
//   rstd = rsqrtf(tot / D + eps)                                     # IEEE division, c10::cuda::compat::rsqrt
//   y    = round(w * (rstd * x))                                     # two fp32 products, one rounding
// Checked against the sm_90 SASS of that kernel in torch 2.11.0+cu130's libtorch_cuda.so (bf16 and fp16): an FFMA
// chain over x0..x3 from 0, SHFL.DOWN + FADD over 16..1, the IEEE division (MUFU.RCP, Newton step, FCHK slow path),
// FADD eps, MUFU.RSQ with rsqrtf's denormal scaling, FMUL rstd * x then FMUL w * that, F2FP round-to-nearest. The
// order is still a property of the aten build, so the Python op verifies itself once per signature against eager.
//
// Layout: one block per (s, b) output row of `heads * dim` elements; each warp handles heads warp, warp + 8, ...
// (several loads in flight), lane l the four elements 4l..4l+3 of a head (and, for dim > 128 without norm, 4(l+32)...).
// The lane's cos/sin quads are loaded once per block and reused across heads, except where each head has its own
// slice of the table (cos_stride_h != 0: LTX-Video's [batch, seq, heads * dim] tables), loaded per head.
//
// LTX-Video's apply_rotary_emb(x, (cos, sin)) (transformer_ltx.py) is the same expression over [batch, seq, C] rows,
// x_rotated = stack([-x_imag, x_real], -1).flatten(2), with fp32 cos/sin [batch or 1, seq, C]: the kernel takes it as
// heads * dim = C (any split: every pair is computed on its own) with the tables' strides.
//
// The row norm (norm_rows: LTX-Video's and Wan's QK norms, torch.nn.RMSNorm(C) across all heads, C = heads * dim,
// before their rotary): aten's same vectorised kernel over rows of C > 128 elements, one block of (32, 4) threads
// (num_threads() = 128 on CUDA) per row. Thread t = lane + 32 * warp adds the squares of its 4-element vectors
// t, t + 128, ... (one FMA each, `sigma2 + val * val`), a shuffle-down tree over 16..1 sums each warp, shared memory
// sums warps 2, 3 into 0, 1 and then warp 1 into warp 0 (aten's halving), then rstd = rsqrtf(sum / C + eps) and
// y = round(w * (rstd * x)) as for the per-head norm. tools/rms_norm_order_probe.py showed that order on the H200
// (torch 2.11, D = 2048 / 3072 / 5120); how the sum becomes the mean square (kFinal*: an IEEE division, a product
// with the rounded reciprocal, or that product and + eps as one FMA; they differ only when C is not a power of two)
// is the argument norm_final, which the Python op takes from the probe. row_norm_rotary_kernel below.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kHeadsInFlight = 4;  // independent 8-byte loads per lane before the first use (24 heads / 8 warps = 3)

template <typename T>
struct alignas(8) Quad {
  T v[4];
};

// The kernel's forms (a template parameter, so that FLUX's kernels keep their registers, 63 at most: four blocks per
// SM, without the per-head table loads):
constexpr int kShared = 0;   // diffusers' pairing, one [seq, dim] table for every head (FLUX, with or without norm)
constexpr int kPerHead = 1;  // diffusers' pairing, each head its own slice of the tables (LTX-Video; never with norm)
constexpr int kWan = 2;      // Wan's pairing (below), one [seq, dim] table (never with the per-head norm)
// The row norm alone, with a float32 weight and no rotary (row_norm_rotary_kernel only): Krea 2's zero-centred
// pre-norms, F.rms_norm(x.float(), (C,), weight=w + 1.0, eps).to(T) (zero_centred_rmsnorm): aten runs the same
// vectorised kernel on the exactly upcast x (vec_size 4 for every dtype: the same lanes, FMA chains, shuffle tree
// and halving), its y = w * (rstd * x) a float that the cast rounds to T once
constexpr int kNoRotary = 3;
// ... and the adaLN modulate that reads it (zero_centred_modulate: Krea 2's `(1.0 + scale) * norm(x) + shift` with
// [B, 1, C] rows of x's dtype, RotaryArgs::mod_*): the norm's y rounded to T as kNoRotary writes it, then the three
// eager kernels of the modulate, each rounding to T: out = round(round(y * round(1 + scale)) + shift). The row is
// still read once and written once; the normalised rows are never stored.
constexpr int kNoRotaryModulate = 4;
// torch.nn.RMSNorm(C) itself (a weight of x's dtype: aten's vectorized_layer_norm_kernel<T, float, rms_norm=true>, the
// lanes, FMA chains and halving of the row norm above, y = round(w * (rstd * x)) with w the T weight read as float)
// and the adaLN modulate of rows picked per row of x through an index (rms_norm_modulate_rows: MiniMax-H3's
// `norm(x) * (1.0 + s.index_select(0, rows)) + t.index_select(0, rows)`, RotaryArgs::mod_index): the norm's y rounded
// to T, then kNoRotaryModulate's three roundings; row r of x reads row mod_index[r] of the scale and shift tables, and
// an index outside them traps (eager's index_select device-asserts). The rows move, nothing is computed from them.
constexpr int kNormModulateRows = 5;

// The norms (a template parameter too): none, or torch.nn.RMSNorm(dim) of each head (FLUX's QK norms, kShared only).
// torch.nn.RMSNorm(heads * dim) of the whole row (LTX-Video's and Wan's) is row_norm_rotary_kernel's, below.
constexpr int kNoNorm = 0;
constexpr int kHeadNorm = 1;
// FLUX.3's fp32 island (qk_norm_rope_fp32): torch.nn.RMSNorm(dim) with a float32 weight on x.float(), the rotary in
// float32, then `.to(T)`. aten runs the same vectorised kernel for float (vec_size is 4 for every dtype, so the same
// lanes, FMA chain and shuffle tree on the same exactly upcast values); its y = w * (rstd * x) stays a float, the
// rotary's products and sum are float operations, and the one rounding to T is the cast back:
//   out[2i] = round(y[2i] * cos[2i] + (-y[2i+1]) * sin[2i])   with y unrounded, w read as float
constexpr int kHeadNormF32 = 2;
// Krea 2's zero-centred QK norm (qk_norm_rope_zero_centred): F.rms_norm(x.float(), weight=w + 1.0) cast back to T,
// then the rotary in T: kHeadNorm's arithmetic (the norm's result rounded to T) with the float32 weight w + 1.0
constexpr int kHeadNormF32W = 3;
constexpr int kRowThreads = 128;  // aten's block for the row norm: (32, 4)
constexpr int kRowVecs = 16;      // vectors a thread of the row norm keeps in registers: C <= 128 * 4 * 16 = 8192
constexpr int kRowPairVecs = 8;   // ... of each of q and k, for the pair: C <= 4096

// The row norm's mean square from the sum of squares (RotaryArgs::norm_final).
constexpr int kFinalDiv = 0;  // sum / C
constexpr int kFinalMul = 1;  // sum * (1 / C)
constexpr int kFinalFma = 2;  // fma(sum, 1 / C, eps)

// aten's rstd of a row of `channels` elements from the block's sum of squares.
__device__ __forceinline__ float row_rstd(float sum, float channels, float eps, int final_form) {
  if (final_form == kFinalDiv) return rsqrtf(__fadd_rn(__fdiv_rn(sum, channels), eps));
  const float inv = __frcp_rn(channels);
  if (final_form == kFinalMul) return rsqrtf(__fadd_rn(__fmul_rn(sum, inv), eps));
  return rsqrtf(__fmaf_rn(sum, inv, eps));
}

// Wan's apply_rotary_emb (a function its WanAttnProcessor defines; x [B, S, H, D] bf16, cos/sin fp32 [1, S, 1, D]):
//   x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1); cos = freqs_cos[..., 0::2]; sin = freqs_sin[..., 1::2]
//   out = torch.empty_like(x); out[..., 0::2] = x1 * cos - x2 * sin; out[..., 1::2] = x1 * sin + x2 * cos
// i.e. per pair, every product and sum a separate fp32 operation and one rounding to T on the assignment:
//   out[2i]   = round(x[2i] * cos[2i] - x[2i+1] * sin[2i+1])
//   out[2i+1] = round(x[2i] * sin[2i+1] + x[2i+1] * cos[2i])
// (aten's sub is `a + (-1) * b`: a - b exactly, contracted or not). Exact by construction.
template <typename T>
__device__ __forceinline__ void rotate_pair_wan(float a, float b, float c0, float s1, T& out0, T& out1) {
  out0 = Storage<T>::store(__fsub_rn(__fmul_rn(a, c0), __fmul_rn(b, s1)));
  out1 = Storage<T>::store(__fadd_rn(__fmul_rn(a, s1), __fmul_rn(b, c0)));
}

// One quad (two pairs) of the kernel's form rotated and rounded: Wan's pairing (cos[2i], sin[2i+1]) or diffusers'.
template <typename T, int kForm>
__device__ __forceinline__ Quad<T> rotate_quad(const float (&v)[4], const float4& c, const float4& s) {
  Quad<T> o;
  if (kForm == kWan) {
    rotate_pair_wan<T>(v[0], v[1], c.x, s.y, o.v[0], o.v[1]);
    rotate_pair_wan<T>(v[2], v[3], c.z, s.w, o.v[2], o.v[3]);
  } else {
    rotate_pair<T>(v[0], v[1], c.x, c.y, s.x, s.y, o.v[0], o.v[1]);
    rotate_pair<T>(v[2], v[3], c.z, c.w, s.z, s.w, o.v[2], o.v[3]);
  }
  return o;
}

// aten's RMSNorm of one head of up to 128 elements spread over a warp, four a lane (lanes without data hold zeros):
// each lane's FMA chain of squares, the shuffle-down tree over 16..1, rstd = rsqrtf(sum / dim + eps), and
// v = round(w * (rstd * v)) in place (the file head).
template <typename T, bool kRound = true>
__device__ __forceinline__ void head_rms_norm(float (&v)[4], const float (&w)[4], float dim, float eps) {
  float acc = 0.f;
#pragma unroll
  for (int j = 0; j < 4; ++j) acc = __fmaf_rn(v[j], v[j], acc);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, offset));
  const float total = __shfl_sync(0xffffffffu, acc, 0);
  const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(total, dim), eps));
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const float y = __fmul_rn(w[j], __fmul_rn(rstd, v[j]));
    v[j] = kRound ? round_to<T>(y) : y;  // kHeadNormF32: aten's float result, not rounded
  }
}

// The norm's weight quad of lane quad q: of T (kHeadNorm) or float (kHeadNormF32, kHeadNormF32W), as floats.
template <typename T, int kNorm>
__device__ __forceinline__ void load_weight_quad(const void* weight, int q, float (&w)[4]) {
  if (kNorm == kHeadNormF32 || kNorm == kHeadNormF32W) {
    const float4 wf = load_readonly(reinterpret_cast<const float4*>(weight) + q);
    w[0] = wf.x;
    w[1] = wf.y;
    w[2] = wf.z;
    w[3] = wf.w;
  } else {
    const Quad<T> wq = load_readonly(reinterpret_cast<const Quad<T>*>(weight) + q);
#pragma unroll
    for (int j = 0; j < 4; ++j) w[j] = Storage<T>::load(wq.v[j]);
  }
}

template <typename T, int kNorm, int kForm>
__global__ void __launch_bounds__(kThreads) rotary_kernel(const RotaryArgs a) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const bool is_txt = s < a.txt.seq;
  const RotarySource src = is_txt ? a.txt : a.img;
  const int64_t s_src = is_txt ? s : s - a.txt.seq;
  const T* x_row = static_cast<const T*>(src.ptr) + b * src.stride_b + s_src * src.stride_s;
  const int64_t seq = a.txt.seq + a.img.seq;
  T* out_row = static_cast<T*>(a.out) + (b * seq + s) * a.heads * a.dim;
  const int quads = static_cast<int>(a.dim / 4);
  const int64_t table = b * a.cos_stride_b + s * a.cos_stride_s;  // this row's tables (cos and sin share strides)
  const float* cos_row = a.cos + table;
  const float* sin_row = a.sin + table;

  // kHeadNorm: quads <= 32, one pass in which every lane takes part in the shuffles.
  for (int q0 = 0; q0 < quads; q0 += 32) {
    const int q = q0 + lane;
    const bool active = q < quads;
    float4 c = make_float4(0.f, 0.f, 0.f, 0.f), sn = c;
    float w[4] = {0.f, 0.f, 0.f, 0.f};
    if (active && kForm != kPerHead) {
      c = reinterpret_cast<const float4*>(cos_row)[q];
      sn = reinterpret_cast<const float4*>(sin_row)[q];
    }
    if (active && kNorm == kHeadNorm) {
      const Quad<T> wq = reinterpret_cast<const Quad<T>*>(src.weight)[q];
#pragma unroll
      for (int j = 0; j < 4; ++j) w[j] = Storage<T>::load(wq.v[j]);
    }
    if (active && (kNorm == kHeadNormF32 || kNorm == kHeadNormF32W)) load_weight_quad<T, kNorm>(src.weight, q, w);
    for (int64_t h0 = warp; h0 < a.heads; h0 += kWarps * kHeadsInFlight) {
      Quad<T> xin[kHeadsInFlight];
      float4 cin[kHeadsInFlight], sin_in[kHeadsInFlight];  // kPerHead: each head's table quads, loaded with its x
#pragma unroll
      for (int i = 0; i < kHeadsInFlight; ++i) {
        const int64_t h = h0 + i * kWarps;
        if (active && h < a.heads) {
          xin[i] = reinterpret_cast<const Quad<T>*>(x_row + h * src.stride_h)[q];
          if (kForm == kPerHead) {
            cin[i] = reinterpret_cast<const float4*>(cos_row + h * a.cos_stride_h)[q];
            sin_in[i] = reinterpret_cast<const float4*>(sin_row + h * a.cos_stride_h)[q];
          }
        }
      }
#pragma unroll
      for (int i = 0; i < kHeadsInFlight; ++i) {
        const int64_t h = h0 + i * kWarps;
        if (h >= a.heads) break;  // warp-uniform: the whole warp leaves together
        float v[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) v[j] = active ? Storage<T>::load(xin[i].v[j]) : 0.f;
        if (kNorm != kNoNorm) head_rms_norm<T, kNorm != kHeadNormF32>(v, w, static_cast<float>(a.dim), src.eps);
        if (active) {
          if (kForm == kPerHead) {
            c = cin[i];
            sn = sin_in[i];
          }
          reinterpret_cast<Quad<T>*>(out_row + h * a.dim)[q] = rotate_quad<T, kForm>(v, c, sn);
        }
      }
    }
  }
}

// The shared-table form at dim 128, with the per-head norm (kHeadNorm: every FLUX.1 / Chroma / FLUX.2 attention) or
// without (rotary_emb: where the norm runs on its own): rotary_kernel's operations in the same order, laid out for
// bandwidth. Four warps a row, each issuing the loads of kHeadSlots heads (24 heads: all of a row's loads) before the
// first use, the operands through the read-only path, and each field of the row's source chosen on its own (no struct
// selected at run time). On the H200 at FLUX.1-dev's 4608 x 24 x 128 (tools/kernel_layout_probe.py at 0033c35,
// inputs past the L2, one CUDA graph): 18.0 us against 26.4 for rotary_kernel's eight warps of four slots (85% against
// 58% of a device-to-device copy's bandwidth); eight warps of three slots in this layout took 20.2 us, 16 lanes a head
// with 16-byte loads 20.0-21.6 us. rotary_kernel itself with four warps of six slots took 29.3 us (0f077e9: its
// generic loop and struct selection cost registers and spills). In the bench at 29a53bb: qk_norm_rope 19.3 us (90%),
// rotary_emb 16.4 us (102%).
constexpr int kHeadWarps = 4;
constexpr int kHeadThreads = kHeadWarps * 32;
constexpr int kHeadSlots = 6;
constexpr int kHeadDim = 128;  // 32 lanes x one quad: the whole head in one pass

template <typename T, int kNorm>
__global__ void __launch_bounds__(kHeadThreads) head_norm_rotary_kernel(const RotaryArgs a) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const bool is_txt = s < a.txt.seq;
  const int64_t s_src = is_txt ? s : s - a.txt.seq;
  const T* x_row = static_cast<const T*>(is_txt ? a.txt.ptr : a.img.ptr) +
                   b * (is_txt ? a.txt.stride_b : a.img.stride_b) + s_src * (is_txt ? a.txt.stride_s : a.img.stride_s);
  const int64_t stride_h = is_txt ? a.txt.stride_h : a.img.stride_h;
  const void* weight = is_txt ? a.txt.weight : a.img.weight;
  const float eps = is_txt ? a.txt.eps : a.img.eps;
  const int heads = static_cast<int>(a.heads);
  T* out_row = static_cast<T*>(a.out) + (b * (a.txt.seq + a.img.seq) + s) * heads * kHeadDim;
  const float4 c = load_readonly(reinterpret_cast<const float4*>(a.cos + s * a.cos_stride_s) + lane);
  const float4 sn = load_readonly(reinterpret_cast<const float4*>(a.sin + s * a.cos_stride_s) + lane);
  float w[4] = {0.f, 0.f, 0.f, 0.f};
  if (kNorm != kNoNorm) load_weight_quad<T, kNorm>(weight, lane, w);
  for (int h0 = warp; h0 < heads; h0 += kHeadWarps * kHeadSlots) {
    Quad<T> xin[kHeadSlots];
#pragma unroll
    for (int i = 0; i < kHeadSlots; ++i) {
      const int h = h0 + i * kHeadWarps;
      if (h < heads) xin[i] = load_readonly(reinterpret_cast<const Quad<T>*>(x_row + h * stride_h) + lane);
    }
#pragma unroll
    for (int i = 0; i < kHeadSlots; ++i) {
      const int h = h0 + i * kHeadWarps;
      if (h >= heads) break;  // warp-uniform
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = Storage<T>::load(xin[i].v[j]);
      if (kNorm != kNoNorm) head_rms_norm<T, kNorm != kHeadNormF32>(v, w, static_cast<float>(kHeadDim), eps);
      reinterpret_cast<Quad<T>*>(out_row + h * kHeadDim)[lane] = rotate_quad<T, kShared>(v, c, sn);
    }
  }
}

// The norm-only forms' per-row tables (kNoRotaryModulate: sample b's scale and shift rows; kNormModulateRows: the rows
// picked through the index, which traps outside the tables as eager's index_select device-asserts; kNoRotary: none).
template <typename T>
struct NormOnlyRows {
  const Quad<T>* scale = nullptr;
  const Quad<T>* shift = nullptr;
};

template <typename T, int kForm>
__device__ __forceinline__ NormOnlyRows<T> norm_only_rows(const RotaryArgs& a, int64_t row, int64_t b) {
  NormOnlyRows<T> r;
  if constexpr (kForm == kNoRotaryModulate) {
    r.scale = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.mod_scale) + b * a.mod_scale_stride_b);
    r.shift = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.mod_shift) + b * a.mod_shift_stride_b);
  }
  if constexpr (kForm == kNormModulateRows) {
    const int64_t picked = a.mod_index[row];
    if (picked < 0 || picked >= a.mod_table_rows) __trap();  // eager's index_select: index out of bounds
    r.scale = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.mod_scale) + picked * a.mod_scale_stride_b);
    r.shift = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.mod_shift) + picked * a.mod_shift_stride_b);
  }
  return r;
}

// Output quad v of a row of the norm-only forms from the row's rstd and x's quad: y = round(w * (rstd * x)), w the
// float32 weight (kNormModulateRows: the T weight), the whole result (kNoRotary), or the modulate's input, then eager's
// three modulate kernels after the norm's cast: round(round(y * round(1 + s)) + t).
template <typename T, int kForm>
__device__ __forceinline__ Quad<T> norm_only_quad(const RotaryArgs& a, const NormOnlyRows<T>& rows, int v, float rstd,
                                                  const Quad<T>& xq) {
  float wv[4];
  if constexpr (kForm == kNormModulateRows) {
    const Quad<T> w = reinterpret_cast<const Quad<T>*>(a.img.weight)[v];
#pragma unroll
    for (int j = 0; j < 4; ++j) wv[j] = Storage<T>::load(w.v[j]);
  } else {
    const float4 w = reinterpret_cast<const float4*>(a.img.weight)[v];
    wv[0] = w.x;
    wv[1] = w.y;
    wv[2] = w.z;
    wv[3] = w.w;
  }
  Quad<T> o;
  if constexpr (kForm == kNoRotary) {
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o.v[j] = Storage<T>::store(__fmul_rn(wv[j], __fmul_rn(rstd, Storage<T>::load(xq.v[j]))));
    }
  } else {
    const Quad<T> sc = load_readonly(rows.scale + v);
    const Quad<T> sh = load_readonly(rows.shift + v);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y = round_to<T>(__fmul_rn(wv[j], __fmul_rn(rstd, Storage<T>::load(xq.v[j]))));
      const float one_plus_scale = round_to<T>(__fadd_rn(1.0f, Storage<T>::load(sc.v[j])));
      o.v[j] = Storage<T>::store(__fadd_rn(round_to<T>(__fmul_rn(one_plus_scale, y)), Storage<T>::load(sh.v[j])));
    }
  }
  return o;
}

// The row norm (norm_rows): one block of aten's (32, 4) threads per (s, b) row of C = heads * dim elements. Thread t
// loads its 4-element vectors t, t + 128, ... (at most kVecs, kept in registers: the row is read once), adds their
// squares in aten's order (the header comment), and then normalises, rotates and writes those same vectors. The
// tables: LTX-Video's [batch or 1, seq, C] rows (kPerHead: the quad at channel 4v), Wan's [seq, dim] (kWan: at 4v mod
// dim); the weight [C]. kPair (kPerHead only): the block does the same for a second source (txt: k, with its own
// weight and eps) with the table quads it loaded once, writing it after the first's whole output (LTX-Video's q and
// k share their large per-sample tables, four times the bytes of q: read once for both).
template <typename T, int kForm, bool kPair>
__global__ void __launch_bounds__(kRowThreads) row_norm_rotary_kernel(const RotaryArgs a) {
  constexpr int kParts = kPair ? 2 : 1;
  constexpr int kVecs = kPair ? kRowPairVecs : kRowVecs;
  __shared__ float partial[kParts][3];  // two warps' sums, then the row's rstd (one array: one layout everywhere)
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const int quads = static_cast<int>(a.dim / 4);
  const int vecs = static_cast<int>(a.heads) * quads;
  // Wan's table quad: the same for all of a thread's vectors (v = t + 128 k and quads divides 128: v mod quads = t mod
  // quads)
  const int wan_quad = kForm == kWan ? 4 * (static_cast<int>(threadIdx.x) % quads) : 0;

  Quad<T> cache[kParts][kVecs];
  float acc[kParts];
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    const RotarySource& src = p == 0 ? a.img : a.txt;
    const T* x_row = static_cast<const T*>(src.ptr) + b * src.stride_b + s * src.stride_s;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = static_cast<int>(threadIdx.x) + k * kRowThreads;
      if (v < vecs) cache[p][k] = reinterpret_cast<const Quad<T>*>(x_row)[v];  // heads back to back (stride_h == dim)
    }
  }
#pragma unroll
  for (int p = 0; p < kParts; ++p) {
    acc[p] = 0.f;  // aten's `sigma2 + val * val` over the thread's elements in order, contracted: one FMA each
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      if (static_cast<int>(threadIdx.x) + k * kRowThreads < vecs) {
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const float x = Storage<T>::load(cache[p][k].v[j]);
          acc[p] = __fmaf_rn(x, x, acc[p]);
        }
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      acc[p] = __fadd_rn(acc[p], __shfl_down_sync(0xffffffffu, acc[p], offset));
    }
  }
  // aten's shared-memory halving: warps 2, 3 into 0, 1, then warp 1 into warp 0
  const int warps = static_cast<int>(blockDim.x) / 32;
  for (int offset = warps / 2; offset > 0; offset /= 2) {
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      if (lane == 0 && warp >= offset && warp < 2 * offset) partial[p][warp - offset] = acc[p];
    }
    __syncthreads();
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      if (lane == 0 && warp < offset) acc[p] = __fadd_rn(acc[p], partial[p][warp]);
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
#pragma unroll
    for (int p = 0; p < kParts; ++p) {
      partial[p][2] = row_rstd(acc[p], static_cast<float>(4 * vecs), (p == 0 ? a.img : a.txt).eps, a.norm_final);
    }
  }
  __syncthreads();

  const int64_t row = b * a.img.seq + s;
  if constexpr (kForm == kNoRotary || kForm == kNoRotaryModulate || kForm == kNormModulateRows) {
    const float rstd = partial[0][2];
    T* out_row = static_cast<T*>(a.out) + row * (4 * static_cast<int64_t>(vecs));
    const NormOnlyRows<T> rows = norm_only_rows<T, kForm>(a, row, b);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = static_cast<int>(threadIdx.x) + k * kRowThreads;
      if (v < vecs) reinterpret_cast<Quad<T>*>(out_row)[v] = norm_only_quad<T, kForm>(a, rows, v, rstd, cache[0][k]);
    }
    return;
  }
  const int64_t part_stride = a.batch * a.img.seq * (4 * static_cast<int64_t>(vecs));  // kPair: k's output after q's
  const int64_t table = b * a.cos_stride_b + s * a.cos_stride_s;
  const float* cos_row = a.cos + table;
  const float* sin_row = a.sin + table;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = static_cast<int>(threadIdx.x) + k * kRowThreads;
    if (v < vecs) {
      const int c = 4 * v;
      const int t = kForm == kWan ? wan_quad : c;
      const float4 cs = *reinterpret_cast<const float4*>(cos_row + t);
      const float4 sn = *reinterpret_cast<const float4*>(sin_row + t);
#pragma unroll
      for (int p = 0; p < kParts; ++p) {
        const RotarySource& src = p == 0 ? a.img : a.txt;
        const float rstd = partial[p][2];
        const Quad<T> wq = reinterpret_cast<const Quad<T>*>(src.weight)[v];
        float y[4];
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          y[j] = round_to<T>(__fmul_rn(Storage<T>::load(wq.v[j]), __fmul_rn(rstd, Storage<T>::load(cache[p][k].v[j]))));
        }
        T* out_row = static_cast<T*>(a.out) + p * part_stride + row * (4 * static_cast<int64_t>(vecs));
        reinterpret_cast<Quad<T>*>(out_row + c)[0] = rotate_quad<T, kForm>(y, cs, sn);
      }
    }
  }
}

// The norm-only forms (kNoRotary, kNoRotaryModulate, kNormModulateRows) on rows of at most 128 elements (Krea 2's
// text refiner's zero-centred norms of 128-wide heads, [512, 12, 20, 128]): aten's block (32, 4) per row holds data in
// warp 0's first C / 4 lanes only (one vector each: 4t >= C for t >= 32), its other three warps add exact zeros in the
// halving (a sum of squares is never -0), so the order is lane l's FMA chain over its quad, the shuffle-down tree over
// 16..1 and the row's rstd from lane 0's sum: row_norm_rotary_kernel's order, which a warp reproduces alone. One warp a
// row, kNarrowRowsPerWarp consecutive rows each with all their loads in flight before the first sum (a block of 128
// threads a row left three warps idle and 16 rows in flight per SM: 324 us against eager's 183 at [512, 12, 20, 128]).
constexpr int kNarrowWarps = 8;
constexpr int kNarrowRowsPerWarp = 4;
constexpr int kNarrowRowsPerBlock = kNarrowWarps * kNarrowRowsPerWarp;
constexpr int kNarrowWidest = 128;  // 32 lanes x one quad

template <typename T, int kForm>
__global__ void __launch_bounds__(kNarrowWarps * 32) narrow_row_norm_kernel(const RotaryArgs a) {
  const int lane = threadIdx.x & 31;
  const int vecs = static_cast<int>(a.heads * (a.dim / 4));
  const int64_t rows = a.batch * a.img.seq;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kNarrowWarps + (threadIdx.x >> 5)) * kNarrowRowsPerWarp;
  if (first >= rows) return;  // the whole warp: no shuffle below is left without its lanes
  const bool has = lane < vecs;
  Quad<T> xq[kNarrowRowsPerWarp];
#pragma unroll
  for (int i = 0; i < kNarrowRowsPerWarp; ++i) {
    const int64_t row = first + i;
    if (has && row < rows) {
      const int64_t b = row / a.img.seq;
      const T* x_row = static_cast<const T*>(a.img.ptr) + b * a.img.stride_b + (row - b * a.img.seq) * a.img.stride_s;
      xq[i] = load_readonly(reinterpret_cast<const Quad<T>*>(x_row) + lane);
    }
  }
#pragma unroll
  for (int i = 0; i < kNarrowRowsPerWarp; ++i) {
    const int64_t row = first + i;
    if (row >= rows) break;  // warp-uniform
    float acc = 0.f;  // aten's `sigma2 + val * val` over the lane's quad, contracted: one FMA each
    if (has) {
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float x = Storage<T>::load(xq[i].v[j]);
        acc = __fmaf_rn(x, x, acc);
      }
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, offset));
    const float rstd = row_rstd(__shfl_sync(0xffffffffu, acc, 0), static_cast<float>(4 * vecs), a.img.eps,
                                a.norm_final);
    const NormOnlyRows<T> tables = norm_only_rows<T, kForm>(a, row, row / a.img.seq);
    if (has) {
      T* out_row = static_cast<T*>(a.out) + row * (4 * static_cast<int64_t>(vecs));
      reinterpret_cast<Quad<T>*>(out_row)[lane] = norm_only_quad<T, kForm>(a, tables, lane, rstd, xq[i]);
    }
  }
}

// The rotate-half form (RotateHalfArgs, fastpath.h), as Ideogram 4's and Cosmos 3's processors write it and MiniMax-H3's
// _apply_rotary_emb computes it, in the storage dtype T: `x * c` and `rotate_half(x) * s` are aten multiplies of two T
// tensors (a float product, rounded to T), their sum an aten add of two T tensors (a float sum, rounded to T); the
// negation in rotate_half is exact; MiniMax-H3's float32 tables are cast to T first (one rounding each, tables_f32),
// and its channels past rot_dim are copied. Exact by construction (each operation a separate IEEE one,
// __fmul_rn/__fadd_rn). One block of kHalfThreads per row (a token), each thread the pairs (i, i + R/2) of the row's
// heads in turn, then the pass-through channels.
constexpr int kHalfThreads = 256;

template <typename T>
__device__ __forceinline__ float half_table(const void* table, int64_t i, bool f32) {
  return f32 ? round_to<T>(static_cast<const float*>(table)[i]) : Storage<T>::load(static_cast<const T*>(table)[i]);
}

template <typename T>
__global__ void __launch_bounds__(kHalfThreads) rotate_half_kernel(const RotateHalfArgs a) {
  const int64_t row = blockIdx.x;
  const int dim = static_cast<int>(a.dim);
  const int half = static_cast<int>(a.rot_dim / 2);
  const int pairs = static_cast<int>(a.heads) * half;
  const T* x = static_cast<const T*>(a.x) + row * a.heads * dim;
  const int64_t t = (row % a.table_rows) * a.rot_dim;
  T* out = static_cast<T*>(a.out) + row * a.heads * dim;
  for (int p = threadIdx.x; p < pairs; p += kHalfThreads) {
    const int h = p / half;
    const int i = p - h * half;
    const int lo = h * dim + i;
    const float x1 = Storage<T>::load(x[lo]);
    const float x2 = Storage<T>::load(x[lo + half]);
    const float a1 = round_to<T>(__fmul_rn(x1, half_table<T>(a.cos, t + i, a.tables_f32)));
    const float b1 = round_to<T>(__fmul_rn(-x2, half_table<T>(a.sin, t + i, a.tables_f32)));
    const float a2 = round_to<T>(__fmul_rn(x2, half_table<T>(a.cos, t + i + half, a.tables_f32)));
    const float b2 = round_to<T>(__fmul_rn(x1, half_table<T>(a.sin, t + i + half, a.tables_f32)));
    out[lo] = Storage<T>::store(__fadd_rn(a1, b1));
    out[lo + half] = Storage<T>::store(__fadd_rn(a2, b2));
  }
  const int rest = dim - 2 * half;  // the channels past rot_dim, copied
  for (int p = threadIdx.x; p < static_cast<int>(a.heads) * rest; p += kHalfThreads) {
    const int j = (p / rest) * dim + 2 * half + p % rest;
    out[j] = x[j];
  }
}

// The rotate-half form after the QK norm of each head (RotateHalfArgs::weight set; qk_norm_rotary_half: MiniMax-H3's
// `query = attn.norm_q(query)` then `query = _apply_rotary_emb(query, cos, sin)`): torch.nn.RMSNorm(dim) of each head
// with a weight of T, dim a multiple of 4 and at most 128, in aten's order (head_rms_norm, the per-head norm of the
// file head: the lanes' FMA chains, the shuffle tree, rsqrtf(sum / dim + eps), y = round(w * (rstd * x)), the result
// rounded to T as eager stores it), then rotate_half_kernel's roundings on those values over the first rot_dim
// channels, the channels past it the norm's values. The normalised rows are never stored. One block of kHalfNormWarps
// warps per row (a token); each warp normalises a head at a time (the loads of kHalfNormSlots heads in flight), lane l
// the channels 4l..4l+3. The partner of channel i (i + R/2 below R/2, i - R/2 up to R) is element (i +- R/2) % 4 of
// lane (i +- R/2) / 4: for each direction, four shuffles, shuffle m carrying every lane's element m to the lane whose
// channel j = (m -+ R/2) % 4 wants it (one such channel per lane and direction, for any even R). A lane's table values
// (its channels below R, rounded to T where the tables are float32) are loaded once per row and serve every head.
constexpr int kHalfNormWarps = 4;
constexpr int kHalfNormThreads = kHalfNormWarps * 32;
constexpr int kHalfNormSlots = 7;  // MiniMax-H3's 56 heads: two passes of the four warps

// The values of v's partners in the rotate-half pairing over `rot` channels of the warp's head (lane l holding
// channels 4l..4l+3 in v): partner[j] = y[4l + j + half] below half, y[4l + j - half] from half to rot.
__device__ __forceinline__ void rotate_half_partners(const float (&v)[4], int lane, int half, int rot,
                                                     float (&partner)[4]) {
#pragma unroll
  for (int dir = 1; dir >= -1; dir -= 2) {
#pragma unroll
    for (int m = 0; m < 4; ++m) {
      const int wanted = (m - dir * half) & 3;  // the lane's channel that element m of some lane is the partner of
      const int i = 4 * lane + wanted;
      const bool wants = dir > 0 ? i < half : (i >= half && i < rot);
      const float got = __shfl_sync(0xffffffffu, v[m], wants ? (i + dir * half) >> 2 : lane);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        if (wants && j == wanted) partner[j] = got;
      }
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kHalfNormThreads) head_norm_rotate_half_kernel(const RotateHalfArgs a) {
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const int dim = static_cast<int>(a.dim);
  const int rot = static_cast<int>(a.rot_dim);
  const int half = rot / 2;
  const int heads = static_cast<int>(a.heads);
  const bool active = 4 * lane < dim;  // lanes past the head hold zeros for the norm's shuffles
  const T* x_row = static_cast<const T*>(a.x) + row * a.heads * a.dim;
  T* out_row = static_cast<T*>(a.out) + row * a.heads * a.dim;
  const int64_t t = (row % a.table_rows) * a.rot_dim;
  float w[4] = {0.f, 0.f, 0.f, 0.f};
  float c[4] = {0.f, 0.f, 0.f, 0.f};
  float sn[4] = {0.f, 0.f, 0.f, 0.f};
  if (active) {
    load_weight_quad<T, kHeadNorm>(a.weight, lane, w);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int i = 4 * lane + j;
      if (i < rot) {
        c[j] = half_table<T>(a.cos, t + i, a.tables_f32);
        sn[j] = half_table<T>(a.sin, t + i, a.tables_f32);
      }
    }
  }
  for (int h0 = warp; h0 < heads; h0 += kHalfNormWarps * kHalfNormSlots) {
    Quad<T> xin[kHalfNormSlots];
#pragma unroll
    for (int k = 0; k < kHalfNormSlots; ++k) {
      const int h = h0 + k * kHalfNormWarps;
      if (active && h < heads) xin[k] = load_readonly(reinterpret_cast<const Quad<T>*>(x_row + h * dim) + lane);
    }
#pragma unroll
    for (int k = 0; k < kHalfNormSlots; ++k) {
      const int h = h0 + k * kHalfNormWarps;
      if (h >= heads) break;  // warp-uniform
      float v[4];
#pragma unroll
      for (int j = 0; j < 4; ++j) v[j] = active ? Storage<T>::load(xin[k].v[j]) : 0.f;
      head_rms_norm<T>(v, w, static_cast<float>(dim), a.eps);
      float partner[4] = {0.f, 0.f, 0.f, 0.f};
      rotate_half_partners(v, lane, half, rot, partner);
      if (active) {
        Quad<T> o;
#pragma unroll
        for (int j = 0; j < 4; ++j) {
          const int i = 4 * lane + j;
          if (i < half) {  // round(round(y[i] * c[i]) + round(-y[i + R/2] * s[i]))
            o.v[j] = Storage<T>::store(__fadd_rn(round_to<T>(__fmul_rn(v[j], c[j])),
                                                 round_to<T>(__fmul_rn(-partner[j], sn[j]))));
          } else if (i < rot) {  // round(round(y[i] * c[i]) + round(y[i - R/2] * s[i]))
            o.v[j] = Storage<T>::store(__fadd_rn(round_to<T>(__fmul_rn(v[j], c[j])),
                                                 round_to<T>(__fmul_rn(partner[j], sn[j]))));
          } else {
            o.v[j] = Storage<T>::store(v[j]);  // passed through: the norm's value, rounded already
          }
        }
        reinterpret_cast<Quad<T>*>(out_row + h * dim)[lane] = o;
      }
    }
  }
}

// The matrix form (RotaryMatrixArgs, fastpath.h), as Kandinsky 5's and 6's apply_rotary compute it: the products
// `rope.float() * x_` are one aten multiply in float, each rounded once; `.sum(dim=-1)` over the two products of a
// matrix row is aten's reduce kernel, whose threads each start their accumulators from the identity 0 and whose
// combine adds them: (0 + p0) + (0 + p1) (+ 0 for the unused accumulators, which changes no value but a -0, and
// (0 + p0) is never -0); one rounding to T. Exact by construction in this order (p0 + p1 alone differs where both are
// -0). One block of kMatrixThreads per row (a token), each thread a pair of a head in turn; the row's table (dim / 2
// float4, one per pair) is shared by the heads and stays in L1.
constexpr int kMatrixThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kMatrixThreads) rotary_matrix_kernel(const RotaryMatrixArgs a) {
  const int64_t row = blockIdx.x;
  const int half = static_cast<int>(a.dim / 2);
  const int pairs = static_cast<int>(a.heads) * half;
  const T* x = static_cast<const T*>(a.x) + row * a.heads * a.dim;
  T* out = static_cast<T*>(a.out) + row * a.heads * a.dim;
  const float4* rope = reinterpret_cast<const float4*>(a.rope) + (row % a.table_rows) * half;
  for (int p = threadIdx.x; p < pairs; p += kMatrixThreads) {
    const int i = p % half;
    const float x0 = Storage<T>::load(x[2 * p]);
    const float x1 = Storage<T>::load(x[2 * p + 1]);
    const float4 m = rope[i];  // (r, c) = (0, 0), (0, 1), (1, 0), (1, 1)
    const float o0 = __fadd_rn(__fadd_rn(0.0f, __fmul_rn(m.x, x0)), __fadd_rn(0.0f, __fmul_rn(m.y, x1)));
    const float o1 = __fadd_rn(__fadd_rn(0.0f, __fmul_rn(m.z, x0)), __fadd_rn(0.0f, __fmul_rn(m.w, x1)));
    out[2 * p] = Storage<T>::store(o0);
    out[2 * p + 1] = Storage<T>::store(o1);
  }
}

#ifndef __CUDACC_RTC__  // the host launchers; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch_matrix(const RotaryMatrixArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.heads == 0 || a.dim == 0) return cudaSuccess;
  if (a.dim % 2 != 0 || a.table_rows <= 0 || a.rows % a.table_rows != 0 || a.rows > 0x7fffffff ||
      a.heads * a.dim > 0x7fffffff || reinterpret_cast<uintptr_t>(a.rope) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  rotary_matrix_kernel<T><<<static_cast<unsigned>(a.rows), kMatrixThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_half(const RotateHalfArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.heads == 0 || a.dim == 0) return cudaSuccess;
  if (a.rot_dim % 2 != 0 || a.rot_dim > a.dim || a.table_rows <= 0 || a.rows % a.table_rows != 0 ||
      a.rows > 0x7fffffff || a.heads * a.dim > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  if (a.weight != nullptr) {  // the per-head norm first (head_norm_rotate_half_kernel): aligned quads of a head
    if (a.dim % 4 != 0 || a.dim > kHeadDim || reinterpret_cast<uintptr_t>(a.x) % 8 != 0 ||
        reinterpret_cast<uintptr_t>(a.weight) % 8 != 0) {
      return cudaErrorInvalidValue;
    }
    head_norm_rotate_half_kernel<T><<<static_cast<unsigned>(a.rows), kHalfNormThreads, 0, stream>>>(a);
    return cudaGetLastError();
  }
  rotate_half_kernel<T><<<static_cast<unsigned>(a.rows), kHalfThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

// A norm-only form (kNoRotary, kNoRotaryModulate, kNormModulateRows) of the row norm: a warp a row on rows of at most
// kNarrowWidest elements where the grid fits one dimension (narrow_row_norm_kernel; a.batch * a.img.seq < 2^47: no
// overflow), else one block of aten's (32, 4) threads a row (row_norm_rotary_kernel).
template <typename T, int kForm>
cudaError_t launch_norm_only(const RotaryArgs& a, cudaStream_t stream) {
  const int64_t narrow_blocks = (a.batch * a.img.seq + kNarrowRowsPerBlock - 1) / kNarrowRowsPerBlock;
  if (a.heads * a.dim <= kNarrowWidest && narrow_blocks <= 0x7fffffff) {
    narrow_row_norm_kernel<T, kForm><<<static_cast<unsigned>(narrow_blocks), kNarrowWarps * 32, 0, stream>>>(a);
  } else {
    const dim3 row_grid(static_cast<unsigned>(a.img.seq), static_cast<unsigned>(a.batch));
    row_norm_rotary_kernel<T, kForm, false><<<row_grid, kRowThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const RotaryArgs& a, cudaStream_t stream) {
  const int64_t seq = a.txt.seq + a.img.seq;
  if (seq == 0 || a.batch == 0 || a.heads == 0 || a.dim == 0) return cudaSuccess;
  if (a.batch > 65535 || seq > 0x7fffffff || (a.norm && a.dim > 128)) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(seq), static_cast<unsigned>(a.batch));
  if ((a.norm || a.wan) && a.cos_stride_h != 0) return cudaErrorInvalidValue;
  if (a.norm && (a.wan || a.norm_rows)) return cudaErrorInvalidValue;
  const dim3 row_grid(static_cast<unsigned>(a.img.seq), static_cast<unsigned>(a.batch));
  if (a.norm_rows && a.mod_index != nullptr) {  // torch.nn.RMSNorm with the indexed rows' modulate (kNormModulateRows)
    if (a.norm_fp32 || a.norm_f32w || a.wan || a.txt.ptr != nullptr || a.txt.seq != 0 || a.dim % 4 != 0 ||
        a.heads * a.dim > 4 * kRowThreads * kRowVecs || a.img.stride_h != a.dim || a.mod_scale == nullptr ||
        a.mod_shift == nullptr || a.mod_table_rows <= 0 || a.mod_table_rows > 0x7fffffff) {
      return cudaErrorInvalidValue;
    }
    return launch_norm_only<T, kNormModulateRows>(a, stream);
  }
  if (a.norm_rows && a.norm_f32w) {  // the row norm alone with its float32 weight (kNoRotary): one source, no tables
    if (a.norm_fp32 || a.wan || a.txt.ptr != nullptr || a.txt.seq != 0 || a.dim % 4 != 0 ||
        a.heads * a.dim > 4 * kRowThreads * kRowVecs || a.img.stride_h != a.dim) {
      return cudaErrorInvalidValue;
    }
    if (a.mod_scale == nullptr && a.mod_shift == nullptr) return launch_norm_only<T, kNoRotary>(a, stream);
    if (a.mod_scale != nullptr && a.mod_shift != nullptr) {  // (grid.y = batch: at most 65535, above)
      return launch_norm_only<T, kNoRotaryModulate>(a, stream);
    }
    return cudaErrorInvalidValue;
  }
  if ((a.norm_fp32 || a.norm_f32w) && (!a.norm || (a.norm_fp32 && a.norm_f32w))) return cudaErrorInvalidValue;
  // the row norm's pair: a txt source (k) of the img source's (q) length; its own launch shape
  const bool pair = a.norm_rows && a.txt.ptr != nullptr;
  if (a.norm_rows && ((pair ? a.txt.seq != a.img.seq || a.txt.stride_h != a.dim : a.txt.seq != 0) ||
                      (a.wan == (a.cos_stride_h != 0)) || a.dim % 4 != 0 ||
                      a.heads * a.dim > 4 * kRowThreads * (pair ? kRowPairVecs : kRowVecs) ||
                      a.img.stride_h != a.dim || (a.wan && (4 * kRowThreads) % a.dim != 0))) {
    return cudaErrorInvalidValue;
  }
  if (pair && a.wan) return cudaErrorInvalidValue;  // Wan's small [seq, dim] tables stay in L2: no pair form
  if (pair) {
    row_norm_rotary_kernel<T, kPerHead, true><<<row_grid, kRowThreads, 0, stream>>>(a);
  } else if (a.norm_rows && a.wan) {
    row_norm_rotary_kernel<T, kWan, false><<<row_grid, kRowThreads, 0, stream>>>(a);
  } else if (a.norm_rows) {
    row_norm_rotary_kernel<T, kPerHead, false><<<row_grid, kRowThreads, 0, stream>>>(a);
  } else if (!a.wan && a.dim == kHeadDim && a.cos_stride_h == 0 && a.cos_stride_b == 0) {  // one [seq, dim] table
    if (a.norm_fp32) {
      head_norm_rotary_kernel<T, kHeadNormF32><<<grid, kHeadThreads, 0, stream>>>(a);
    } else if (a.norm_f32w) {
      head_norm_rotary_kernel<T, kHeadNormF32W><<<grid, kHeadThreads, 0, stream>>>(a);
    } else if (a.norm) {  // (norm with wan was refused above)
      head_norm_rotary_kernel<T, kHeadNorm><<<grid, kHeadThreads, 0, stream>>>(a);
    } else {
      head_norm_rotary_kernel<T, kNoNorm><<<grid, kHeadThreads, 0, stream>>>(a);
    }
  } else if (a.norm_fp32) {
    rotary_kernel<T, kHeadNormF32, kShared><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.norm_f32w) {
    rotary_kernel<T, kHeadNormF32W, kShared><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.norm) {
    rotary_kernel<T, kHeadNorm, kShared><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.wan) {
    rotary_kernel<T, kNoNorm, kWan><<<grid, kThreads, 0, stream>>>(a);
  } else if (a.cos_stride_h != 0) {
    rotary_kernel<T, kNoNorm, kPerHead><<<grid, kThreads, 0, stream>>>(a);
  } else {
    rotary_kernel<T, kNoNorm, kShared><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_rotary(const RotaryArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}

cudaError_t launch_rotate_half(const RotateHalfArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch_half<decltype(tag)>(args, stream); });
}

cudaError_t launch_rotary_matrix(const RotaryMatrixArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch_matrix<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
