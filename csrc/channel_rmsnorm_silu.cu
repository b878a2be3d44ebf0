// The elementwise tail of Wan's and Qwen-Image's VAE norm (diffusers' WanRMS_norm / QwenImageRMS_norm, channel
// first), optionally followed by SiLU (the residual blocks' `norm -> nonlinearity` pairs), in one pass, bit-identical
// to the eager kernels it replaces. Eager runs, for bf16/fp16 x (T) of [B, C, *]:
//   xf = x.float()                                  (exact)
//   d  = xf.norm(2, 1, keepdim=True).clamp_min(eps) (aten's reduction: kept, run by the Python op as eager runs it)
//   n  = round(xf / d)                              F.normalize's division (div_true: IEEE a / b), then .to(T)
//   m  = round(n * scale)                           mul by a python float: aten casts it to float (opmath)
//   g  = round(m * gamma[c])                        mul by the [C, 1, ...] parameter of dtype T
//   y  = round(g + bias)                            add of 0.0 (a python float) or of a [C, 1, ...] parameter
//   out = silu ? round(y / (1 + expf(-y))) : y      aten's silu_kernel (ActivationSiluKernel.cu), fp32 opmath
// Every division, product and sum here is a separate IEEE operation (__fdiv_rn, __fmul_rn, __fadd_rn; the build
// passes --fmad=false), each rounded to T where eager stores a tensor, so the norm's tail is exact by construction;
// the SiLU is the expression silu_mul.cu and group_norm_silu.cu use, proven on every value of the dtype by the Python
// op (the `probe` mode: y = x) before it is trusted.
//
// Layout: x and out contiguous [batch, channels, spatial] with spatial a multiple of the 16-byte vector (so a vector
// stays in one channel); denom contiguous [batch, spatial] fp32. One thread per 16-byte vector, a grid stride over
// all vectors (eager: 5-6 kernels, each reading and writing the whole tensor; here one read of x and one write).
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

template <typename T>
__global__ void __launch_bounds__(kThreads) channel_rmsnorm_kernel(ChannelRmsNormArgs a) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int64_t vecs = a.batch * a.channels * a.spatial / kVec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += step) {
    const int64_t e = v * kVec;
    const int64_t row = e / a.spatial;  // b * channels + c
    const int64_t s = e - row * a.spatial;
    const int64_t c = row % a.channels;
    const int64_t b = row / a.channels;
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
      for (int i = 0; i < kVec; ++i) {
        const float n = round_to<T>(__fdiv_rn(Storage<T>::load(x.v[i]), __ldg(d + i)));
        const float m = round_to<T>(__fmul_rn(n, a.scale));
        const float g = round_to<T>(__fmul_rn(m, gamma));
        const float y = __fadd_rn(g, bias);
        o.v[i] = Storage<T>::store(a.silu ? silu(round_to<T>(y)) : y);
      }
    }
    *reinterpret_cast<P*>(static_cast<T*>(a.out) + e) = o;
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
template <typename T>
cudaError_t launch(const ChannelRmsNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  if (a.spatial % kVec) return cudaErrorInvalidValue;
  const int64_t vecs = a.batch * a.channels * a.spatial / kVec;
  if (vecs == 0) return cudaSuccess;
  const int64_t blocks = grid_stride_blocks(vecs, kThreads, kBlocksPerSm);
  channel_rmsnorm_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_channel_rmsnorm(const ChannelRmsNormArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
