// LTX-2's and LTX-Video's VAE norms written as the padded channels-last input of the causal convolution that reads
// them: per_channel_rmsnorm_pad_cl_kernel (the fused kernel's statistics and norm, per_channel_rmsnorm.cuh's, stored at
// every padded position; with kLtx LTX-Video's norm), ltx_rsqrt_probe_kernel (LTX-Video's reciprocal alone, for its
// proof) and per_channel_rmsnorm_cl_pad_cl_kernel (the same from a channels-last convolution output plus its bias).
#include "per_channel_rmsnorm.cuh"

namespace diffusers_fastpath {
namespace {

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
          store_words(dst + static_cast<int64_t>(index) * a.channels, v);
        } else {
          for_each_copy(g, t.b, t.s0 + p, [&](int64_t i) { store_words(dst + i * a.channels, v); });
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
        store_pack(dst + static_cast<int64_t>(index) * a.channels, o);
      } else {
        for_each_copy(g, b, s0 + p[k], [&](int64_t i) { store_pack(dst + i * a.channels, o); });
      }
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launchers; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
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
#endif

}  // namespace diffusers_fastpath
