// LTX-2's VAE norm (diffusers' PerChannelRMSNorm) and the SiLU after it: per_channel_rmsnorm_kernel (the mean from
// aten) and per_channel_rmsnorm_fused_kernel (the mean in aten's order, here). The arithmetic, the order of the mean
// and the statistics' code are per_channel_rmsnorm.cuh's (its comment); the kernels that write the norm as the padded
// input of the causal convolution after it are per_channel_rmsnorm_pad.cu's.
#include "per_channel_rmsnorm.cuh"

namespace diffusers_fastpath {
namespace {

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
        store_lanes<T, kVector>(out + k * a.spatial, o);
      }
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
        store_lanes<T, kVector>(out + c * a.spatial, o);
      }
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launchers; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch(const PerChannelRmsNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const bool vector = a.spatial % kVec == 0 && a.x_channel_stride % kVec == 0 && a.x_batch_stride % kVec == 0 &&
                      aligned(a.x) && aligned(a.out) && (a.probe || aligned(a.mean));
  const int64_t items = a.batch * ((a.channels + kChannels - 1) / kChannels) * (a.spatial / (vector ? kVec : 1));
  return launch_vector_or_element(per_channel_rmsnorm_kernel<T, true>, per_channel_rmsnorm_kernel<T, false>, vector,
                                  items, kThreads, kBlocksPerSm, a, stream);
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
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
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
