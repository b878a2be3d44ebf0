// The elementwise tail of Wan's and Qwen-Image's VAE norm (diffusers' WanRMS_norm / QwenImageRMS_norm, channel
// first), optionally followed by SiLU (the residual blocks' `norm -> nonlinearity` pairs), in one pass, bit-identical
// to the eager kernels it replaces. Eager runs, for bf16/fp16 x (T) of [B, C, *]:
//   xf = x.float()                                  (exact; x itself for fp32)
//   d  = xf.norm(2, 1, keepdim=True).clamp_min(eps) (aten's reduction: kept, run by the Python op as eager runs it)
//   n  = round(xf / d)                              F.normalize's division (div_true: IEEE a / b), then .to(T)
//   m  = round(n * scale)                           mul by a python float: aten casts it to float (opmath)
//   g  = round(m * gamma[c])                        mul by the [C, 1, ...] parameter of dtype T
//   y  = round(g + bias)                            add of 0.0 (a python float) or of a [C, 1, ...] parameter
//   out = silu ? round(y / (1 + expf(-y))) : y      aten's silu_kernel (ActivationSiluKernel.cu), fp32 opmath
// Every division, product and sum here is a separate IEEE operation (__fdiv_rn, __fmul_rn, __fadd_rn; the build
// passes --fmad=false), each rounded to T where eager stores a tensor, so the norm's tail is exact by construction;
// the SiLU is the expression silu_mul.cu and group_norm_silu.cu use, proven on every value of the dtype by the Python
// op (the `probe` mode: y = x) before it is trusted. An fp32 x (an fp32 VAE, as Wan's model card loads it) is the same
// arithmetic with no rounding to T (eager's x.float() is x itself, every intermediate an fp32 tensor); its SiLU is
// proven on all 2^32 fp32 bit patterns the same way, in chunks.
//
// Layout: x and out contiguous [batch, channels, spatial]; denom contiguous [batch, spatial] fp32. Where spatial is a
// multiple of the 16-byte vector (a vector then stays in one channel), one thread per 16-byte vector; elsewhere (the
// Qwen-Image VAE's 166x166 latents at 1328x1328) one thread per element, the same arithmetic. A grid stride over all
// of them (eager: 5-6 kernels, each reading and writing the whole tensor; here one read of x and one write).
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

// one element's tail (elementwise.cuh's channel_rmsnorm_value): x the element, d its denominator, gamma and bias its
// channel's
template <typename T>
__device__ __forceinline__ float tail(float x, float d, float gamma, float bias, const ChannelRmsNormArgs& a) {
  return channel_rmsnorm_value<T>(x, d, gamma, bias, a.scale, a.silu);
}

// kVector: one 16-byte vector per step (spatial a multiple of its elements); else one element per step
template <typename T, bool kVector>
__global__ void __launch_bounds__(kThreads) channel_rmsnorm_kernel(ChannelRmsNormArgs a) {
  using P = Pack<T>;
  constexpr int kVec = kVector ? P::kSize : 1;
  const int64_t vecs = a.batch * a.channels * a.spatial / kVec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += step) {
    const int64_t e = v * kVec;
    const int64_t row = e / a.spatial;  // b * channels + c
    const int64_t s = e - row * a.spatial;
    const int64_t c = row % a.channels;
    const int64_t b = row / a.channels;
    if constexpr (kVector) {
      const P x = load_readonly(reinterpret_cast<const P*>(static_cast<const T*>(a.x) + e));
      P o;
      if (a.probe) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.v[i] = Storage<T>::store(silu(Storage<T>::load(x.v[i])));
      } else {
        const float* d = a.denom + b * a.spatial + s;
        const float gamma = Storage<T>::load(static_cast<const T*>(a.gamma)[c]);
        const float bias = a.bias ? Storage<T>::load(static_cast<const T*>(a.bias)[c]) : a.bias_value;
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.v[i] = Storage<T>::store(tail<T>(Storage<T>::load(x.v[i]), __ldg(d + i),
                                                                          gamma, bias, a));
      }
      *reinterpret_cast<P*>(static_cast<T*>(a.out) + e) = o;
    } else {
      const float x = Storage<T>::load(static_cast<const T*>(a.x)[e]);
      float y;
      if (a.probe) {
        y = silu(x);
      } else {
        const float gamma = Storage<T>::load(static_cast<const T*>(a.gamma)[c]);
        const float bias = a.bias ? Storage<T>::load(static_cast<const T*>(a.bias)[c]) : a.bias_value;
        y = tail<T>(x, __ldg(a.denom + b * a.spatial + s), gamma, bias, a);
      }
      static_cast<T*>(a.out)[e] = Storage<T>::store(y);
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
template <typename T>
cudaError_t launch(const ChannelRmsNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const bool vector = a.spatial % kVec == 0;
  const int64_t vecs = a.batch * a.channels * a.spatial / (vector ? kVec : 1);
  return launch_vector_or_element(channel_rmsnorm_kernel<T, true>, channel_rmsnorm_kernel<T, false>, vector, vecs,
                                  kThreads, kBlocksPerSm, a, stream);
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_channel_rmsnorm(const ChannelRmsNormArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
