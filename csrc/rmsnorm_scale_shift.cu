// diffusers' RMSNorm and the elementwise step after it, in one kernel that is bit-identical to the eager chain. The
// norm is the same in every variant; what follows it (the epilogue, fastpath.h's RmsEpilogue) is the family's:
// ERNIE-Image's fp32 modulate, optionally preceded by the gated residual add of the attention branch; Z-Image's and
// Lumina2's scale (norm(x) * scale) and their gated residual of a normalised branch (residual + gate * norm(x)).
//
// The eager chain, with its rounding points (T = bf16 or fp16 storage, every operation in fp32):
//   gated:  x = round_T(residual + round_T(gate * update))            (also returned: the next residual)
//   sq   = x * x                                  (x.to(float32).pow(2): fp32 products)
//   var  = sum(sq) * factor                       (mean(-1): aten's reduction order, then * float(R)/float(R*D))
//   rstd = rsqrtf(var + eps)                      (torch.rsqrt on CUDA is ::rsqrt(float), i.e. rsqrtf)
//   y    = round_T(round_T(x * rstd) * weight)    (x * rstd is fp32; .to(T); * weight in T)
//   then one of
//   kScaleShift:    out = round_T((y * (1 + scale)) + shift)   (y.float() * (1 + scale.float()) + shift.float(), .to(T))
//   kScale:         out = round_T(y * scale)                   (norm(x) * scale, both T)
//   kGatedResidual: out = round_T(residual + round_T(gate * y))  (residual + gate * norm(x), all T)
//   kRopeComplex:   (a, b) = (y[2i], y[2i+1]), (c, d) = freqs[t, i]  (complex64; Qwen-Image's apply_rotary_emb_qwen,
//                   use_real=False: view_as_complex(y.float()) * freqs, .type_as(y)): aten's c10::complex multiply
//                   as nvcc compiled it (tools/complex_rotary_probe.py, H200, torch 2.11: 100% of elements)
//                   out[2i] = round_T(fma(a, c, -(b * d))), out[2i+1] = round_T(fma(a, d, b * c))
//   kRopeComplex128: the same with complex128 factors (Lumina2: diffusers' apply_rotary_emb(..., use_real=False) of
//                   its float64-built table; aten promotes the product to complex128, then .type_as(y) converts
//                   double -> float -> T): a, b, c, d in double, the same FMA placement (tools/complex_rotary_probe.py
//                   --complex128, H200, torch 2.11: 100% of elements), out = round_T(float(fma(a, c, -(b * d)))), ...
//   kRopeReal:      diffusers' apply_rotary_emb(y, (cos, sin), sequence_dim=1), rotate_pair (elementwise.cuh):
//                   out[2i] = round_T(y[2i] * cos[2i] + (-y[2i+1]) * sin[2i]),
//                   out[2i+1] = round_T(y[2i+1] * cos[2i+1] + y[2i] * sin[2i+1])   (separate fp32 products and sum)
//   kPlain:         out = y                                    (SD3's QK norms: the norm alone)
//   kModulate:      out = round_T(round_T(y * round_T(1 + scale)) + shift)   (LTX-Video: norm(x) * (1 + scale) + shift,
//                   all T, scale and shift per-token rows; its norms have no weight: y = round_T(x * rstd))
//   kScaleRows, kGatedResidualRows: kScale and kGatedResidual with the scale (gate) of norm row r read from row
//                   index[r] of a [table_rows, dim] table (Bria FIBO 2's and Z-Image's select_per_token rows: the
//                   torch.where of a sample's noisy or clean row per token, never written out). Values move, nothing
//                   is computed: the same products and sums. An index outside the table traps (the caller builds it
//                   from the mask, in range; nothing is read out of bounds all the same).
//
// The sum reproduces aten's reduce kernel (Reduce.cuh, setReduceConfig) for a contiguous fp32 [R, D] input
// reduced over its last dimension, with D/4 > 128, D/32 < 256 and R >= 16: input vectorised by 4, block (32, 16)
// with one warp per row; lane l keeps four accumulators a_j (starting at 0) and adds sq[4 * (l + 32 k) + j] for
// k = 0, 1, ...; then ((a_0 + a_1) + a_2) + a_3; then a shuffle-down tree over offsets 16, 8, 4, 2, 1, read at
// lane 0. (Measured on the H200 with torch 2.11: this order matched aten's mean on all 4216 rows of a
// (4216, 4096) input, the ascending tree 1, 2, ..., 16 of older Reduce.cuh versions on 71%, and eight other
// candidate orders on 64-70%.) Rows shorter than 128 (SD3's head_dim 64, Lumina2's 96) are below aten's threshold
// for vectorising the input (Reduce.cuh: dim0 >= 128): thread_reduce_impl with block width min(last_pow2(D), 32) =
// 32 for 32 <= D < 128 and vt0 = 4, so lane l keeps accumulator k = 0 + sq[l + 32 k] for each k < D / 32 (the
// others stay 0) and combines them ((a_0 + a_1) + a_2) + a_3, then the same shuffle-down tree. The Python guard
// admits only these domains, and the op verifies itself against eager on its first call per signature, because
// the order is a property of the aten build it runs against. The plain norm over rows wider than 8160, where aten
// splits a row across its block's warps, has a kernel of its own (rmsnorm_wide_kernel, below).
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kWarpsPerBlock = 8;  // one row per warp, like aten's block (32, 16) for these shapes

// 4 elements of T (8 bytes): the four values one aten lane reads per vectorised fp32 load.
template <typename T>
struct alignas(8) Quad {
  T v[4];
};

// round_T(round_T(x * rstd) * weight): diffusers' RMSNorm output for one element (x * rstd in fp32, .to(T), * weight).
template <typename T>
__device__ __forceinline__ float weighted_norm(T x, float rstd, T weight) {
  return round_to<T>(__fmul_rn(round_to<T>(__fmul_rn(Storage<T>::load(x), rstd)), Storage<T>::load(weight)));
}

// The four weights at quad q, or none (kModulate's weightless norm: `a.weight` null, the quad never read).
template <typename T>
__device__ __forceinline__ Quad<T> weight_quad(const RmsNormScaleShiftArgs& a, int64_t q) {
  return a.weight ? reinterpret_cast<const Quad<T>*>(a.weight)[q] : Quad<T>{};
}

template <typename T>
__device__ __forceinline__ Quad<T> load_quad(const Rows& r, int64_t s, int64_t b, int64_t col4) {
  return reinterpret_cast<const Quad<T>*>(static_cast<const T*>(r.ptr) + s * r.stride_s + b * r.stride_b)[col4];
}

// rsqrt(mean + eps) of a row whose sum of squares is `total` (aten's MeanOps factor, then the add and rsqrtf).
__device__ __forceinline__ float rstd_of(float total, const RmsNormScaleShiftArgs& a) {
  return rsqrtf(__fadd_rn(__fmul_rn(total, a.mean_factor), a.eps));
}

// A warp's sum from the four accumulators of each of its lanes, in aten's order: ((a_0 + a_1) + a_2) + a_3 in the
// lane, then the shuffle-down tree over offsets 16, 8, 4, 2, 1 (block_x_reduce), valid at lane 0.
__device__ __forceinline__ float warp_total(const float (&acc)[4]) {
  float total = __fadd_rn(__fadd_rn(__fadd_rn(acc[0], acc[1]), acc[2]), acc[3]);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    total = __fadd_rn(total, __shfl_down_sync(0xffffffffu, total, offset));
  }
  return total;
}

// A row's rstd when one warp holds the row: warp_total read at lane 0, then rsqrt(mean + eps).
__device__ __forceinline__ float warp_rstd(const float (&acc)[4], const RmsNormScaleShiftArgs& a) {
  return rstd_of(__shfl_sync(0xffffffffu, warp_total(acc), 0), a);
}

// Where norm row `row` (= s * batch + b) lies: its (s, b), for the rotary epilogues its table row (token,
// fb; head = its place among the token's heads), for norm row r: token = (r / heads) % tokens,
// fb = r / (heads * tokens), and for the indexed epilogues the table row it reads (pick = index[r]). Found by
// division once, then stepped row by row: the divisions are index arithmetic, not the data's, and at one quad per
// lane (rows of 128) they cost more issue slots than the norm itself.
struct RowAt {
  int64_t s, b;
  int64_t head, token, fb;
  int64_t pick;
};

// The epilogues that read a rotary table row per norm row.
__host__ __device__ constexpr bool is_rotary(RmsEpilogue e) {
  return e == RmsEpilogue::kRopeComplex || e == RmsEpilogue::kRopeComplex128 || e == RmsEpilogue::kRopeReal;
}

// The epilogues that read their scale (gate) row through the index.
__host__ __device__ constexpr bool is_indexed(RmsEpilogue e) {
  return e == RmsEpilogue::kScaleRows || e == RmsEpilogue::kGatedResidualRows;
}

// The indexed epilogues' table row of norm row `row`, read once per row; an index outside [0, table_rows) traps.
template <RmsEpilogue kEpilogue>
__device__ __forceinline__ void pick_row(const RmsNormScaleShiftArgs& a, RowAt& at, int64_t row) {
  if constexpr (is_indexed(kEpilogue)) {
    if (row < a.seq * a.batch) {  // (none past the last row: the row loops step `at` once beyond it)
      const int32_t t = a.index[row];
      if (t < 0 || t >= a.table_rows) __trap();
      at.pick = t;
    }
  }
}

template <RmsEpilogue kEpilogue>
__device__ __forceinline__ RowAt row_at(const RmsNormScaleShiftArgs& a, int64_t row) {
  RowAt at;
  at.s = row / a.batch;
  at.b = row - at.s * a.batch;
  at.head = at.token = at.fb = at.pick = 0;
  if constexpr (is_rotary(kEpilogue)) {
    const int64_t t = row / a.heads;
    at.head = row - t * a.heads;
    at.fb = t / a.tokens;
    at.token = t - at.fb * a.tokens;
  }
  pick_row<kEpilogue>(a, at, row);
  return at;
}

// `at` of the next row (row + 1).
template <RmsEpilogue kEpilogue>
__device__ __forceinline__ void next_row(const RmsNormScaleShiftArgs& a, RowAt& at) {
  if (++at.b == a.batch) {
    at.b = 0;
    ++at.s;
  }
  pick_row<kEpilogue>(a, at, at.s * a.batch + at.b);
  if constexpr (is_rotary(kEpilogue)) {
    if (++at.head == a.heads) {
      at.head = 0;
      if (++at.token == a.tokens) {
        at.token = 0;
        ++at.fb;
      }
    }
  }
}

// The scale's (gate's) four values at quad q for the row at `at`: those of its row (s, b), or, for the indexed
// epilogues, of table row at.pick (the table's row stride is its stride_s).
template <typename T, RmsEpilogue kEpilogue>
__device__ __forceinline__ Quad<T> row_operand(const Rows& r, const RowAt& at, int64_t q) {
  if constexpr (is_indexed(kEpilogue)) {
    return load_quad<T>(r, at.pick, 0, q);
  } else {
    return load_quad<T>(r, at.s, at.b, q);
  }
}

// What follows the norm, for the four elements q of the row at `at`: the variant's epilogue (file head).
template <typename T, RmsEpilogue kEpilogue>
__device__ __forceinline__ Quad<T> epilogue(const RmsNormScaleShiftArgs& a, const RowAt& at, int64_t q,
                                            const Quad<T>& xq, const Quad<T>& w, float rstd) {
  const int64_t s = at.s, b = at.b;
  Quad<T> o;
  if constexpr (kEpilogue == RmsEpilogue::kScaleShift) {
    const Quad<T> sc = load_quad<T>(a.scale, s, b, q);
    const Quad<T> sh = load_quad<T>(a.shift, s, b, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float weighted = weighted_norm<T>(xq.v[j], rstd, w.v[j]);
      const float one_plus_scale = __fadd_rn(1.0f, Storage<T>::load(sc.v[j]));
      o.v[j] = Storage<T>::store(__fadd_rn(__fmul_rn(weighted, one_plus_scale), Storage<T>::load(sh.v[j])));
    }
  } else if constexpr (kEpilogue == RmsEpilogue::kScale || kEpilogue == RmsEpilogue::kScaleRows) {
    const Quad<T> sc = row_operand<T, kEpilogue>(a.scale, at, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      o.v[j] = Storage<T>::store(__fmul_rn(weighted_norm<T>(xq.v[j], rstd, w.v[j]), Storage<T>::load(sc.v[j])));
    }
  } else if constexpr (kEpilogue == RmsEpilogue::kRopeComplex) {
    const float2* f = static_cast<const float2*>(a.freqs.ptr) + at.token * a.freqs.stride_s +
                      at.fb * a.freqs.stride_b + 2 * q;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const float re = weighted_norm<T>(xq.v[2 * p], rstd, w.v[2 * p]);
      const float im = weighted_norm<T>(xq.v[2 * p + 1], rstd, w.v[2 * p + 1]);
      const float2 c = f[p];
      o.v[2 * p] = Storage<T>::store(__fmaf_rn(re, c.x, -__fmul_rn(im, c.y)));
      o.v[2 * p + 1] = Storage<T>::store(__fmaf_rn(re, c.y, __fmul_rn(im, c.x)));
    }
  } else if constexpr (kEpilogue == RmsEpilogue::kRopeComplex128) {
    const double2* f = static_cast<const double2*>(a.freqs.ptr) + at.token * a.freqs.stride_s +
                       at.fb * a.freqs.stride_b + 2 * q;
#pragma unroll
    for (int p = 0; p < 2; ++p) {
      const double re = weighted_norm<T>(xq.v[2 * p], rstd, w.v[2 * p]);  // exact: a value of T
      const double im = weighted_norm<T>(xq.v[2 * p + 1], rstd, w.v[2 * p + 1]);
      const double2 c = f[p];
      o.v[2 * p] = Storage<T>::store(__double2float_rn(__fma_rn(re, c.x, -__dmul_rn(im, c.y))));
      o.v[2 * p + 1] = Storage<T>::store(__double2float_rn(__fma_rn(re, c.y, __dmul_rn(im, c.x))));
    }
  } else if constexpr (kEpilogue == RmsEpilogue::kRopeReal) {
    const float4 c =
        reinterpret_cast<const float4*>(static_cast<const float*>(a.freqs.ptr) + at.token * a.freqs.stride_s)[q];
    const float4 n = reinterpret_cast<const float4*>(static_cast<const float*>(a.sin.ptr) + at.token * a.sin.stride_s)[q];
    rotate_pair<T>(weighted_norm<T>(xq.v[0], rstd, w.v[0]), weighted_norm<T>(xq.v[1], rstd, w.v[1]), c.x, c.y, n.x,
                   n.y, o.v[0], o.v[1]);
    rotate_pair<T>(weighted_norm<T>(xq.v[2], rstd, w.v[2]), weighted_norm<T>(xq.v[3], rstd, w.v[3]), c.z, c.w, n.z,
                   n.w, o.v[2], o.v[3]);
  } else if constexpr (kEpilogue == RmsEpilogue::kPlain) {
#pragma unroll
    for (int j = 0; j < 4; ++j) o.v[j] = Storage<T>::store(weighted_norm<T>(xq.v[j], rstd, w.v[j]));
  } else if constexpr (kEpilogue == RmsEpilogue::kModulate) {
    const Quad<T> sc = load_quad<T>(a.scale, s, b, q);
    const Quad<T> sh = load_quad<T>(a.shift, s, b, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float y = a.weight ? weighted_norm<T>(xq.v[j], rstd, w.v[j])
                               : round_to<T>(__fmul_rn(Storage<T>::load(xq.v[j]), rstd));
      const float one_plus_scale = round_to<T>(__fadd_rn(1.0f, Storage<T>::load(sc.v[j])));
      o.v[j] = Storage<T>::store(__fadd_rn(round_to<T>(__fmul_rn(y, one_plus_scale)), Storage<T>::load(sh.v[j])));
    }
  } else {  // kGatedResidual, kGatedResidualRows
    const Quad<T> g = row_operand<T, kEpilogue>(a.gate, at, q);
    const Quad<T> r = load_quad<T>(a.residual, s, b, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float gy = round_to<T>(__fmul_rn(Storage<T>::load(g.v[j]), weighted_norm<T>(xq.v[j], rstd, w.v[j])));
      o.v[j] = Storage<T>::store(__fadd_rn(Storage<T>::load(r.v[j]), gy));
    }
  }
  return o;
}

// The norm alone over rows of 64 (SD3's QK norms: 168k rows of 128 bytes per call at SD3.5-large's 1024x1024), where
// a warp per row leaves half its lanes idle and loads 2 bytes per lane: eight lanes per row and two rows per group of
// eight, so a warp holds eight rows and every load is 8 bytes. Lane m of a group holds elements 4m + j and
// 32 + 4m + j (j < 4), so aten's lane accumulator a_l = sq[l] + sq[l + 32] (l = 4m + j) is local, and the shuffle-down
// tree over l (offsets 16, 8, 4, 2, 1) becomes lane offsets 4, 2, 1 within the group, then j + 2 and j + 1 in the
// lane: the same sums in the same order as the warp-per-row path above computes them.
constexpr int kRows64PerGroup = 2;
constexpr int kRows64PerBlock = kWarpsPerBlock * 4 * kRows64PerGroup;  // four groups of eight lanes per warp

template <typename T>
__device__ __forceinline__ void rmsnorm_plain64(const RmsNormScaleShiftArgs& a) {
  const int lane = threadIdx.x & 31;
  const int m = lane & 7;
  const int64_t rows = a.seq * a.batch;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * kRows64PerBlock + (threadIdx.x >> 5) * 4 * kRows64PerGroup +
                        (lane >> 3);
  const Quad<T> w0 = reinterpret_cast<const Quad<T>*>(a.weight)[m];
  const Quad<T> w1 = reinterpret_cast<const Quad<T>*>(a.weight)[8 + m];
  Quad<T> lo[kRows64PerGroup], hi[kRows64PerGroup];
#pragma unroll
  for (int r = 0; r < kRows64PerGroup; ++r) {  // both rows' loads in flight before any arithmetic
    const int64_t row = first + 4 * r;  // a warp's four groups take four consecutive rows at a time
    if (row < rows) {
      const int64_t s = row / a.batch;
      lo[r] = load_quad<T>(a.x, s, row - s * a.batch, m);
      hi[r] = load_quad<T>(a.x, s, row - s * a.batch, 8 + m);
    } else {
      for (int j = 0; j < 4; ++j) lo[r].v[j] = hi[r].v[j] = Storage<T>::store(0.f);
    }
  }
#pragma unroll
  for (int r = 0; r < kRows64PerGroup; ++r) {
    float t[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {  // a_l: aten's accumulators 0 + sq[l] and 0 + sq[l + 32], combined (+ 0 + 0 exact)
      const float x0 = Storage<T>::load(lo[r].v[j]), x1 = Storage<T>::load(hi[r].v[j]);
      t[j] = __fadd_rn(__fmul_rn(x0, x0), __fmul_rn(x1, x1));
    }
#pragma unroll
    for (int offset = 4; offset > 0; offset >>= 1) {  // tree offsets 16, 8, 4 over l
#pragma unroll
      for (int j = 0; j < 4; ++j) t[j] = __fadd_rn(t[j], __shfl_down_sync(0xffffffffu, t[j], offset, 8));
    }
    float total = __fadd_rn(__fadd_rn(t[0], t[2]), __fadd_rn(t[1], t[3]));  // offsets 2, 1 (valid at m = 0)
    const float rstd = rstd_of(__shfl_sync(0xffffffffu, total, 0, 8), a);
    const int64_t row = first + 4 * r;
    if (row < rows) {
      Quad<T> o0, o1;
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        o0.v[j] = Storage<T>::store(weighted_norm<T>(lo[r].v[j], rstd, w0.v[j]));
        o1.v[j] = Storage<T>::store(weighted_norm<T>(hi[r].v[j], rstd, w1.v[j]));
      }
      Quad<T>* out = reinterpret_cast<Quad<T>*>(static_cast<T*>(a.out) + row * 64);
      out[m] = o0;
      out[8 + m] = o1;
    }
  }
}

// Rows of 128 (the QK norms of head_dim 128: Qwen-Image's and Z-Image's with their complex rotary, HunyuanVideo's),
// not gated nor indexed (whose table row per row would raise the whole kernel's registers: 56 against 40): one quad
// per lane, so a warp per row held one 8-byte load per lane in flight; here each warp takes
// kRows128PerWarp consecutive rows and loads them all before reducing any (the sums and their order are the
// warp-per-row path's: lane l's four accumulators 0 + sq[4l + j], ((a_0 + a_1) + a_2) + a_3, the shuffle-down tree).
constexpr int kRows128PerWarp = 4;
constexpr int kRows128PerBlock = kWarpsPerBlock * kRows128PerWarp;

template <typename T, RmsEpilogue kEpilogue>
__device__ __forceinline__ void rmsnorm_rows128(const RmsNormScaleShiftArgs& a) {
  const int lane = threadIdx.x & 31;
  const int64_t rows = a.seq * a.batch;
  const int64_t first = (static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5)) * kRows128PerWarp;
  if (first >= rows) return;  // the whole warp: no shuffle below is left without its lanes
  const RowAt at0 = row_at<kEpilogue>(a, first);
  Quad<T> xq[kRows128PerWarp];
  RowAt at = at0;
#pragma unroll
  for (int r = 0; r < kRows128PerWarp; ++r) {
    if (first + r < rows) xq[r] = load_quad<T>(a.x, at.s, at.b, lane);
    next_row<RmsEpilogue::kPlain>(a, at);  // (s, b) only
  }
  const Quad<T> w = weight_quad<T>(a, lane);
  at = at0;
#pragma unroll
  for (int r = 0; r < kRows128PerWarp; ++r) {
    const int64_t row = first + r;
    if (row >= rows) break;  // uniform across the warp
    float acc[4];
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float xf = Storage<T>::load(xq[r].v[j]);
      acc[j] = __fadd_rn(0.f, __fmul_rn(xf, xf));
    }
    const float rstd = warp_rstd(acc, a);
    reinterpret_cast<Quad<T>*>(static_cast<T*>(a.out) + row * 128)[lane] =
        epilogue<T, kEpilogue>(a, at, lane, xq[r], w, rstd);
    next_row<kEpilogue>(a, at);
  }
}

// Rows per block of launch(): the row-length paths above take several rows per warp.
__host__ __device__ inline int64_t rows_per_block(const RmsNormScaleShiftArgs& a) {
  if (!a.gated && a.dim == 128 && !is_indexed(a.epilogue)) return kRows128PerBlock;
  if (a.epilogue == RmsEpilogue::kPlain && a.dim == 64) return kRows64PerBlock;
  return kWarpsPerBlock;
}

template <typename T, bool kGated, RmsEpilogue kEpilogue>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) rmsnorm_scale_shift_kernel(RmsNormScaleShiftArgs a) {
  static_assert(!kGated || kEpilogue == RmsEpilogue::kScaleShift, "the gated prologue is ERNIE-Image's alone");
  if constexpr (!kGated) {  // launched with rows_per_block(a) rows per block
    if (a.dim == 128 && !is_indexed(kEpilogue)) return rmsnorm_rows128<T, kEpilogue>(a);
    if (kEpilogue == RmsEpilogue::kPlain && a.dim == 64) return rmsnorm_plain64<T>(a);
  }
  const int lane = threadIdx.x & 31;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (row >= a.seq * a.batch) return;
  const RowAt at = row_at<kEpilogue>(a, row);
  const int64_t s = at.s, b = at.b;
  const int64_t quads = a.dim / 4;
  T* out = static_cast<T*>(a.out) + row * a.dim;
  T* residual_out = kGated ? static_cast<T*>(a.residual_out) + row * a.dim : nullptr;

  // Pass 1: the sum of squares in aten's order (and, gated, the new residual stream).
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  if (!kGated && a.dim < 128) {  // aten's scalar order: accumulator k holds element lane + 32 k
    const T* xr = static_cast<const T*>(a.x.ptr) + s * a.x.stride_s + b * a.x.stride_b;
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      const int64_t i = lane + 32 * k;
      if (i < a.dim) {
        const float xf = Storage<T>::load(xr[i]);
        acc[k] = __fadd_rn(0.f, __fmul_rn(xf, xf));
      }
    }
  }
#pragma unroll 4
  for (int64_t q = lane; q < (!kGated && a.dim < 128 ? 0 : quads); q += 32) {
    Quad<T> xq = load_quad<T>(a.x, s, b, q);
    if (kGated) {
      const Quad<T> g = load_quad<T>(a.gate, s, b, q);
      const Quad<T> u = load_quad<T>(a.update, s, b, q);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        const float gu = round_to<T>(__fmul_rn(Storage<T>::load(g.v[j]), Storage<T>::load(u.v[j])));
        xq.v[j] = Storage<T>::store(__fadd_rn(Storage<T>::load(xq.v[j]), gu));
      }
      reinterpret_cast<Quad<T>*>(residual_out)[q] = xq;
    }
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float xf = Storage<T>::load(xq.v[j]);
      acc[j] = __fadd_rn(acc[j], __fmul_rn(xf, xf));
    }
  }
  const float rstd = warp_rstd(acc, a);

  // Pass 2: normalise, weight, then the epilogue (x is re-read from L1/L2: this row was just loaded).
#pragma unroll 4
  for (int64_t q = lane; q < quads; q += 32) {
    const Quad<T> xq = kGated ? reinterpret_cast<const Quad<T>*>(residual_out)[q] : load_quad<T>(a.x, s, b, q);
    const Quad<T> w = weight_quad<T>(a, q);
    reinterpret_cast<Quad<T>*>(out)[q] = epilogue<T, kEpilogue>(a, at, q, xq, w, rstd);
  }
}

// The norm alone over rows wider than kWarpRowWidest (Ideogram 4's llm_cond_norm, 53248 wide), where aten no longer
// gives a row one warp: its per-thread count ceil(D / 32) (elements, though it reads quads) reaches 256 and
// setReduceConfig splits the row across the block's 16 warps too (block (32, 16), step_input 32 * 16 quads;
// ops/_aten_reduce.py's set_reduce_config). Thread (lane, y) keeps four accumulators a_j (from 0) and adds
// sq[4 * (lane + 32 y + 512 k) + j] for k = 0, 1, ...; ((a_0 + a_1) + a_2) + a_3; block_x_reduce: the shuffle-down
// tree 16, 8, 4, 2, 1 in each warp (lane 0's sum W_y); then block_y_reduce through shared memory: W_y += W_(y + off)
// for off = 8, 4, 2, 1 (y < off), W_0 the row's sum (torch 2.13's Reduce.cuh: block_x_reduce before block_y_reduce
// since pytorch#165178; before it the y tree ran first, lane by lane, then the shuffle; tools/wide_rmsnorm_probe.py
// emulates both and says which the build takes). No split across blocks while ceil(D / 512) < 256 (D <= 130560: the
// Python guard's bound; wider rows at few rows take global_reduce, another order). Here also one row per block of
// (32 x 16) threads, thread t = lane + 32 y holding aten's quads of thread (lane, y); the tree over the warps runs in
// warp 0 in aten's order; pass 2 re-reads each quad by the thread that summed it.
constexpr int kWarpRowWidest = 8160;  // the widest row aten gives one warp: ceil(D / 32) < 256
constexpr int kWideWarps = 16;        // aten's block.y for these rows (MAX_NUM_THREADS 512 / 32 lanes)
constexpr int kWideThreads = kWideWarps * 32;

template <typename T>
__global__ void __launch_bounds__(kWideThreads) rmsnorm_wide_kernel(RmsNormScaleShiftArgs a) {
  __shared__ float warp_sums[kWideWarps + 1];  // then the row's rstd last
  // its shared-window address pinned in a register, every access through it: nvcc and NVRTC compute a __shared__
  // array's address differently (elementwise.cuh's shared_address), which made their machine code differ
  unsigned base;
  asm volatile("mov.b32 %0, %1;" : "=r"(base) : "r"(shared_address(warp_sums)));
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int64_t row = blockIdx.x;
  const RowAt at = row_at<RmsEpilogue::kPlain>(a, row);
  const int64_t quads = a.dim / 4;
  float acc[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t q = threadIdx.x; q < quads; q += kWideThreads) {
    const Quad<T> xq = load_quad<T>(a.x, at.s, at.b, q);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float xf = Storage<T>::load(xq.v[j]);
      acc[j] = __fadd_rn(acc[j], __fmul_rn(xf, xf));
    }
  }
  const float total = warp_total(acc);
  if (lane == 0) shared_store(base + 4u * warp, total);
  __syncthreads();
  if (warp == 0) {  // block_y_reduce, W_y += W_(y + off) for off = 8, 4, 2, 1 and y < off: lane y holds W_y, the same
    // sums as a shuffle-down tree over the first 16 lanes (lane 0's result reads only lanes below 16)
    float w = 0.f;
    if (lane < kWideWarps) shared_load(base + 4u * lane, w);
#pragma unroll
    for (int offset = kWideWarps / 2; offset > 0; offset >>= 1) {
      w = __fadd_rn(w, __shfl_down_sync(0xffffffffu, w, offset));
    }
    if (lane == 0) shared_store(base + 4u * kWideWarps, rstd_of(w, a));
  }
  __syncthreads();
  float rstd;
  shared_load(base + 4u * kWideWarps, rstd);
  Quad<T>* out = reinterpret_cast<Quad<T>*>(static_cast<T*>(a.out) + row * a.dim);
  for (int64_t q = threadIdx.x; q < quads; q += kWideThreads) {
    out[q] = epilogue<T, RmsEpilogue::kPlain>(a, at, q, load_quad<T>(a.x, at.s, at.b, q), weight_quad<T>(a, q), rstd);
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch(const RmsNormScaleShiftArgs& a, cudaStream_t stream) {
  const int64_t rows = a.seq * a.batch;
  if (rows == 0) return cudaSuccess;
  if (!a.gated && a.epilogue == RmsEpilogue::kPlain && a.dim > kWarpRowWidest) {  // one block of 16 warps per row
    rmsnorm_wide_kernel<T><<<dim3(static_cast<unsigned>(rows)), dim3(kWideThreads), 0, stream>>>(a);
    return cudaGetLastError();
  }
  const int64_t per_block = rows_per_block(a);
  const dim3 grid(static_cast<unsigned>((rows + per_block - 1) / per_block));
  const dim3 block(kWarpsPerBlock * 32);
  if (a.gated) {
    rmsnorm_scale_shift_kernel<T, true, RmsEpilogue::kScaleShift><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kScale) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kScale><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kGatedResidual) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kGatedResidual><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kRopeComplex) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kRopeComplex><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kRopeComplex128) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kRopeComplex128><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kRopeReal) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kRopeReal><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kPlain) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kPlain><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kModulate) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kModulate><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kScaleRows) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kScaleRows><<<grid, block, 0, stream>>>(a);
  } else if (a.epilogue == RmsEpilogue::kGatedResidualRows) {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kGatedResidualRows><<<grid, block, 0, stream>>>(a);
  } else {
    rmsnorm_scale_shift_kernel<T, false, RmsEpilogue::kScaleShift><<<grid, block, 0, stream>>>(a);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_rmsnorm_scale_shift(const RmsNormScaleShiftArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
