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

template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) per_channel_rmsnorm_kernel(PerChannelRmsNormArgs a) {
  using L = typename Lanes<T, kVector>::type;
  constexpr int kVec = kVector ? Pack<T>::kSize : 1;
  const int64_t vecs = a.spatial / kVec;
  const int64_t groups = (a.channels + kChannels - 1) / kChannels;
  const int64_t items = a.batch * groups * vecs;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t item = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; item < items; item += step) {
    const int64_t row = item / vecs;  // b * groups + g
    const int64_t s = (item - row * vecs) * kVec;
    const int64_t b = row / groups;
    const int64_t c0 = (row - b * groups) * kChannels;
    const int64_t left = a.channels - c0;
    const int count = left < kChannels ? static_cast<int>(left) : kChannels;
    const T* x = static_cast<const T*>(a.x) + b * a.x_batch_stride + c0 * a.x_channel_stride + s;
    T* out = static_cast<T*>(a.out) + (b * a.channels + c0) * a.spatial + s;
    float r[kVec] = {};
    if (!a.probe) {
      const L m = load_lanes<T, kVector>(static_cast<const T*>(a.mean) + b * a.spatial + s);
#pragma unroll
      for (int i = 0; i < kVec; ++i) r[i] = rms<T>(Storage<T>::load(m.v[i]), a.eps);
    }
    L v[kChannels];
#pragma unroll
    for (int k = 0; k < kChannels; ++k) {
      if (k < count) v[k] = load_lanes<T, kVector>(x + k * a.x_channel_stride);
    }
#pragma unroll
    for (int k = 0; k < kChannels; ++k) {
      if (k < count) {
        L o;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          const float xf = Storage<T>::load(v[k].v[i]);
          float y;
          if (a.probe == 1) {
            y = silu(xf);
          } else if (a.probe == 2) {
            y = rms<T>(xf, a.eps);
          } else {
            y = __fdiv_rn(xf, r[i]);
            if (a.silu) y = silu(round_to<T>(y));
          }
          o.v[i] = Storage<T>::store(y);
        }
        *reinterpret_cast<L*>(out + k * a.spatial) = o;
      }
    }
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

// The norm of the positions [blockIdx.x * tile, +tile) of batch blockIdx.y (tile = blockDim.x * kVec) with m computed
// in aten's order for `rows` x `ctas` partial sums (the file's comment), `factor` aten's MeanOps factor. Probe mode
// kProbeMean writes m into out ([batch, spatial]) instead.
template <typename T, bool kVector>
__global__ void __launch_bounds__(kFusedThreads, kFusedMinBlocks)
    per_channel_rmsnorm_fused_kernel(PerChannelRmsNormArgs a, int32_t rows, int32_t ctas, float factor) {
  using L = typename Lanes<T, kVector>::type;
  constexpr int kVec = LaneCount<T, kVector>::value;
  __shared__ float scratch[kSharedFloats];
  // The scratch's shared-window address, pinned in a register: nvcc and NVRTC compute a __shared__ array's address
  // differently (elementwise.cuh's shared_address), and re-deriving it at each use made their machine code differ.
  unsigned base;
  asm volatile("mov.b32 %0, %1;" : "=r"(base) : "r"(shared_address(scratch)));
  const FusedTile t = fused_tile<kVec>(a, rows, ctas);
  const T* x = static_cast<const T*>(a.x) + t.b * a.x_batch_stride + t.s0 + t.p0;
  fused_statistics<T, kVector>(a, t, x, base, rows, ctas, factor);
  const int64_t b = t.b, s0 = t.s0;
  const int p0 = t.p0;
  const unsigned stride = t.stride;
  const int r_entry = t.r_entry;
  const bool active = t.active;
  if (a.probe == kProbeMean) return;  // (every thread of the block: no barrier follows)
  __syncthreads();

  // 3. the tail over the tile's channels, kTailChannels loads in flight per thread
  if (!active) return;
  float r[kVec];
#pragma unroll
  for (int i = 0; i < kVec; ++i) shared_load(entry(base + 4u * (p0 + i), stride, r_entry), r[i]);
  T* out = static_cast<T*>(a.out) + b * a.channels * a.spatial + s0 + p0;
  for (int64_t c0 = threadIdx.y; c0 < a.channels; c0 += static_cast<int64_t>(kTailChannels) * blockDim.y) {
    L v[kTailChannels];
#pragma unroll
    for (int k = 0; k < kTailChannels; ++k) {
      const int64_t c = c0 + static_cast<int64_t>(k) * blockDim.y;
      if (c < a.channels) v[k] = load_lanes<T, kVector>(x + c * a.x_channel_stride);
    }
#pragma unroll
    for (int k = 0; k < kTailChannels; ++k) {
      const int64_t c = c0 + static_cast<int64_t>(k) * blockDim.y;
      if (c < a.channels) {
        L o;
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          float y = __fdiv_rn(Storage<T>::load(v[k].v[i]), r[i]);
          if (a.silu) y = silu(round_to<T>(y));
          o.v[i] = Storage<T>::store(y);
        }
        *reinterpret_cast<L*>(out + c * a.spatial) = o;
      }
    }
  }
}

// --- the norm written as the next causal convolution's padded input, channels-last ---------------------------------

constexpr int kMaxChunk = 256;  // the staging tile's channels at most (a chunk of the tile's channels)
constexpr int kPadTailChannels = 2;  // the tail's loads in flight per thread (fewer than the fused kernel's: registers)
// a tile's positions at most: blockDim.y >= 4 (units >= 4: fused_shape), so blockDim.x <= kFusedThreads / 4, times
// 8 positions a 16-byte vector of a 2-byte T
constexpr int kMaxTilePositions = kFusedThreads / 4 * 8;

// The padded positions of axis position i (n positions, p0 before and p1 after) that hold i's value: i + p0, and with
// `reflect` F.pad's reflected copies, p0 - i (1 <= i <= p0) and p0 + 2 (n - 1) - i (n - 1 - p1 <= i <= n - 2);
// copy k of 3, or -1.
__device__ __forceinline__ int64_t reflected_copy(int k, int64_t i, int64_t n, int64_t p0, int64_t p1, bool reflect) {
  if (k == 0) return i + p0;
  if (!reflect) return -1;
  if (k == 1) return i >= 1 && i <= p0 ? p0 - i : -1;
  return i >= n - 1 - p1 && i <= n - 2 ? p0 + 2 * (n - 1) - i : -1;
}

// Every padded position (an index of [batch, Tp, Hp, Wp]) that holds source position s of batch b: f(index) for
// frame t = s / (H W) at pad_t0 + t, the first frame also at 0 .. pad_t0 - 1 and the last at pad_t0 + T .. Tp - 1
// (eager's repeated frames), row and column at their `reflected_copy`s.
// (The sizes are recomputed from g where used, not kept in registers across the kernel.)
template <typename F>
__device__ __forceinline__ void for_each_copy(const NormPadArgs& g, int64_t b, int64_t s, F f) {
  const int64_t out_t = g.pad_t0 + g.frames + g.pad_t1, out_h = g.pad_h0 + g.height + g.pad_h1;
  const int64_t out_w = g.pad_w0 + g.width + g.pad_w1;
  const bool reflect = g.reflect_hw != 0;
  const int64_t ft = s / (g.height * g.width), h = (s / g.width) % g.height, w = s % g.width;
  const int64_t first_t = ft == 0 ? 0 : ft + g.pad_t0;
  const int64_t last_t = ft == g.frames - 1 ? out_t - 1 : ft + g.pad_t0;
  for (int64_t pt = first_t; pt <= last_t; ++pt) {
#pragma unroll
    for (int kh = 0; kh < 3; ++kh) {
      const int64_t ph = reflected_copy(kh, h, g.height, g.pad_h0, g.pad_h1, reflect);
      if (ph < 0) continue;
#pragma unroll
      for (int kw = 0; kw < 3; ++kw) {
        const int64_t pw = reflected_copy(kw, w, g.width, g.pad_w0, g.pad_w1, reflect);
        if (pw >= 0) f(((b * out_t + pt) * out_h + ph) * out_w + pw);
      }
    }
  }
}

// The padded position of source position s of batch b when it is its only copy, else ~ of it (negative: the caller
// takes `for_each_copy`): the tile's table, so that the stores do no division.
__device__ __forceinline__ long long only_copy(const NormPadArgs& g, int64_t b, int64_t s) {
  const int64_t out_t = g.pad_t0 + g.frames + g.pad_t1, out_h = g.pad_h0 + g.height + g.pad_h1;
  const int64_t out_w = g.pad_w0 + g.width + g.pad_w1, plane = g.height * g.width;
  const int64_t ft = s / plane, rest = s - ft * plane, h = rest / g.width, w = rest - h * g.width;
  const int64_t index = ((b * out_t + ft + g.pad_t0) * out_h + h + g.pad_h0) * out_w + w + g.pad_w0;
  const bool repeated = (ft == 0 && g.pad_t0 > 0) || (ft == g.frames - 1 && g.pad_t1 > 0);
  const bool reflected = g.reflect_hw != 0 && (reflected_copy(1, h, g.height, g.pad_h0, g.pad_h1, true) >= 0 ||
                                       reflected_copy(2, h, g.height, g.pad_h0, g.pad_h1, true) >= 0 ||
                                       reflected_copy(1, w, g.width, g.pad_w0, g.pad_w1, true) >= 0 ||
                                       reflected_copy(2, w, g.width, g.pad_w0, g.pad_w1, true) >= 0);
  return repeated || reflected ? ~index : index;
}

// The staging tile: [position][chunk] words of T (rows of chunk * sizeof(T) bytes, 16-byte granules of channels), the
// granules of row p permuted by p's vector (XOR), so that the threads of a warp storing one channel of their vectors'
// positions hit distinct banks, and a 16-byte read of a row's granule is one LDS.128.
template <typename T, int kVec>
__device__ __forceinline__ unsigned staged(unsigned stage, int row_bytes, int granules, int p, int c) {
  constexpr int kOut = 16 / sizeof(T);  // channels a granule
  const int swizzle = (p / kVec) & (granules - 1);
  return stage + static_cast<unsigned>(p * row_bytes + (((c / kOut) ^ swizzle) << 4) + (c % kOut) * sizeof(T));
}

// per_channel_rmsnorm_fused_kernel's norm (and SiLU), its statistics the same code, its output written as the padded
// input of the causal convolution that reads it next (ltx_causal_conv's buffer, ops/ltx_norm_conv.py): out
// [batch, Tp, Hp, Wp, channels] memory (channels_last_3d of [batch, channels, Tp, Hp, Wp]), each value at every padded
// position whose source it is (`for_each_copy`; with g.reflect_hw F.pad's reflected rows and columns, else no spatial
// border: pads 0, the convolution pads). The values are the fused kernel's (the same operations in the same order),
// only where they are stored differs. After the statistics, the scratch becomes a staging tile: the tile's channels
// go through it in chunks, read as the fused kernel's tail reads them (16-byte vectors along the positions, x's unit
// stride, kPadTailChannels loads in flight a thread), stored as words [position][channel], then written along the
// channels (out's unit stride) in 16-byte vectors where the channels and out allow, else one element a thread. Each
// tile position's padded index is computed once (the table: no division per element); the positions with more than
// one copy (the first and last frames, the reflected rows and columns) write the same vector to each.
//
// kLtx: LTX-Video's VAE norm and its SiLU instead (diffusers' weightless RMSNorm on the channel-last view of x, as
// ops/ltx_vae_rmsnorm_conv.py runs it), for bf16 / fp16 x:
//   q   = x * x                                  x.to(float32).pow(2): the fp32 product of two half-precision values,
//                                                exact (8 + 8, 11 + 11 significant bits < 24): nothing rounds
//   m   = sum_c(q) * factor                      .mean(-1, keepdim=True) of that fp32 tensor: aten's reduce kernel,
//                                                the order above (the fp32 squares keep x's channel-first layout, so
//                                                the iterator is LTX-2's [C, S, B]), m an fp32 tensor, not rounded
//   r   = rsqrtf(m + eps)                        torch.rsqrt(variance + eps): elementwise.cuh's ltx_rsqrt
//   out = ltx_rmsnorm_value(x, r, silu)          round(x * r), then the SiLU of that rounded value, rounded
// The statistics are the same code with the squares and the mean left in fp32 (fused_statistics' R = float); the tail
// stores ltx_rmsnorm_value (ltx_vae_rmsnorm.cu's and causal_pad.cu's epilogue). Probe mode kProbeMean writes m
// ([batch, spatial] fp32) and stops after the statistics.
template <typename T, bool kVector, bool kLtx = false>
__global__ void __launch_bounds__(kFusedThreads, kFusedMinBlocks)
    per_channel_rmsnorm_pad_cl_kernel(PerChannelRmsNormArgs a, NormPadArgs g, int32_t rows, int32_t ctas,
                                      float factor) {
  using L = typename Lanes<T, kVector>::type;
  using W = typename Word<sizeof(T)>::type;
  constexpr int kVec = LaneCount<T, kVector>::value;
  constexpr int kOut = 16 / sizeof(T);  // channels a 16-byte store
  // the statistics' scratch (then the staging tile), then the tile's table of padded positions (8 bytes each)
  __shared__ __align__(16) float scratch[kSharedFloats + 2 * kMaxTilePositions];
  // Its shared-window address from the generic one in inline PTX: nvcc and NVRTC lower shared_address's conversion
  // differently (a 32-bit move against a 64-bit one and a truncation), which renumbered this kernel's registers and
  // gave ptxas other choices; both pass the same generic address into this asm.
  unsigned base;
  asm volatile("{\n .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;\n}"
               : "=r"(base)
               : "l"(reinterpret_cast<unsigned long long>(scratch)));
  const unsigned table = base + 4u * kSharedFloats;
  const FusedTile t = fused_tile<kVec>(a, rows, ctas);
  const int threads = blockDim.x * blockDim.y;
  const int tid = threadIdx.y * blockDim.x + threadIdx.x;
  for (int p = tid; p < t.positions; p += threads) {  // (read after the barriers below)
    shared_store(table + 8u * p, static_cast<unsigned long long>(only_copy(g, t.b, t.s0 + p)));
  }
  const T* x = static_cast<const T*>(a.x) + t.b * a.x_batch_stride + t.s0 + t.p0;
  fused_statistics<T, kVector, kLtx>(a, t, x, base, rows, ctas, factor);
  if constexpr (kLtx) {
    if (a.probe == kProbeMean) return;  // (every thread of the block: no barrier follows)
  }
  __syncthreads();
  float r[kVec] = {};
  if (t.active) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) shared_load(entry(base + 4u * (t.p0 + i), t.stride, t.r_entry), r[i]);
  }
  __syncthreads();  // (the scratch becomes the staging tile)

  // 3. the tail, `chunk` channels at a time (a power of two, at least one granule)
  const int tile = blockDim.x * kVec;
  int chunk = kMaxChunk;
  while (chunk > kOut && (tile * chunk * static_cast<int>(sizeof(T)) > 4 * kSharedFloats || chunk / 2 >= a.channels)) {
    chunk >>= 1;
  }
  const int row_bytes = chunk * sizeof(T), granules = row_bytes / 16;
  const bool vector_out = a.channels % kOut == 0 && reinterpret_cast<unsigned long long>(a.out) % 16 == 0;
  const int unit_shift = __ffs(vector_out ? granules : chunk) - 1;  // log2 of the stores a row
  T* out = static_cast<T*>(a.out);
  for (int64_t c0 = 0; c0 < a.channels; c0 += chunk) {  // (bounds uniform over the block: __syncthreads is safe)
    const int count = a.channels - c0 < chunk ? static_cast<int>(a.channels - c0) : chunk;
    if (t.active) {  // read along the positions
      for (int c1 = threadIdx.y; c1 < count; c1 += kPadTailChannels * blockDim.y) {
        L v[kPadTailChannels];
#pragma unroll
        for (int k = 0; k < kPadTailChannels; ++k) {
          const int c = c1 + k * blockDim.y;
          if (c < count) v[k] = load_lanes<T, kVector>(x + (c0 + c) * a.x_channel_stride);
        }
#pragma unroll
        for (int k = 0; k < kPadTailChannels; ++k) {
          const int c = c1 + k * blockDim.y;
          if (c < count) {
#pragma unroll
            for (int i = 0; i < kVec; ++i) {
              if constexpr (kLtx) {
                shared_store(staged<T, kVec>(base, row_bytes, granules, t.p0 + i, c),
                             bits_of(ltx_rmsnorm_value<T>(v[k].v[i], r[i], a.silu)));
              } else {
                float y = __fdiv_rn(Storage<T>::load(v[k].v[i]), r[i]);
                if (a.silu) y = silu(round_to<T>(y));
                shared_store(staged<T, kVec>(base, row_bytes, granules, t.p0 + i, c), bits_of(Storage<T>::store(y)));
              }
            }
          }
        }
      }
    }
    __syncthreads();
    // written along the channels: store u of position p holds granule u (vector_out) or channel u of the chunk
    for (int e = tid; e < (t.positions << unit_shift); e += threads) {
      const int p = e >> unit_shift, u = e & ((1 << unit_shift) - 1);
      if (u * (vector_out ? kOut : 1) >= count) continue;
      unsigned long long index;
      shared_load(table + 8u * p, index);
      T* dst = out + c0;
      if (vector_out) {
        uint4 v;
        shared_load(staged<T, kVec>(base, row_bytes, granules, p, u * kOut), v);
        dst += u * kOut;
        if (static_cast<long long>(index) >= 0) {
          *reinterpret_cast<uint4*>(dst + static_cast<int64_t>(index) * a.channels) = v;
        } else {
          for_each_copy(g, t.b, t.s0 + p, [&](int64_t i) { *reinterpret_cast<uint4*>(dst + i * a.channels) = v; });
        }
      } else {
        W v;
        shared_load(staged<T, kVec>(base, row_bytes, granules, p, u), v);
        dst += u;
        if (static_cast<long long>(index) >= 0) {
          *reinterpret_cast<W*>(dst + static_cast<int64_t>(index) * a.channels) = v;
        } else {
          for_each_copy(g, t.b, t.s0 + p, [&](int64_t i) { *reinterpret_cast<W*>(dst + i * a.channels) = v; });
        }
      }
    }
    __syncthreads();  // (the staging tile is refilled by the next chunk)
  }
}

// LTX-Video's reciprocal alone (probe): out[i] = ltx_rsqrt(m[i], eps) for n values m of the mean's type M (fp32:
// the one instantiation), what the kLtx pad kernel computes from each position's mean; the Python op proves it on
// every fp32 bit pattern against eager's torch.rsqrt(m + eps) on the device.
template <typename M>
__global__ void __launch_bounds__(kThreads) ltx_rsqrt_probe_kernel(const M* m, M* out, int64_t n, float eps) {
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += step) {
    out[i] = ltx_rsqrt(m[i], eps);
  }
}

// --- the same, reading the channels-last result of the convolution before it and adding that one's bias -------------
//
// ops/ltx_bias_norm_conv.py: where the norm reads a causal convolution's output that went channels-last through cuDNN
// (causal_conv_cl's convolve_channels_last, which would then run conv_bias.cu's bias_contiguous: the bias add and the
// transpose back to [batch, channels, spatial]), x is that convolution's result without its bias, [batch, spatial,
// channels] memory (channels_last_3d of [batch, channels, T, H, W]), and each value is taken as eager's tensor holds
// it where it is loaded: round(x + bias[c]) (aten's `output.add_(bias)` after cuDNN's bias-less convolution, one fp32
// add rounded to T: bias_contiguous's arithmetic). The statistics are the fused kernel's chains over those values
// (the same float operations in the same order: only the addresses differ), the tail the pad kernel's values and
// stores; the reads and the stores both run along the channels, so no staging tile is needed.

constexpr int kClTilePositions = kFusedThreads;  // a tile's positions at most (at least one thread a position)

// round(x + bias): the value of eager's convolution output (cuDNN's result, then aten's bias add, rounded to T)
template <typename T>
__device__ __forceinline__ float biased(T x, T bias) {
  return round_to<T>(__fadd_rn(Storage<T>::load(x), Storage<T>::load(bias)));
}

// Stage 1 over channels-last x: chain rho = j + i P (the fused kernel's unit u = 4 j + i: channels j + (i + 4 n) P,
// added from 0 in channel order) sums the channels c = rho (mod G), G = 4 P. A thread takes kLanes chains of one
// position, reading its 16-byte vectors at channels first, first + step, ...: with G >= kVec (kLanes = kVec, first =
// k kVec for the position's thread k, step = G) element i of each is chain k kVec + i; with G = 4 < kVec (P = 1: one
// thread a position, kLanes = 4, first 0, step kVec) element i is chain i % 4, the two values of a vector in channel
// order. Four vectors (and their biases) in flight.
template <typename T, int kLanes>
__device__ __forceinline__ void cl_chain_sums(const T* x, const T* bias, int64_t first, int64_t step, int64_t channels,
                                              float (&acc)[kLanes]) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
#pragma unroll
  for (int i = 0; i < kLanes; ++i) acc[i] = 0.0f;
  int64_t c = first;
  for (; c + 3 * step < channels; c += 4 * step) {
    P v[4], w[4];
#pragma unroll
    for (int k = 0; k < 4; ++k) {
      v[k] = load_readonly(reinterpret_cast<const P*>(x + c + k * step));
      w[k] = load_readonly(reinterpret_cast<const P*>(bias + c + k * step));
    }
#pragma unroll
    for (int k = 0; k < 4; ++k) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        acc[i % kLanes] = __fadd_rn(acc[i % kLanes], square<T>(biased<T>(v[k].v[i], w[k].v[i])));
      }
    }
  }
  for (; c < channels; c += step) {
    const P v = load_readonly(reinterpret_cast<const P*>(x + c));
    const P w = load_readonly(reinterpret_cast<const P*>(bias + c));
#pragma unroll
    for (int i = 0; i < kVec; ++i) acc[i % kLanes] = __fadd_rn(acc[i % kLanes], square<T>(biased<T>(v.v[i], w.v[i])));
  }
}

// Chain sums acc[0 .. kLanes) of a position's thread k into their scratch entries (chain rho = k kLanes + i at entry
// 4 (rho % P) + rho / P, the fused kernel's unit of that chain).
template <int kLanes>
__device__ __forceinline__ void store_chains(unsigned column, unsigned stride, int k, int partials,
                                             const float (&acc)[kLanes]) {
#pragma unroll
  for (int i = 0; i < kLanes; ++i) {
    const int rho = k * kLanes + i;
    shared_store(entry(column, stride, 4 * (rho % partials) + rho / partials), acc[i]);
  }
}

// The pad kernel's output (per_channel_rmsnorm_pad_cl_kernel: out [batch, Tp, Hp, Wp, channels], each value at every
// padded position whose source it is) from channels-last x plus `bias` (x and bias 16-byte aligned, channels a
// multiple of kVec; G a multiple of kVec, or 4), the tile `tile` positions of batch blockIdx.y (cl_shape), blockDim.x =
// kFusedThreads. 1: each position's chains (cl_chain_sums, `per_position` threads a position) into its scratch
// column; 2: per position the fused kernel's combine (position_mean) and r; 3: per (position, 16-byte vector of
// channels) the division, the SiLU and the store at each of the position's padded copies (the tile's table, as the pad
// kernel's), two vectors in flight a thread.
template <typename T>
__global__ void __launch_bounds__(kFusedThreads, kFusedMinBlocks)
    per_channel_rmsnorm_cl_pad_cl_kernel(PerChannelRmsNormArgs a, NormPadArgs g, const void* bias_data, int32_t rows,
                                         int32_t ctas, float factor, int32_t tile) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  // the statistics' scratch, then the tile's table of padded positions (8 bytes each)
  __shared__ __align__(16) float scratch[kSharedFloats + 2 * kClTilePositions];
  unsigned base;  // (the shared-window address through inline PTX, as the pad kernel takes it)
  asm volatile("{\n .reg .u64 t;\n cvta.to.shared.u64 t, %1;\n cvt.u32.u64 %0, t;\n}"
               : "=r"(base)
               : "l"(reinterpret_cast<unsigned long long>(scratch)));
  const unsigned table = base + 4u * kSharedFloats;
  const int partials = rows * ctas;
  const int chains = 4 * partials;
  const int per_position = chains < kVec ? 1 : chains / kVec;
  const int r_entry = chains + (ctas > 1 ? rows : 0);
  const unsigned stride = 4u * static_cast<unsigned>(tile);
  const int64_t b = blockIdx.y;
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * tile;
  const int64_t left = a.spatial - s0;
  const int positions = left < tile ? static_cast<int>(left) : tile;
  const int tid = threadIdx.x;
  const T* x = static_cast<const T*>(a.x) + b * a.x_batch_stride + s0 * a.channels;  // the tile's first position
  const T* bias = static_cast<const T*>(bias_data);
  for (int p = tid; p < positions; p += blockDim.x) {  // (read after the barriers below)
    shared_store(table + 8u * p, static_cast<unsigned long long>(only_copy(g, b, s0 + p)));
  }

  // 1. the chains
  {
    const int p = tid / per_position, k = tid - p * per_position;
    if (p < positions) {
      const unsigned column = base + 4u * static_cast<unsigned>(p);
      const T* xp = x + static_cast<int64_t>(p) * a.channels;
      if (chains >= kVec) {
        float acc[kVec];
        cl_chain_sums<T, kVec>(xp, bias, static_cast<int64_t>(k) * kVec, chains, a.channels, acc);
        store_chains<kVec>(column, stride, k, partials, acc);
      } else {
        float acc[4];
        cl_chain_sums<T, 4>(xp, bias, 0, kVec, a.channels, acc);
        store_chains<4>(column, stride, 0, partials, acc);
      }
    }
  }
  __syncthreads();

  // 2. per position: the fused kernel's combine, m, r
  for (int p = tid; p < positions; p += blockDim.x) {
    const unsigned column = base + 4u * static_cast<unsigned>(p);
    const float m = position_mean<T>(column, stride, true, partials, chains, rows, ctas, factor);
    shared_store(entry(column, stride, r_entry), rms<T>(m, a.eps));
  }
  __syncthreads();

  // 3. the tail along the channels
  const int vectors = static_cast<int>(a.channels / kVec);
  const int items = positions * vectors;
  T* out = static_cast<T*>(a.out);
  for (int e0 = tid; e0 < items; e0 += 2 * blockDim.x) {
    P v[2], w[2];
    int p[2], u[2];
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      const int e = e0 + k * static_cast<int>(blockDim.x);
      p[k] = e / vectors;
      u[k] = e - p[k] * vectors;
      if (e < items) {
        v[k] = load_readonly(reinterpret_cast<const P*>(x + static_cast<int64_t>(p[k]) * a.channels) + u[k]);
        w[k] = load_readonly(reinterpret_cast<const P*>(bias) + u[k]);
      }
    }
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      if (e0 + k * static_cast<int>(blockDim.x) >= items) continue;
      float r;
      shared_load(entry(base + 4u * static_cast<unsigned>(p[k]), stride, r_entry), r);
      P o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        float y = __fdiv_rn(biased<T>(v[k].v[i], w[k].v[i]), r);
        if (a.silu) y = silu(round_to<T>(y));
        o.v[i] = Storage<T>::store(y);
      }
      unsigned long long index;
      shared_load(table + 8u * static_cast<unsigned>(p[k]), index);
      T* dst = out + static_cast<int64_t>(u[k]) * kVec;
      if (static_cast<long long>(index) >= 0) {
        *reinterpret_cast<P*>(dst + static_cast<int64_t>(index) * a.channels) = o;
      } else {
        for_each_copy(g, b, s0 + p[k], [&](int64_t i) { *reinterpret_cast<P*>(dst + i * a.channels) = o; });
      }
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches it)
bool aligned(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

template <typename T>
cudaError_t launch(const PerChannelRmsNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const bool vector = a.spatial % kVec == 0 && a.x_channel_stride % kVec == 0 && a.x_batch_stride % kVec == 0 &&
                      aligned(a.x) && aligned(a.out) && (a.probe || aligned(a.mean));
  const int64_t items = a.batch * ((a.channels + kChannels - 1) / kChannels) * (a.spatial / (vector ? kVec : 1));
  return launch_vector_or_element(per_channel_rmsnorm_kernel<T, true>, per_channel_rmsnorm_kernel<T, false>, vector,
                                  items, kThreads, kBlocksPerSm, a, stream);
}

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

template <typename T>
cudaError_t launch_fused(const PerChannelRmsNormArgs& a, int32_t rows, int32_t ctas, float factor,
                         cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const bool vector = a.spatial % kVec == 0 && a.x_channel_stride % kVec == 0 && a.x_batch_stride % kVec == 0 &&
                      aligned(a.x) && aligned(a.out);
  FusedShape shape;
  if (rows < 1 || rows > 512 || (rows & (rows - 1)) != 0 || ctas < 1 || (a.probe != 0 && a.probe != kProbeMean) ||
      !fused_shape(a.batch, a.spatial, rows, ctas, vector ? kVec : 1, num_sms(), shape)) {
    return cudaErrorInvalidValue;
  }
  if (a.batch == 0 || a.channels == 0 || a.spatial == 0) return cudaSuccess;
  if (vector) {
    per_channel_rmsnorm_fused_kernel<T, true><<<shape.grid, shape.block, 0, stream>>>(a, rows, ctas, factor);
  } else {
    per_channel_rmsnorm_fused_kernel<T, false><<<shape.grid, shape.block, 0, stream>>>(a, rows, ctas, factor);
  }
  return cudaGetLastError();
}

// The pad kernel's launch: the fused kernel's shape (its statistics are the same), vectors or elements as it chooses
// them (x's sizes, strides and pointer; the kernel picks its stores' width from the channels and out's pointer). kLtx:
// LTX-Video's norm (bf16 / fp16), probe 0 or kProbeMean (a.out fp32 [batch, spatial], g unread but for its check).
template <typename T, bool kLtx = false>
cudaError_t launch_pad_cl(const PerChannelRmsNormArgs& a, const NormPadArgs& g, int32_t rows, int32_t ctas,
                          float factor, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const bool vector =
      a.spatial % kVec == 0 && a.x_channel_stride % kVec == 0 && a.x_batch_stride % kVec == 0 && aligned(a.x);
  FusedShape shape;
  const bool probe_ok = a.probe == 0 || (kLtx && a.probe == kProbeMean);
  if (rows < 1 || rows > 512 || (rows & (rows - 1)) != 0 || ctas < 1 || !probe_ok ||
      g.frames * g.height * g.width != a.spatial ||
      !fused_shape(a.batch, a.spatial, rows, ctas, vector ? kVec : 1, num_sms(), shape)) {
    return cudaErrorInvalidValue;
  }
  if (a.batch == 0 || a.channels == 0 || a.spatial == 0) return cudaSuccess;
  if (vector) {
    per_channel_rmsnorm_pad_cl_kernel<T, true, kLtx><<<shape.grid, shape.block, 0, stream>>>(a, g, rows, ctas, factor);
  } else {
    per_channel_rmsnorm_pad_cl_kernel<T, false, kLtx><<<shape.grid, shape.block, 0, stream>>>(a, g, rows, ctas, factor);
  }
  return cudaGetLastError();
}

// The channels-last kernel's launch (ops/ltx_bias_norm_conv.py's `cl_shape` is its Python twin): blocks of
// kFusedThreads threads; `tile` positions a block, the largest power of two whose stage-1 threads (per_position a
// position) and scratch (the G chains, the global step's rows where ctas > 1, r: entries a position) fit, halved while
// the grid has fewer than kMinBlocksPerSm blocks per SM; grid (tiles of a batch's positions, batch). False where the
// chains do not map onto the 16-byte vectors (G = 4 P neither a multiple of vec nor 4), the channels are no multiple of
// vec, or one position's chains or scratch do not fit.
inline bool cl_shape(int64_t batch, int64_t spatial, int64_t channels, int64_t rows, int64_t ctas, int vec, int sms,
                     FusedShape& shape, int& tile) {
  const int64_t chains = 4 * rows * ctas;
  if (channels % vec != 0 || (chains % vec != 0 && chains != 4)) return false;
  const int64_t per_position = chains < vec ? 1 : chains / vec;
  const int64_t entries = chains + (ctas > 1 ? rows : 0) + 1;
  if (per_position > kFusedThreads || entries > kSharedFloats) return false;
  int64_t t = 1;
  while (2 * t * per_position <= kFusedThreads && 2 * t * entries <= kSharedFloats) t *= 2;
  while (t > 1 && batch * ((spatial + t - 1) / t) < static_cast<int64_t>(kMinBlocksPerSm) * sms) t /= 2;
  const int64_t tiles = (spatial + t - 1) / t;
  if (tiles > 0x7fffffff || batch > 65535) return false;
  shape.grid = dim3(static_cast<unsigned>(tiles), static_cast<unsigned>(batch));
  shape.block = dim3(kFusedThreads);
  tile = static_cast<int>(t);
  return true;
}

// The channels-last kernel's launch: x (args.x) [batch, spatial, channels] memory and `bias` 16-byte aligned, args
// as the pad kernel's (x_channel_stride unused), cl_shape.
template <typename T>
cudaError_t launch_cl_pad_cl(const PerChannelRmsNormArgs& a, const NormPadArgs& g, const void* bias, int32_t rows,
                             int32_t ctas, float factor, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  FusedShape shape;
  int tile = 0;
  if (rows < 1 || rows > 512 || (rows & (rows - 1)) != 0 || ctas < 1 || a.probe != 0 ||
      g.frames * g.height * g.width != a.spatial || !aligned(a.x) || !aligned(a.out) || !aligned(bias) ||
      a.x_batch_stride % kVec != 0 ||
      !cl_shape(a.batch, a.spatial, a.channels, rows, ctas, kVec, num_sms(), shape, tile)) {
    return cudaErrorInvalidValue;
  }
  if (a.batch == 0 || a.channels == 0 || a.spatial == 0) return cudaSuccess;
  per_channel_rmsnorm_cl_pad_cl_kernel<T><<<shape.grid, shape.block, 0, stream>>>(a, g, bias, rows, ctas, factor, tile);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
// (declared in fastpath.h)
cudaError_t launch_per_channel_rmsnorm_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad, int32_t rows,
                                              int32_t ctas, float factor, cudaStream_t stream) {
  return dispatch_storage_or_float(
      args.dtype, [&](auto tag) { return launch_pad_cl<decltype(tag)>(args, pad, rows, ctas, factor, stream); });
}

// (declared in fastpath.h)
cudaError_t launch_per_channel_rmsnorm_cl_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad,
                                                 const void* bias, int32_t rows, int32_t ctas, float factor,
                                                 cudaStream_t stream) {
  return dispatch_storage_or_float(
      args.dtype, [&](auto tag) { return launch_cl_pad_cl<decltype(tag)>(args, pad, bias, rows, ctas, factor, stream); });
}

// (declared in fastpath.h)
cudaError_t launch_ltx_rmsnorm_fused_pad_cl(const PerChannelRmsNormArgs& args, const NormPadArgs& pad, int32_t rows,
                                           int32_t ctas, float factor, cudaStream_t stream) {
  return dispatch_storage_type(
      args.dtype, [&](auto tag) { return launch_pad_cl<decltype(tag), true>(args, pad, rows, ctas, factor, stream); });
}

// (declared in fastpath.h)
cudaError_t launch_ltx_rsqrt_probe(const float* m, float* out, int64_t n, float eps, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t blocks = grid_stride_blocks(n, kThreads, kBlocksPerSm);
  ltx_rsqrt_probe_kernel<float><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(m, out, n, eps);
  return cudaGetLastError();
}

cudaError_t launch_per_channel_rmsnorm(const PerChannelRmsNormArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}

// (declared in fastpath.h)
cudaError_t launch_per_channel_rmsnorm_fused(const PerChannelRmsNormArgs& args, int32_t rows, int32_t ctas,
                                             float factor, cudaStream_t stream) {
  return dispatch_storage_or_float(
      args.dtype, [&](auto tag) { return launch_fused<decltype(tag)>(args, rows, ctas, factor, stream); });
}
#endif

}  // namespace diffusers_fastpath
