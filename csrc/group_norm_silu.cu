// torch.nn.GroupNorm with weight and bias over a contiguous [N, C, *] tensor, optionally followed by SiLU (the VAE's
// `norm1 -> nonlinearity` pairs), bit-identical to eager F.group_norm (then F.silu), with the statistics spread over
// the whole GPU instead of one block per (batch, group) row.
//
// What eager runs on CUDA (aten/src/ATen/native/cuda/group_norm_kernel.cu, torch 2.11; T = bf16 or fp16, every
// operation in fp32; a row is one (n, g): the D * HxW = (C / G) * HxW contiguous elements of group g of sample n):
//  1. RowwiseMomentsCUDAKernel<<<N * G, threads>>>, threads = 32 if the row is shorter than 512
//     (cuda_utils::kCUDABlockReduceNumThreads) else 512. Thread t folds x[t], x[t + threads], x[t + 2 threads], ...
//     in that order into its WelfordData with WelfordOps::reduce (SharedReduceOps.h):
//       n = n + 1; nf = float(n); delta = x - mean; mean = mean + delta / nf; m2 = m2 + delta * (x - mean)
//     then cuda_utils::WarpReduce (a shuffle-down tree over offsets 16, 8, 4, 2, 1, each step
//     `val = combine(val, shfl_down(val))`), and with 512 threads cuda_utils::BlockReduce: lane 0 of each warp writes
//     its state to shared memory, warp 0 reloads them (lane l < 16 warp l's, the other lanes the identity (0, 0, 0,
//     0)) and runs the same warp tree. WelfordOps::combine(a, b):
//       a.nf == 0: b; b.nf == 0: a; else delta = b.mean - a.mean; nf = a.nf + b.nf; nb = b.nf / nf;
//       mean = a.mean + delta * nb; m2 = a.m2 + b.m2 + delta * delta * a.nf * nb
//     project: var = m2 / nf; rstd = rsqrtf(var + float(T(eps))) (the kernel's `T eps`: eps rounded to T first).
//     torch 2.11 stores mean and rstd as T (the kernel's `T* mean, T* rstd`); newer torch keeps them in fp32
//     (pytorch#183946): variant bit kStatsInFloat.
//  2. ComputeFusedParamsCUDAKernel: per (n, c): a = rstd * gamma[c]; b = -a * mean + beta[c].
//  3. The elementwise kernel: y = round_T(a * x + b).
//  4. (the module after it, SiLU) aten's silu_kernel: out = round_T(y / (1 + expf(-y))), as csrc/silu_mul.cu.
// aten is built with nvcc's default --fmad=true, which contracts `u + v * w` into an FMA where it chooses to:
//   m2 = fma(delta, x - mean, m2)                          (online update; the mean's division is div.rn)
//   mean = fma(delta, nb, a.mean)   m2 = fma(delta * delta * a.nf, nb, a.m2 + b.m2)      (combine)
//   b = round(-a * mean) + beta     y = fma(a, x, b)                  (params: not contracted; output: contracted)
// The params and the output were read off the GPU with the variant bits below (torch 2.11's build on the H200, fp16
// at FLUX's shapes: only bit 16 clear and bit 32 clear match). The statistics' contractions are the ones
// layernorm_scale_shift.cu read off the SASS of the same Welford expressions; the probe cannot tell those bits apart
// (torch 2.11 rounds mean and rstd to T, which hides a last-bit difference), so the per-signature check stands for
// them.
// This file is built with --fmad=false and spells each of those out with __fmaf_rn / __fmul_rn / __fadd_rn. Each
// choice is a bit of `variant` (below) that the GPU tests' probe flips to ask the GPU which aten build it runs
// against; the Python op (ops/group_norm_silu.py) also verifies itself against eager per signature, since all of this
// is a property of the aten build.
//
// How the work is spread: each aten thread's chain stays serial and unchanged (one chain per thread here too), but
// the chains of a row run in 16 blocks of one warp each (group_norm_stats_kernel: one aten warp per block, its shuffle
// tree unchanged) instead of one block of 512: a FLUX.1 decode at 1024x1024 has 32 rows per GroupNorm, so eager keeps
// 32 of the H200's 132 multiprocessors busy with one block each, here 512 blocks spread over all of them, each
// keeping a batch of 64 loads per thread in flight while the previous batch folds in. A chain is then bound by its
// own latency, so the division, the one long operation of the update, runs without div.rn's branch (quotient(): the
// same correctly rounded quotient). Each warp writes its combined state (mean, m2, nf); the apply kernel's first warp,
// per block, runs BlockReduce's second level over a row's 16 states in aten's order (the same shuffle tree, lanes
// 16..31 the identity), then the projection, the fused params and the normalise (+ SiLU) of its part of the row in
// 16-byte vectors: two kernels where eager runs four (five with the SiLU), x read twice and the output written once.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kAtenBlockThreads = 512;  // cuda_utils::kCUDABlockReduceNumThreads: rows of at least this many elements
constexpr int kWarp = 32;
constexpr int kBatch = 64;              // elements per thread loaded ahead (two batches in registers: 128 loads)
constexpr int kProbeBatch = 32;         // the probe kernel's (its run-time variant needs more registers)
constexpr int kApplyThreads = 256;
constexpr int kApplyBlocksPerSm = 8;

// Each bit departs from aten-as-compiled-by-nvcc in one place (production: kDefaultStatsVariant for the statistics,
// the Python op's choice for the rest, see ops/group_norm_silu.py). torch 2.11's build, read off the GPU with these
// bits (H200, 2026-12-04; fp16 tells them apart, bf16's rounding hides them): the statistics as above, params NOT
// contracted (bit 16 clear), the output contracted.
constexpr int kOnlineM2Unfused = 1;      // online update: m2 + round(delta * (x - mean))
constexpr int kCombineMeanUnfused = 2;   // combine: a.mean + round(delta * nb)
constexpr int kCombineM2Unfused = 4;     // combine: (a.m2 + b.m2) + round(round(round(delta * delta) * a.nf) * nb)
constexpr int kStatsInFloat = 8;         // mean and rstd kept in fp32 (newer torch), not rounded to T (torch 2.11)
constexpr int kParamsFused = 16;         // params: fma(-a, mean, beta) (torch 2.11: round(-a * mean) + beta)
constexpr int kApplyUnfused = 32;        // output: round(a * x) + b, then rounded to T
constexpr int kIdentityAffine = 64;      // the SiLU's proof: a = 1, b = -0, so y = fma(1, x, -0) = x for every x
constexpr int kDivRn = 128;              // the online update's division as div.rn (the same quotient, see quotient())
constexpr int kStatsVariantMask = 135;   // the bits the statistics kernel reads (1, 2, 4, 128)
constexpr int kVariantMask = 255;
constexpr int kDefaultStatsVariant = 0;  // the production statistics kernel's (compile-time) choice

struct Welford {
  float mean;
  float m2;
  float nf;
};

// WelfordOps::combine(a, b).
__device__ __forceinline__ Welford combine(const Welford& a, const Welford& b, int variant) {
  if (a.nf == 0.0f) return b;
  if (b.nf == 0.0f) return a;
  const float delta = __fsub_rn(b.mean, a.mean);
  const float nf = __fadd_rn(a.nf, b.nf);
  const float nb = __fdiv_rn(b.nf, nf);
  const float mean = (variant & kCombineMeanUnfused) ? __fadd_rn(a.mean, __fmul_rn(delta, nb))
                                                     : __fmaf_rn(delta, nb, a.mean);
  const float m2s = __fadd_rn(a.m2, b.m2);
  const float t = __fmul_rn(__fmul_rn(delta, delta), a.nf);
  const float m2 = (variant & kCombineM2Unfused) ? __fadd_rn(m2s, __fmul_rn(t, nb)) : __fmaf_rn(t, nb, m2s);
  return {mean, m2, nf};
}

// cuda_utils::WarpReduce: every lane ends with a combined state; lane 0's is the warp's (lanes past the warp's end
// get their own value back from the shuffle, as in aten).
__device__ __forceinline__ Welford warp_reduce(Welford w, int variant) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const Welford other{__shfl_down_sync(0xffffffffu, w.mean, offset), __shfl_down_sync(0xffffffffu, w.m2, offset),
                        __shfl_down_sync(0xffffffffu, w.nf, offset)};
    w = combine(w, other, variant);
  }
  return w;
}

// delta / nf for nf = count, an integer in [1, 2^24], as div.rn gives it, without div.rn's per-call range check (an
// FCHK and a branch: one basic block per element, which measured ~350 cycles per element on the H200). With
// r = RN(1 / nf) (precomputed off the chain, see fold_batch): q0 = RN(delta * r) is within 1.5 ulps of delta / nf;
// one correction, q1 = RN(q0 + RN(delta - nf * q0) * r), leaves it within an ulp (faithful); then rem = delta - nf *
// q1 is exact (one FMA: a faithful quotient's remainder is a multiple of its ulp below nf of them) and
// RN(q1 + rem * r) is the correctly rounded quotient (Markstein's theorem: q faithful, r within half an ulp of 1/nf,
// no underflow or overflow). That is the shape of div.rn's own fast path, with an exactly rounded reciprocal. The
// theorem needs delta where nothing under- or overflows: `in_range` flags the rest (|delta| above 2^64 or below 2^-64
// but not zero; inf; NaN), and a flagged batch is folded again with div.rn. The GPU tests check the quotient against
// div.rn for every mantissa of one binade and every nf up to 2^14 (and exact rational arithmetic agreed on random
// cases with nf up to 2^24, where a single correction was not enough); kDivRn runs the division as div.rn.
__device__ __forceinline__ float quotient(float delta, float nf, float r) {
  const float q0 = __fmul_rn(delta, r);
  const float q1 = __fmaf_rn(__fmaf_rn(-q0, nf, delta), r, q0);
  return __fmaf_rn(__fmaf_rn(-q1, nf, delta), r, q1);
}

__device__ __forceinline__ bool in_range(float delta) {
  const float m = fabsf(delta);
  return m <= 0x1p64f && (m >= 0x1p-64f || m == 0.0f);  // false for NaN
}

// WelfordOps::reduce of one element v, its count nf (= count as float) and r = RN(1 / nf); kFast: the quotient above.
template <bool kFast>
__device__ __forceinline__ void fold(Welford& w, float v, float nf, float r, int variant, bool& ok) {
  const float delta = __fsub_rn(v, w.mean);
  float q;
  if (kFast) {
    q = quotient(delta, nf, r);
    ok = ok && in_range(delta);
  } else {
    q = __fdiv_rn(delta, nf);
  }
  w.mean = __fadd_rn(w.mean, q);
  const float d2 = __fsub_rn(v, w.mean);
  w.m2 = (variant & kOnlineM2Unfused) ? __fadd_rn(w.m2, __fmul_rn(delta, d2)) : __fmaf_rn(delta, d2, w.m2);
}

template <typename T>
__device__ __forceinline__ float to_float(unsigned short bits);

template <>
__device__ __forceinline__ float to_float<__nv_bfloat16>(unsigned short bits) {
  return Storage<__nv_bfloat16>::load(__ushort_as_bfloat16(bits));
}

template <>
__device__ __forceinline__ float to_float<__half>(unsigned short bits) {
  return Storage<__half>::load(__ushort_as_half(bits));
}

// One batch of kB elements of each lane's chain: element k of a lane is the (base + k + 1)-th of its chain for every
// lane, so all lanes share each element's count and reciprocal: lane l computes RN(1 / (base + l + 1)) (and
// RN(1 / (base + l + 33)) for a batch of 64), which the others read by shuffle (off the chain). `valid`: how many of
// the batch's elements the lane has (kB but in the warp's last batch, where the state is kept by a select past it).
// A batch with an element out of the quotient's range is folded again from its start with div.rn.
template <typename T, bool kTail, int kB>
__device__ __forceinline__ void fold_batch(Welford& w, const unsigned short (&cur)[kB], int64_t base, int64_t valid,
                                           int lane, int variant) {
  static_assert(kB == kWarp || kB == 2 * kWarp, "a batch is one or two reciprocals per lane");
  const float r_lo = __frcp_rn(__ll2float_rn(base + lane + 1));
  const float r_hi = kB > kWarp ? __frcp_rn(__ll2float_rn(base + lane + 1 + kWarp)) : 0.0f;
  const Welford start = w;
  bool ok = !(variant & kDivRn);
#pragma unroll
  for (int k = 0; k < kB; ++k) {
    const float r = __shfl_sync(0xffffffffu, k < kWarp ? r_lo : r_hi, k % kWarp);
    const float nf = __ll2float_rn(base + k + 1);
    if (kTail) {
      const Welford before = w;
      fold<true>(w, to_float<T>(cur[k]), nf, r, variant, ok);
      if (k >= valid) w = before;
    } else {
      fold<true>(w, to_float<T>(cur[k]), nf, r, variant, ok);
    }
  }
  if (!ok) {  // rare: some |delta| outside [2^-64, 2^64] (or the probe's kDivRn): the batch again, with div.rn
    w = start;
    bool unused = true;
#pragma unroll  // (a rolled loop would index `cur` at run time and move it to local memory)
    for (int k = 0; k < kB; ++k) {
      if (!kTail || k < valid) fold<false>(w, to_float<T>(cur[k]), __ll2float_rn(base + k + 1), 0.0f, variant, unused);
    }
  }
}

// Loads element `first` + kThreads * (m + k) of the row for k < kB (those below `len`, the lane's chain length; 0
// past it): kThreads at compile time, so each load is the lane's base pointer plus an immediate offset.
template <int kThreads, int kB>
__device__ __forceinline__ void load_batch(unsigned short (&dst)[kB], const unsigned short* lane_x, int64_t m,
                                           int64_t len) {
  const unsigned short* p = lane_x + m * kThreads;
  const int64_t have = len - m;
#pragma unroll
  for (int k = 0; k < kB; ++k) dst[k] = k < have ? __ldg(p + k * kThreads) : 0;
}

// One block = one aten warp of one row: blockIdx.x = row * warps_per_row + warp. Thread `lane` of warp `warp` is aten
// thread t = 32 * warp + lane (kThreads: aten's block, 32 or 512) and folds x[row][t + m * kThreads], m = 0, 1, ...,
// in order (WelfordOps::reduce); then the warp's shuffle tree; lane 0 writes (mean, m2, nf) to
// partial[row * warps_per_row + warp]. The loads run a batch ahead (kB per lane in flight while the previous batch
// folds). kProbe: the variant comes from the arguments (the GPU tests' probe), else kDefaultStatsVariant.
template <typename T, bool kProbe, int kThreads>
__global__ void __launch_bounds__(kWarp) group_norm_stats_kernel(GroupNormSiluArgs a) {
  constexpr int kB = kProbe ? kProbeBatch : kBatch;
  constexpr int kWarpsPerRow = kThreads / kWarp;
  const int variant = kProbe ? a.variant : kDefaultStatsVariant;
  const int64_t row = blockIdx.x / kWarpsPerRow;
  const int warp = static_cast<int>(blockIdx.x - row * kWarpsPerRow);
  const int lane = threadIdx.x;
  const int64_t n = a.row_size;
  const int64_t first = static_cast<int64_t>(kWarp) * warp + lane;  // aten's thread index
  const int64_t len = first < n ? (n - 1 - first) / kThreads + 1 : 0;  // the lane's chain length
  const int64_t warp_first = static_cast<int64_t>(kWarp) * warp;
  const int64_t warp_len = warp_first < n ? (n - 1 - warp_first) / kThreads + 1 : 0;  // lane 0's: the longest
  const unsigned short* lane_x = static_cast<const unsigned short*>(a.x) + row * n + first;

  Welford w{0.0f, 0.0f, 0.0f};
  unsigned short cur[kB], next[kB];
  load_batch<kThreads, kB>(cur, lane_x, 0, len);
  for (int64_t base = 0; base < warp_len; base += kB) {
    load_batch<kThreads, kB>(next, lane_x, base + kB, len);
    const int64_t valid = len - base;
    if (__all_sync(0xffffffffu, valid >= kB)) {  // every lane's batch is whole
      fold_batch<T, false, kB>(w, cur, base, valid, lane, variant);
    } else {
      fold_batch<T, true, kB>(w, cur, base, valid, lane, variant);
    }
#pragma unroll
    for (int k = 0; k < kB; ++k) cur[k] = next[k];
  }
  w.nf = __ll2float_rn(len);  // aten's nf is its count: the lane's chain length
  w = warp_reduce(w, variant);
  if (lane == 0) {
    float* out = a.partial + 3 * blockIdx.x;
    out[0] = w.mean;
    out[1] = w.m2;
    out[2] = w.nf;
  }
}

// ComputeFusedParamsCUDAKernel for channel c of a row with (mean, rstd): (scale, shift); the SiLU proof's identity
// affine (kIdentityAffine) instead: (1, -0).
template <typename T>
__device__ __forceinline__ float2 fused_params(const GroupNormSiluArgs& a, float2 stats, int64_t c) {
  if (a.variant & kIdentityAffine) return make_float2(1.0f, -0.0f);
  const float scale = __fmul_rn(stats.y, Storage<T>::load(static_cast<const T*>(a.gamma)[c]));
  const float beta_c = Storage<T>::load(static_cast<const T*>(a.beta)[c]);
  const float shift = (a.variant & kParamsFused) ? __fmaf_rn(-scale, stats.x, beta_c)
                                                 : __fadd_rn(__fmul_rn(-scale, stats.x), beta_c);
  return make_float2(scale, shift);
}

// The elementwise kernel's value of x (then the SiLU module's), rounded to T.
template <typename T, bool kSilu>
__device__ __forceinline__ T apply_value(float2 params, float xi, int variant) {
  float y = (variant & kApplyUnfused) ? __fadd_rn(__fmul_rn(params.x, xi), params.y)
                                      : __fmaf_rn(params.x, xi, params.y);
  if constexpr (kSilu) y = silu(round_to<T>(y));
  return Storage<T>::store(y);
}

// The statistics of row `row` (mean, rstd) from its aten warps' states in `partial`: BlockReduce's second level
// over the row's warps (or the one warp's state for rows of fewer than 512 elements), WelfordOps::project,
// rsqrtf, and torch 2.11's rounding to T. Run by one whole warp; lane 0's result is the row's.
template <typename T>
__device__ __forceinline__ float2 row_stats(const GroupNormSiluArgs& a, int64_t row, int lane) {
  const int warps_per_row = a.threads / kWarp;
  Welford w{0.0f, 0.0f, 0.0f};
  if (lane < warps_per_row) {
    const float* p = a.partial + 3 * (row * warps_per_row + lane);
    w = Welford{p[0], p[1], p[2]};
  }
  if (warps_per_row > 1) w = warp_reduce(w, a.variant);
  const float var = __fdiv_rn(w.m2, w.nf);  // WelfordOps::project with correction 0
  float mean = w.mean;
  float rstd = rsqrtf(__fadd_rn(var, a.eps));
  if (!(a.variant & kStatsInFloat)) {  // torch 2.11: RowwiseMomentsCUDAKernel's T* mean, T* rstd
    mean = round_to<T>(mean);
    rstd = round_to<T>(rstd);
  }
  return make_float2(mean, rstd);
}

// Rows in blockIdx.y; each block first finishes its row's statistics (BlockReduce's second level over the warps'
// states, or the one warp's state for rows of fewer than 512 elements), then normalises 16-byte vectors of the row
// with a grid stride over blockIdx.x. A vector lies in one channel (the guard: HxW a multiple of the vector), whose
// fused params it computes as ComputeFusedParamsCUDAKernel does.
template <typename T, bool kSilu>
__global__ void __launch_bounds__(kApplyThreads) group_norm_apply_kernel(GroupNormSiluArgs a) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int64_t row = blockIdx.y;
  __shared__ float2 stats;
  if (threadIdx.x < kWarp) {
    const float2 st = row_stats<T>(a, row, threadIdx.x);
    if (threadIdx.x == 0) stats = st;
  }
  __syncthreads();
  const int64_t group = row % a.groups;
  const int64_t per_group = a.channels / a.groups;
  const int64_t vecs = a.row_size / kVec;
  const P* x = reinterpret_cast<const P*>(static_cast<const T*>(a.x) + row * a.row_size);
  P* out = reinterpret_cast<P*>(static_cast<T*>(a.out) + row * a.row_size);
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs;
       v += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const float2 params = fused_params<T>(a, stats, group * per_group + (v * kVec) / a.hxw);
    const P xv = load_readonly(x + v);
    P o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) o.v[i] = apply_value<T, kSilu>(params, Storage<T>::load(xv.v[i]), a.variant);
    out[v] = o;
  }
}

// The apply kernel's output written channels-last (ops/group_norm_silu_conv.py: the input of the convolution after the
// norm, which cuDNN reads as it is instead of transposing it first): out [batch, hxw, channels] for x [batch, channels,
// hxw], each value the one group_norm_apply_kernel computes for it (the same device functions: fused_params,
// apply_value), moved to its place through a shared-memory tile of kClChannels x kClPositions (elementwise.cuh's
// transpose_tile_wide): each thread loads two 16-byte vectors of x (8 positions of one channel), writes their values
// into the tile as 4-byte words, then gathers 8 channels of one position from it and stores them as one 16-byte vector:
// 8 threads write a position's 64 channels, 128 contiguous bytes. Block kClThreads: channel tile blockIdx.y of sample
// blockIdx.z, the position tiles blockIdx.x, blockIdx.x + gridDim.x, ...; its warps first finish the statistics of the
// groups its channels span (row_stats, one warp per group). The guard: channels a multiple of 8, hxw a multiple of 8
// (whole vectors both ways).
constexpr int kClChannels = 64;
constexpr int kClPositions = 64;
constexpr int kClThreads = 256;
// the tile's row (one channel) in elements (transpose_tile_wide's): 33 words. The loads' 4-byte writes hit 32 banks;
// the stores' 16-bit reads (8 channels of a position) two ways (channels 8k and 8k + 32 share a bank)
constexpr int kClStride = kClPositions + 2;
constexpr int kClVecs = kClChannels * kClPositions / 8 / kClThreads;  // 16-byte vectors a thread loads (and stores)

template <typename T, bool kSilu>
__global__ void __launch_bounds__(kClThreads) group_norm_apply_cl_kernel(GroupNormSiluArgs a) {
  using P = Pack<T>;
  static_assert(P::kSize == 8, "16-bit storage");
  __shared__ __align__(16) unsigned short tile[kClChannels * kClStride];
  __shared__ float stats[2 * kClChannels];  // (mean, rstd) of the groups of the tile's channels, from group g0 on
  // (both through their shared-window addresses, elementwise.cuh's shared_address: a thread-indexed __shared__ access
  // compiles to other machine code under nvcc and NVRTC)
  const unsigned tile_base = shared_address(&tile[0]);
  const unsigned stats_base = shared_address(&stats[0]);
  const int tid = threadIdx.x;
  const int64_t n = blockIdx.z;
  const int64_t c0 = static_cast<int64_t>(blockIdx.y) * kClChannels;
  const int64_t per_group = a.channels / a.groups;
  const int64_t g0 = c0 / per_group;
  const int64_t c_last = (c0 + kClChannels < a.channels ? c0 + kClChannels : a.channels) - 1;
  const int groups_here = static_cast<int>(c_last / per_group - g0 + 1);  // at most kClChannels
  for (int g = tid / kWarp; g < groups_here; g += kClThreads / kWarp) {  // (warp-uniform: one warp per group)
    const float2 st = row_stats<T>(a, n * a.groups + g0 + g, tid % kWarp);
    if (tid % kWarp == 0) {
      shared_store(stats_base + 8u * g, st.x);
      shared_store(stats_base + 8u * g + 4u, st.y);
    }
  }
  __syncthreads();
  // the loads: vector v = tid + kClThreads * j is channel v / 8 of the tile, its positions 8 * (v % 8) .. + 7; the fused
  // params of those channels
  float2 params[kClVecs];
#pragma unroll
  for (int j = 0; j < kClVecs; ++j) {
    const int cl = (tid + kClThreads * j) / 8;
    const int64_t c = c0 + cl;
    float2 st = make_float2(0.0f, 0.0f);
    if (c < a.channels) {
      const unsigned at = stats_base + 8u * static_cast<unsigned>(c / per_group - g0);
      shared_load(at, st.x);
      shared_load(at + 4u, st.y);
    }
    params[j] = c < a.channels ? fused_params<T>(a, st, c) : make_float2(0.0f, 0.0f);
  }
  const T* x = static_cast<const T*>(a.x) + n * a.channels * a.hxw;
  T* out = static_cast<T*>(a.out) + n * a.channels * a.hxw;
  for (int64_t s0 = static_cast<int64_t>(blockIdx.x) * kClPositions; s0 < a.hxw;
       s0 += static_cast<int64_t>(gridDim.x) * kClPositions) {  // (bounds uniform over the block: __syncthreads is safe)
    transpose_tile_wide<T, kClChannels, kClPositions, kClThreads>(
        tile_base,
        [&](int, int cl, int sp) -> P {  // channel c0 + cl, positions s0 + sp .. + 7
          const int64_t c = c0 + cl, s = s0 + sp;
          return c < a.channels && s < a.hxw ? load_readonly(reinterpret_cast<const P*>(x + c * a.hxw + s)) : P{};
        },
        [&](int j, P xv) -> P {  // (zeros where there is no channel or position: never stored)
          P o;
#pragma unroll
          for (int i = 0; i < 8; ++i) o.v[i] = apply_value<T, kSilu>(params[j], Storage<T>::load(xv.v[i]), a.variant);
          return o;
        },
        [&](int, int sp, int cl, const P& o) {  // position s0 + sp, channels c0 + cl .. + 7
          const int64_t s = s0 + sp, c = c0 + cl;
          if (c < a.channels && s < a.hxw) store_pack(out + s * a.channels + c, o);
        });
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
// The channels-last apply kernel's grid: (position tiles per block's stride, channel tiles, batch), grid.x enough for
// about kClBlocksPerSm blocks per multiprocessor over the channel tiles and samples, no more than the position tiles
// (ops/group_norm_silu_conv.py's _cl_grid is its Python twin).
constexpr int kClBlocksPerSm = 16;
dim3 apply_cl_grid(const GroupNormSiluArgs& a, int sms) {
  const int64_t tiles = (a.hxw + kClPositions - 1) / kClPositions;
  const int64_t channel_tiles = (a.channels + kClChannels - 1) / kClChannels;
  int64_t x = (static_cast<int64_t>(sms) * kClBlocksPerSm + channel_tiles * a.batch - 1) / (channel_tiles * a.batch);
  if (x > tiles) x = tiles;
  if (x < 1) x = 1;
  return dim3(static_cast<unsigned>(x), static_cast<unsigned>(channel_tiles), static_cast<unsigned>(a.batch));
}

// The apply kernel's blocks per row: enough for kApplyBlocksPerSm resident blocks per multiprocessor over all rows,
// no more than the row's vectors need (ops/group_norm_silu.py's _apply_blocks_per_row is its Python twin).
int64_t apply_blocks_per_row(int64_t rows, int64_t vecs_per_row, int sms) {
  const int64_t needed = (vecs_per_row + kApplyThreads - 1) / kApplyThreads;
  int64_t per_row = (static_cast<int64_t>(sms) * kApplyBlocksPerSm + rows - 1) / rows;
  if (per_row > needed) per_row = needed;
  if (per_row < 1) per_row = 1;
  return per_row;
}

template <typename T>
cudaError_t launch(const GroupNormSiluArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.groups;
  if (rows == 0 || a.row_size == 0) return cudaSuccess;
  if ((a.threads != kWarp && a.threads != kAtenBlockThreads) || (a.variant & ~kVariantMask) != 0 ||
      a.hxw % kVec != 0 || rows > 65535 || rows * (a.threads / kWarp) > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const unsigned stats_blocks = static_cast<unsigned>(rows * (a.threads / kWarp));
  const bool probe = (a.variant & kStatsVariantMask) != 0;
  if (a.threads == kWarp) {
    if (probe) group_norm_stats_kernel<T, true, kWarp><<<stats_blocks, kWarp, 0, stream>>>(a);
    else group_norm_stats_kernel<T, false, kWarp><<<stats_blocks, kWarp, 0, stream>>>(a);
  } else {
    if (probe) group_norm_stats_kernel<T, true, kAtenBlockThreads><<<stats_blocks, kWarp, 0, stream>>>(a);
    else group_norm_stats_kernel<T, false, kAtenBlockThreads><<<stats_blocks, kWarp, 0, stream>>>(a);
  }
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  if (a.channels_last) {
    if (a.channels % 8 != 0 || a.channels > 65535 * kClChannels || a.batch > 65535) return cudaErrorInvalidValue;
    const dim3 grid = apply_cl_grid(a, num_sms());
    const dim3 block(kClThreads);
    if (a.silu) {
      group_norm_apply_cl_kernel<T, true><<<grid, block, 0, stream>>>(a);
    } else {
      group_norm_apply_cl_kernel<T, false><<<grid, block, 0, stream>>>(a);
    }
    return cudaGetLastError();
  }
  const dim3 grid(static_cast<unsigned>(apply_blocks_per_row(rows, a.row_size / kVec, num_sms())),
                  static_cast<unsigned>(rows));
  if (a.silu) {
    group_norm_apply_kernel<T, true><<<grid, kApplyThreads, 0, stream>>>(a);
  } else {
    group_norm_apply_kernel<T, false><<<grid, kApplyThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_group_norm_silu(const GroupNormSiluArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return launch<T>(args, stream);
  });
}
#endif

}  // namespace diffusers_fastpath
