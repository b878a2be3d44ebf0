// LTX-2's VAE norm (diffusers' PerChannelRMSNorm: every norm1 / norm2 of LTX2VideoResnetBlock3d, the encoder's and
// the decoder's norm_out), optionally followed by SiLU (the `norm -> nonlinearity` and `norm_out -> conv_act` pairs),
// bit-identical to the eager kernels it replaces. Eager runs, for x (T: bf16, fp16 or fp32) of [B, C, *]:
//   q   = round(x * x)                           x**2: aten's pow with exponent 2, `base * base` in T (fp32 product)
//   m   = round(sum_c(q) * factor)               torch.mean(q, dim=1, keepdim=True): aten's reduce kernel (order below)
//   a   = round(m + eps)                         add of the python eps: aten's CUDA add casts the double to float
//   r   = round(sqrt(a))                         torch.sqrt: IEEE sqrtf in fp32 opmath
//   y   = round(x / r)                           div_true of two tensors: IEEE a / b in fp32 opmath
//   out = silu ? round(y / (1 + expf(-y))) : y   the SiLU module after it, aten's silu_kernel
// Every multiply, add, square root and division here is a separate IEEE operation (__fmul_rn, __fadd_rn, __fsqrt_rn,
// __fdiv_rn; the build passes --fmad=false, and no product feeds an add: aten's add is `self + alpha * other` with
// alpha 1, whose contraction fma(1, eps, m) rounds once as the add does), each rounded to T where eager stores a
// tensor. The division and the roundings are exact by construction; the SiLU is elementwise.cuh's, proven on every
// value of the dtype by the Python op (probe mode 1); r is a function of the one value m, so the Python op proves it
// the same way (probe mode 2: r of every bf16/fp16 value, every fp32 bit pattern in chunks, against eager's
// `torch.sqrt(m + eps)`), which settles also how aten takes the python eps on this device (on a CPU aten rounds it to
// T first). For fp32 every `round` is the identity: the same IEEE operations with nothing rounded between them.
//
// Two kernels. per_channel_rmsnorm_kernel takes m from aten (the Python op runs eager's own square and mean where
// their order is not the one below) and does the rest in one pass. per_channel_rmsnorm_fused_kernel computes m too,
// in the order of aten's reduce kernel (Reduce.cuh, reducing dim 1 of a contiguous [B, C, S] q, S >= 2: a reduction
// NOT on the fastest-striding dimension; the Python op derives `rows` and `ctas` from setReduceConfig per device, and
// its docstring says why this is aten's order). For one position, with P = rows * ctas partial sums:
//   partial j (j < P)   = ((a0 + a1) + a2) + a3, a_i = ((0 + q[c_i]) + q[c_i + 4P]) + ...: channel j + k P is the
//                         k-th value of thread_reduce_impl's loop over idx = j, j + P, ..., added to accumulator k % 4
//                         (vt0 = 4: the main loop's four accumulators, the tail's first ones, then their combine)
//   Q_g (g < ctas)      = block_y_reduce of partials g rows + y (y < rows): for off = rows/2 .. 1, v_y += v_{y+off}
//   sum                 = Q_0 if ctas == 1, else global_reduce: t_y = ((0 + Q_y) + Q_{y+rows}) + ... (y < rows),
//                         then block_y_reduce of the t_y
//   m                   = round(sum * factor)    MeanOps::project, factor = float(B S) / float(B C S) as aten's host
// Each block takes a tile of positions of one batch: blockDim.y threads per 16-byte vector of positions (blockDim.x
// vectors) compute the chains a_i (P <= kChainPartials: each chain a unit, 4P of them) or the partials (else: P units)
// into shared memory, one thread per position combines them as above into r, and the block divides the tile's
// channels by r (reading x a second time, while the tile is in L1 / L2). x is read twice and out written once; eager
// reads x twice (the square, the division) and q once, and writes q, the quotient and (the pair) the SiLU's result.
//
// Layout: out contiguous [batch, channels, spatial] (eager's result for the layouts the Python guard admits); x
// [batch, channels, spatial] with each channel's spatial elements contiguous (channels and batches possibly apart: an
// upsampler's output with its first frames sliced off); mean contiguous [batch, spatial] of T. The first kernel: each
// thread takes kChannels channels of one vector of positions (16 bytes where spatial, both strides and the pointers
// are multiples of it, else one element), computes r once for those positions and divides each channel's elements by
// it; a grid stride over all such items.
//
// This header holds what the kernels share (per_channel_rmsnorm.cu: the kernel that takes aten's mean and the fused
// one; per_channel_rmsnorm_pad.cu: the fused kernel's statistics and norm written as a causal convolution's padded
// input, and from a channels-last convolution output): the constants, the lanes, the statistics in aten's order
// (stages 1 and 2) and, on the host, the fused launch shape. Each .cu that includes it has its own copy (an
// anonymous namespace).
#pragma once

#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;
constexpr int kChannels = 8;  // channels per thread, sharing their positions' r

// r = round(sqrt(round(m + eps))): eager's `torch.sqrt(mean_sq + self.eps)`, two kernels, each rounding to T
template <typename T>
__device__ __forceinline__ float rms(float m, float eps) {
  return round_to<T>(__fsqrt_rn(round_to<T>(__fadd_rn(m, eps))));
}

// The elements one thread takes per channel: a 16-byte vector, or one element.
template <typename T, bool kVector>
struct Lanes {
  using type = Pack<T>;
};
template <typename T>
struct Lanes<T, false> {
  struct type {
    T v[1];
  };
};

template <typename T, bool kVector>
struct LaneCount {
  static constexpr int value = kVector ? Pack<T>::kSize : 1;
};

template <typename T, bool kVector>
__device__ __forceinline__ typename Lanes<T, kVector>::type load_lanes(const T* p) {
  using L = typename Lanes<T, kVector>::type;
  if constexpr (kVector) {
    return load_readonly(reinterpret_cast<const L*>(p));
  } else {
    L l;
    l.v[0] = *p;
    return l;
  }
}
// (a vector as one 16-byte store: elementwise.cuh's store_pack)
template <typename T, bool kVector>
__device__ __forceinline__ void store_lanes(T* p, const typename Lanes<T, kVector>::type& l) {
  if constexpr (kVector) {
    store_pack(p, l);
  } else {
    *p = l.v[0];
  }
}

// --- the fused kernel: aten's mean of x**2 over the channels, then the norm -----------------------------------------

constexpr int kFusedThreads = 256;   // threads of a block at most (blockDim.x vectors x blockDim.y units)
constexpr int kFusedMinBlocks = 3;   // resident blocks per SM for __launch_bounds__ (78 registers, no spill, sm_90)
constexpr int kUnitThreads = 32;     // threads per vector of positions at most (blockDim.y)
constexpr int kChainPartials = 8;    // up to this many partial sums per position, each of their 4 chains is a unit
constexpr int kSharedFloats = 4096;  // the block's scratch: (units + extra + 1) floats per position of its tile
constexpr int kMinBlocksPerSm = 2;   // the tile shrinks (down to one vector) until the grid has this many per SM
constexpr int kTailChannels = 4;     // the tail's loads in flight per thread (channels of its vector)
constexpr int kProbeMean = 3;        // probe mode: out = m, [batch, spatial] (the statistics alone, for the tests)

// q = round(x * x): aten's `base * base` in T (for bf16 / fp16 the fp32 product is exact, then rounded once)
template <typename T>
__device__ __forceinline__ float square(float x) {
  return round_to<T>(__fmul_rn(x, x));
}

// (T the storage type of L's values; R the type the squares round to: T for LTX-2's x**2, float for LTX-Video's pow(2)
// of the fp32 upcast, whose square of a bf16 / fp16 value is exact)
template <typename T, int kVec, typename L, typename R = T>
__device__ __forceinline__ void add_squares(float (&acc)[kVec], const L& v) {
#pragma unroll
  for (int i = 0; i < kVec; ++i) acc[i] = __fadd_rn(acc[i], square<R>(Storage<T>::load(v.v[i])));
}

// One chain: ((0 + q[first]) + q[first + step]) + ... over the channels below `channels`, for kVec positions.
template <typename T, bool kVector, typename R = T>
__device__ __forceinline__ void chain_sum(const T* x, int64_t channel_stride, int64_t first, int64_t step,
                                          int64_t channels, float (&sum)[LaneCount<T, kVector>::value]) {
  using L = typename Lanes<T, kVector>::type;
  constexpr int kVec = LaneCount<T, kVector>::value;
#pragma unroll
  for (int i = 0; i < kVec; ++i) sum[i] = 0.0f;
  int64_t c = first;
  for (; c + 3 * step < channels; c += 4 * step) {  // four loads in flight, added in order
    L v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = load_lanes<T, kVector>(x + (c + k * step) * channel_stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) add_squares<T, kVec, L, R>(sum, v[k]);
  }
  for (; c < channels; c += step) add_squares<T, kVec, L, R>(sum, load_lanes<T, kVector>(x + c * channel_stride));
}

// One partial sum, as thread_reduce_impl (vt0 = 4) computes it for a thread whose values are q[first + k step]: the
// k-th value into accumulator k % 4 (four at a time while four remain, then the tail into the first ones), then
// ((a0 + a1) + a2) + a3.
template <typename T, bool kVector, typename R = T>
__device__ __forceinline__ void partial_sum(const T* x, int64_t channel_stride, int64_t first, int64_t step,
                                            int64_t channels, float (&sum)[LaneCount<T, kVector>::value]) {
  using L = typename Lanes<T, kVector>::type;
  constexpr int kVec = LaneCount<T, kVector>::value;
  float acc[4][kVec];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[k][i] = 0.0f;
  }
  int64_t c = first;
  for (; c + 3 * step < channels; c += 4 * step) {
    L v[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) v[k] = load_lanes<T, kVector>(x + (c + k * step) * channel_stride);
#pragma unroll
    for (int k = 0; k < 4; ++k) add_squares<T, kVec, L, R>(acc[k], v[k]);
  }
#pragma unroll
  for (int k = 0; k < 3; ++k) {
    if (c < channels) {
      add_squares<T, kVec, L, R>(acc[k], load_lanes<T, kVector>(x + c * channel_stride));
      c += step;
    }
  }
#pragma unroll
  for (int i = 0; i < kVec; ++i) sum[i] = __fadd_rn(__fadd_rn(__fadd_rn(acc[0][i], acc[1][i]), acc[2][i]), acc[3][i]);
}

// Entry e of one position's scratch column: `column` the shared address of its entry 0, `stride` the bytes between
// entries (4 x the tile's positions).
__device__ __forceinline__ unsigned entry(unsigned column, unsigned stride, int e) {
  return column + stride * static_cast<unsigned>(e);
}

// block_y_reduce over `rows` (a power of two) values at entries first, first + 1, ... of one position's scratch
// column: for off = rows / 2 .. 1, v_y = v_y + v_{y + off} (y < off); entry `first` holds the result.
__device__ __forceinline__ void tree(unsigned column, unsigned stride, int first, int rows) {
  for (int off = rows >> 1; off > 0; off >>= 1) {
    for (int y = 0; y < off; ++y) {
      float v, w;
      shared_load(entry(column, stride, first + y), v);
      shared_load(entry(column, stride, first + y + off), w);
      shared_store(entry(column, stride, first + y), __fadd_rn(v, w));
    }
  }
}

// Stage 2 of the statistics for one position, in its scratch column (`column` the shared address of its entry 0,
// `stride` the bytes between entries), whose entries 0 .. units - 1 hold the units of stage 1: with `chains` the 4 P
// chains (entry 4 j + i: chain (j, i)), combined here into partial j = ((c0 + c1) + c2) + c3 at entry j; else the P
// partials. Then each CTA's block_y_reduce (Q_g at entry g rows), the global step (t_y at entries units + y, then
// their tree) where ctas > 1, and the projection: m = round(sum * factor), the position's mean.
template <typename T>
__device__ __forceinline__ float position_mean(unsigned column, unsigned stride, bool chains, int partials, int units,
                                               int rows, int ctas, float factor) {
  if (chains) {
    for (int j = 0; j < partials; ++j) {  // partial j into entry j (<= 4 j: its chains are read first)
      float c0, c1, c2, c3;
      shared_load(entry(column, stride, 4 * j), c0);
      shared_load(entry(column, stride, 4 * j + 1), c1);
      shared_load(entry(column, stride, 4 * j + 2), c2);
      shared_load(entry(column, stride, 4 * j + 3), c3);
      shared_store(entry(column, stride, j), __fadd_rn(__fadd_rn(__fadd_rn(c0, c1), c2), c3));
    }
  }
  for (int g = 0; g < ctas; ++g) tree(column, stride, g * rows, rows);  // Q_g at entry g rows
  float sum;
  if (ctas == 1) {
    shared_load(column, sum);
  } else {
    for (int y = 0; y < rows; ++y) {
      float s = 0.0f;
      for (int g = y; g < ctas; g += rows) {
        float q;
        shared_load(entry(column, stride, g * rows), q);
        s = __fadd_rn(s, q);
      }
      shared_store(entry(column, stride, units + y), s);
    }
    tree(column, stride, units, rows);
    shared_load(entry(column, stride, units), sum);
  }
  return round_to<T>(__fmul_rn(sum, factor));
}

// A fused block's tile: the positions [s0, s0 + positions) of batch b (tile = blockDim.x * kVec), thread (x, y)'s
// vector at p0, the units of the statistics and the scratch entry r is left in (`stride` bytes between entries).
struct FusedTile {
  int units;
  int r_entry;
  int positions;
  int p0;
  bool active;
  int64_t b;
  int64_t s0;
  unsigned stride;
};

template <int kVec>
__device__ __forceinline__ FusedTile fused_tile(const PerChannelRmsNormArgs& a, int rows, int ctas) {
  FusedTile t;
  const int partials = rows * ctas;
  t.units = partials <= kChainPartials ? 4 * partials : partials;
  t.r_entry = t.units + (ctas > 1 ? rows : 0);  // the t_y of the global step between, then r
  const int tile = blockDim.x * kVec;
  t.stride = 4u * static_cast<unsigned>(tile);
  t.b = blockIdx.y;
  t.s0 = static_cast<int64_t>(blockIdx.x) * tile;
  const int64_t left = a.spatial - t.s0;  // the tile's positions in the row
  t.positions = left < tile ? static_cast<int>(left) : tile;
  t.p0 = threadIdx.x * kVec;
  t.active = t.p0 < t.positions;  // (vectors: spatial is a multiple of kVec)
  return t;
}

// Stages 1 and 2 of the fused kernels: each position's m in aten's order for `rows` x `ctas` partial sums (the file's
// comment), `factor` aten's MeanOps factor, and r = rms(m) into its scratch column's entry t.r_entry (probe mode
// kProbeMean: m into out, [batch, spatial]); x is the tile's first position of thread (x, y)'s vector. Ends before the
// barrier that makes r visible to the block (the callers' next step). With kLtx LTX-Video's statistics (the pad
// kernel's kLtx, below): the squares and m not rounded (fp32: R float, m into out as fp32) and r = ltx_rsqrt(m).
template <typename T, bool kVector, bool kLtx = false>
__device__ __forceinline__ void fused_statistics(const PerChannelRmsNormArgs& a, const FusedTile& t, const T* x,
                                                 unsigned base, int32_t rows, int32_t ctas, float factor) {
  constexpr int kVec = LaneCount<T, kVector>::value;
  using R = typename Pick<kLtx, float, T>::type;  // what the squares and the mean round to
  const int partials = rows * ctas;
  const bool chains = partials <= kChainPartials;
  const unsigned stride = t.stride;
  const int units = t.units;

  // 1. the units: chain (j, i) of partial j (u = 4 j + i: channels j + (i + 4 n) P), or partial u
  if (t.active) {
    for (int u = threadIdx.y; u < units; u += blockDim.y) {
      float sum[kVec];
      if (chains) {
        chain_sum<T, kVector, R>(x, a.x_channel_stride, (u >> 2) + (u & 3) * partials, 4 * partials, a.channels, sum);
      } else {
        partial_sum<T, kVector, R>(x, a.x_channel_stride, u, partials, a.channels, sum);
      }
#pragma unroll
      for (int i = 0; i < kVec; ++i) shared_store(entry(base + 4u * (t.p0 + i), stride, u), sum[i]);
    }
  }
  __syncthreads();

  // 2. per position: the partials, each CTA's block_y_reduce, the global step, the projection, r
  for (int p = threadIdx.y * blockDim.x + threadIdx.x; p < t.positions; p += blockDim.x * blockDim.y) {
    const unsigned column = base + 4u * static_cast<unsigned>(p);
    const float m = position_mean<R>(column, stride, chains, partials, units, rows, ctas, factor);
    if (a.probe == kProbeMean) {
      static_cast<R*>(a.out)[t.b * a.spatial + t.s0 + p] = Storage<R>::store(m);
    } else if constexpr (kLtx) {
      shared_store(entry(column, stride, t.r_entry), ltx_rsqrt(m, a.eps));
    } else {
      shared_store(entry(column, stride, t.r_entry), rms<T>(m, a.eps));
    }
  }
}

#ifndef __CUDACC_RTC__  // the host side the launchers share
bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// The fused kernel's launch shape (ops/per_channel_rmsnorm.py's `fused_shape` is its Python twin): blockDim.y = the
// largest power of two <= min(units, kUnitThreads) threads per vector, blockDim.x = kFusedThreads / blockDim.y
// vectors, halved while the tile's scratch exceeds kSharedFloats and then while the grid has fewer than
// kMinBlocksPerSm blocks per SM; grid (tiles of a batch's positions, batch). False where one vector's scratch does
// not fit.
struct FusedShape {
  dim3 grid;
  dim3 block;
};

inline bool fused_shape(int64_t batch, int64_t spatial, int64_t rows, int64_t ctas, int vec, int sms,
                        FusedShape& shape) {
  const int64_t partials = rows * ctas;
  const int64_t units = partials <= kChainPartials ? 4 * partials : partials;
  const int64_t entries = units + (ctas > 1 ? rows : 0) + 1;
  int ty = 1;
  while (ty * 2 <= units && ty * 2 <= kUnitThreads) ty *= 2;
  int tx = kFusedThreads / ty;
  while (tx > 1 && entries * tx * vec > kSharedFloats) tx /= 2;
  if (entries * tx * vec > kSharedFloats) return false;
  const int64_t vecs = (spatial + vec - 1) / vec;
  while (tx > 1 && batch * ((vecs + tx - 1) / tx) < static_cast<int64_t>(kMinBlocksPerSm) * sms) tx /= 2;
  const int64_t tiles = (vecs + tx - 1) / tx;
  if (tiles > 0x7fffffff || batch > 65535) return false;
  shape.grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(batch));
  shape.block = dim3(tx, ty);
  return true;
}
#endif  // __CUDACC_RTC__

}  // namespace
}  // namespace diffusers_fastpath
