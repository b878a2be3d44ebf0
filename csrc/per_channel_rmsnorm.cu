// LTX-2's VAE norm (diffusers' PerChannelRMSNorm: every norm1 / norm2 of LTX2VideoResnetBlock3d, the encoder's and
// the decoder's norm_out) after aten's mean, optionally followed by SiLU (the `norm -> nonlinearity` and
// `norm_out -> conv_act` pairs), in one pass, bit-identical to the eager kernels it replaces. Eager runs, for x (T:
// bf16, fp16 or fp32) of [B, C, *]:
//   m   = torch.mean(x**2, dim=1, keepdim=True)  (aten's square and reduction: kept, run by the Python op as eager)
//   a   = round(m + eps)                         add of the python eps: aten's CUDA add casts the double to float
//   r   = round(sqrt(a))                         torch.sqrt: IEEE sqrtf in fp32 opmath
//   y   = round(x / r)                           div_true of two tensors: IEEE a / b in fp32 opmath
//   out = silu ? round(y / (1 + expf(-y))) : y   the SiLU module after it, aten's silu_kernel
// Every add, square root and division here is a separate IEEE operation (__fadd_rn, __fsqrt_rn, __fdiv_rn; the build
// passes --fmad=false, and no product feeds an add: aten's add is `self + alpha * other` with alpha 1, whose
// contraction fma(1, eps, m) rounds once as the add does), each rounded to T where eager stores a tensor. The
// division and the roundings are exact by construction; the SiLU is elementwise.cuh's, proven on every value of the
// dtype by the Python op (probe mode 1); r is a function of the one value m, so the Python op proves it the same way
// (probe mode 2: r of every bf16/fp16 value, every fp32 bit pattern in chunks, against eager's `torch.sqrt(m + eps)`),
// which settles also how aten takes the python eps on this device (on a CPU aten rounds it to T first). For fp32 every
// `round` is the identity: the same IEEE operations with nothing rounded between them, as eager's fp32 tensors.
//
// Layout: out contiguous [batch, channels, spatial] (eager's result for the layouts the Python guard admits); x
// [batch, channels, spatial] with each channel's spatial elements contiguous (channels and batches possibly apart: an
// upsampler's output with its first frames sliced off); mean contiguous [batch, spatial] of T. Each thread takes
// kChannels channels of one vector of positions (16 bytes where spatial, both strides and the pointers are multiples
// of it, else one element), computes r once for those positions and divides each channel's elements by it; a grid
// stride over all such items. Eager: the add, the sqrt (1/C of x each), the division and the SiLU (each reading and
// writing the whole tensor); here x and mean are read once and out written once.
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

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
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
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_per_channel_rmsnorm(const PerChannelRmsNormArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
