// SwiGLU's elementwise half, `F.silu(gate) * up` (FLUX.2's Flux2SwiGLU on the two halves of one projection, Z-Image's
// feed-forward on two), in one pass, bit-identical to the two eager kernels:
//   s   = round(silu(gate))      aten's silu_kernel (aten/src/ATen/native/cuda/ActivationSiluKernel.cu) in fp32
//                                opmath: x / (1 + c10::cuda::compat::exp(-x)), i.e. expf, an IEEE add and division
//   out = round(s * up)          the mul kernel, fp32 opmath
// and, as sigmoid_mul_kernel, a sigmoid output gate, `x * torch.sigmoid(gate)` (Krea 2's attention processor), the
// same pass with the other activation:
//   s   = round(sigmoid(gate))   aten's sigmoid_kernel_cuda (aten/src/ATen/native/cuda/UnarySpecialOpsKernel.cu) in
//                                fp32 opmath: 1 / (1 + std::exp(-x)), i.e. expf, an IEEE add and division
//   out = round(s * x)           the mul kernel (x * s in eager: a product of two numbers commutes exactly)
// expf is CUDA's libdevice function under both builds; whether the rest matches aten's build (which nvcc compiled
// with --fmad=true: no product feeds an add here) is checked the way gelu_cat is: the result is a function of one
// 16-bit value, so the Python op proves it on all 65536 bf16 or fp16 bit patterns once per dtype (ops/silu_mul.py,
// ops/sigmoid_mul.py) and falls back for good where it differs. The multiply is exact by construction (__fmul_rn,
// one rounding).
//
// Layout: gate and up are [batch, seq, dim] rows with unit innermost stride and 16-byte aligned row starts (the two
// `chunk(2, dim=-1)` halves of a contiguous projection qualify, as do two contiguous tensors); out rows likewise
// (a contiguous out, or swiglu_cat's: the SwiGLU columns of the [batch, seq, attn_dim + dim] concatenation).
// Each thread moves one 16-byte vector of a row; threads walk rows with a grid stride. The two kernels share one
// body (`gate_mul_rows`, inlined), the activation a template argument: silu_mul_kernel's machine code is the one it
// had before sigmoid_mul_kernel shared it (its name and symbol too).
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

// gelu_cat's launch shape (an activation with an exp or tanh needs more warps in flight than a copy)
constexpr int kThreads = 512;
constexpr int kRowsInFlight = 1;
constexpr int kBlocksPerSm = 16;

enum class GateAct { kSilu, kSigmoid };

template <typename T, GateAct kAct>
__device__ __forceinline__ void gate_mul_rows(const SiluMulArgs& a, int32_t vecs_per_row) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;
  const int64_t rows = a.batch * a.seq;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const T* gate = static_cast<const T*>(a.gate) + static_cast<int64_t>(col) * kVec;
  const T* up = static_cast<const T*>(a.up) + static_cast<int64_t>(col) * kVec;
  T* out = static_cast<T*>(a.out) + static_cast<int64_t>(col) * kVec;
  for (int64_t row = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row < rows; row += row_step) {
    const int64_t b = row / a.seq;
    const int64_t s = row - b * a.seq;
    const P g = *reinterpret_cast<const P*>(gate + b * a.gate_stride_b + s * a.gate_stride_s);
    const P u = *reinterpret_cast<const P*>(up + b * a.up_stride_b + s * a.up_stride_s);
    P o;
#pragma unroll
    for (int i = 0; i < kVec; ++i) {
      const float x = Storage<T>::load(g.v[i]);
      const float act = round_to<T>(kAct == GateAct::kSigmoid ? sigmoid(x) : silu(x));
      o.v[i] = Storage<T>::store(__fmul_rn(act, Storage<T>::load(u.v[i])));
    }
    store_pack(out + b * a.out_stride_b + s * a.out_stride_s, o);
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) silu_mul_kernel(SiluMulArgs a, int32_t vecs_per_row) {
  gate_mul_rows<T, GateAct::kSilu>(a, vecs_per_row);
}

// `gate` holds the sigmoid's input, `up` the other factor (the attention output x)
template <typename T>
__global__ void __launch_bounds__(kThreads) sigmoid_mul_kernel(SiluMulArgs a, int32_t vecs_per_row) {
  gate_mul_rows<T, GateAct::kSigmoid>(a, vecs_per_row);
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T, GateAct kAct>
cudaError_t launch(const SiluMulArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.seq;
  if (rows == 0 || a.dim == 0) return cudaSuccess;
  if (a.dim % kVec || a.dim / kVec > 0x7fffffff) return cudaErrorInvalidValue;
  const int32_t vecs_per_row = static_cast<int32_t>(a.dim / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight, kBlocksPerSm);
  if constexpr (kAct == GateAct::kSigmoid) {
    sigmoid_mul_kernel<T><<<shape.grid, shape.block, 0, stream>>>(a, vecs_per_row);
  } else {
    silu_mul_kernel<T><<<shape.grid, shape.block, 0, stream>>>(a, vecs_per_row);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_silu_mul(const SiluMulArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype,
                               [&](auto tag) { return launch<decltype(tag), GateAct::kSilu>(args, stream); });
}

cudaError_t launch_sigmoid_mul(const SiluMulArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype,
                               [&](auto tag) { return launch<decltype(tag), GateAct::kSigmoid>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
