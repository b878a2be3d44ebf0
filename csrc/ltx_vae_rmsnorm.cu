// The elementwise tail of LTX-Video's VAE norm (diffusers' RMSNorm without weight, called on the channel-last view
// `x.movedim(1, -1)` of a channel-first [B, C, T, H, W] tensor: every norm1 / norm2 of LTXVideoResnetBlock3d and
// the encoder's and decoder's norm_out), optionally followed by the SiLU after it (the resnets' `nonlinearity`, the
// `conv_act` after norm_out: the pairs), in one pass, bit-identical to the eager kernels it replaces. Eager runs, for
// bf16/fp16 x (T):
//   v   = x.to(float32).pow(2).mean(-1, keepdim=True)  (aten's reduction: kept, run by the Python op as eager runs it)
//   r   = torch.rsqrt(v + eps)                         (aten, kept: [B, T, H, W, 1], 1/C of x)
//   y   = round(float(x) * r)                          the mixed-dtype multiply (fp32 result), then .to(T)
//   out = silu ? round(y / (1 + expf(-y))) : y         the nn.SiLU after it (the moved-back view), aten's silu_kernel
// The multiply is one IEEE product (__fmul_rn; the build passes --fmad=false) rounded to T where eager's .to(T)
// rounds, so the norm is exact by construction (elementwise.cuh's ltx_rmsnorm_value, which causal_pad.cu's
// ltx_rmsnorm_pad_cl_kernel shares: the norm written as the next causal convolution's padded input). The SiLU is
// elementwise.cuh's, a function of the one T value y: the Python op proves it on every value of the dtype on the
// device (the `probe` mode: round(silu(x)) of x alone) before it trusts the pair. The `square` mode writes
// x.to(float32).pow(2) (fp32, x's layout) for aten's mean in one pass instead of eager's two (the copy, then the
// square: aten's pow by 2 is x * x, and the square of a bf16 or fp16 value is exact in fp32, so every way of
// computing it gives the same bits). Eager writes the fp32 product and reads it back
// (4 + 4 bytes per element) on top of reading x and writing out, and for the pair writes y and reads it back again
// (2 + 2); here x is read once and out written once.
//
// Layout: out contiguous [batch, channels, spatial] (eager's result: the channel-first memory of the channel-last
// view); x [batch, channels, spatial] with each channel's spatial elements contiguous, channels `x_channel_stride`
// and batches `x_batch_stride` elements apart (an upsampler's output with its first frames sliced off), all three
// multiples of the 16-byte vector, so a vector stays in one channel; r contiguous [batch, spatial] fp32.
// One thread per 16-byte vector, a grid stride over all vectors.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kBlocksPerSm = 8;

template <typename T>
__global__ void __launch_bounds__(kThreads) ltx_rmsnorm_kernel(LtxRmsNormArgs a) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int64_t vecs = a.batch * a.channels * a.spatial / kVec;
  const int64_t step = static_cast<int64_t>(gridDim.x) * blockDim.x;
  for (int64_t v = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; v < vecs; v += step) {
    const int64_t e = v * kVec;
    const int64_t row = e / a.spatial;  // b * channels + c
    const int64_t s = e - row * a.spatial;
    const int64_t b = row / a.channels;
    const int64_t c = row - b * a.channels;
    const T* src = static_cast<const T*>(a.x) + b * a.x_batch_stride + c * a.x_channel_stride + s;
    const P x = load_readonly(reinterpret_cast<const P*>(src));
    if (a.square) {
      float* dst = static_cast<float*>(a.out) + e;  // (a fresh fp32 tensor: 16-byte aligned at each vector's)
      Pack<float> q[kVec / 4];
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float f = Storage<T>::load(x.v[i]);
        q[i / 4].v[i % 4] = __fmul_rn(f, f);
      }
#pragma unroll
      for (int i = 0; i < kVec / 4; ++i) store_pack(dst + 4 * i, q[i]);
      continue;
    }
    P o;
    if (a.probe) {
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.v[i] = Storage<T>::store(silu(Storage<T>::load(x.v[i])));
    } else {
      const float* r = a.rsqrt + b * a.spatial + s;
#pragma unroll
      for (int i = 0; i < kVec; ++i) o.v[i] = ltx_rmsnorm_value<T>(x.v[i], __ldg(r + i), a.silu != 0);
    }
    store_pack(static_cast<T*>(a.out) + e, o);
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
template <typename T>
cudaError_t launch(const LtxRmsNormArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  if (a.spatial % kVec || a.x_channel_stride % kVec || a.x_batch_stride % kVec) return cudaErrorInvalidValue;
  const int64_t vecs = a.batch * a.channels * a.spatial / kVec;
  if (vecs == 0) return cudaSuccess;
  const int64_t blocks = grid_stride_blocks(vecs, kThreads, kBlocksPerSm);
  ltx_rmsnorm_kernel<T><<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_ltx_rmsnorm(const LtxRmsNormArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
