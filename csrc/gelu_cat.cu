// FLUX.1's single-block concatenation of the attention output and the tanh-GELU of the MLP's up-projection, in one
// pass, bit-identical to eager `torch.cat([attn, F.gelu(mlp, approximate="tanh")], dim=2)`:
//   out[b, s, :Da]  = attn[b, s, :]                      (a copy)
//   out[b, s, Da:]  = round(gelu_tanh(mlp[b, s, :]))      (one rounding, as aten's GELU kernel)
// Eager writes the GELU to a tensor and `cat` copies both halves again: 2 reads and 2 writes of the MLP half against
// 1 and 1 here.
//
// aten's GeluCUDAKernelImpl (aten/src/ATen/native/cuda/ActivationGeluKernel.cu), approximate="tanh", computes in
// fp32 opmath from the fp16/bf16 input:
//   x_cube = x * x * x;  inner = kBeta * (x + kKappa * x_cube);  y = 0.5 * x * (1 + tanhf(inner))
// with kBeta = float(M_SQRT2 * M_2_SQRTPI * 0.5) and kKappa = float(0.044715). aten is built with nvcc's default
// --fmad=true, which contracts `x + kKappa * x_cube` into one FMA and nothing else (no other product feeds an add);
// this file is built with --fmad=false and spells that FMA out with __fmaf_rn. tanhf is CUDA's libdevice function
// in both. The H200 probe at torch 2.11.0+cu130 / nvcc 13.0 found this expression, the unfused one and the
// plain source compiled either way all equal to aten on every one of the 65536 bf16 and fp16 bit patterns: the
// result is a function of one 16-bit input, so the Python op proves it once per dtype on all of them
// (ops/gelu_cat.py) and falls back for good if another platform's aten or tanhf differs.
//
// Layout: out is [batch, seq, Da + Dm] contiguous; attn and mlp are [batch, seq, D*] rows with unit innermost
// stride and 16-byte aligned row starts (SDPA's output after `flatten(2, 3)` and a GEMM's output qualify). Each
// thread moves one 16-byte vector of an output row, which lies entirely in one half because Da is a multiple of
// the vector; threads walk rows with a grid stride.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

// The launch shape measured fastest on an H200 at FLUX.1-dev's 4608 x (3072 + 12288) among 1, 2 or 4 rows in flight,
// 256 or 512 threads and 4, 8 or 16 blocks per SM: 95.7 us against 109.5 us for the row kernels' shape (2 rows,
// 256 threads, 8 blocks per SM) and 87.3 us for a copy of the same bytes. The GELU's arithmetic makes this kernel
// need more warps in flight than a pure copy.
constexpr int kThreads = 512;
constexpr int kRowsInFlight = 1;
constexpr int kBlocksPerSm = 16;

// aten's constants, evaluated as it does: the double product M_SQRT2 * M_2_SQRTPI * 0.5f, then converted to float.
constexpr float kBeta = 1.41421356237309504880 * 1.12837916709551257390 * float(0.5);
constexpr float kKappa = 0.044715;

__device__ __forceinline__ float gelu_tanh(float x) {
  const float x_cube = __fmul_rn(__fmul_rn(x, x), x);
  const float inner = __fmul_rn(kBeta, __fmaf_rn(kKappa, x_cube, x));
  return __fmul_rn(__fmul_rn(0.5f, x), __fadd_rn(1.0f, tanhf(inner)));
}

// kFlat: both sources' rows are evenly spaced across the batch too (stride_b == seq * stride_s, as for any
// contiguous or column-sliced tensor), so row r starts at r * stride_s and no division by seq is needed.
template <typename T, bool kFlat>
__global__ void __launch_bounds__(kThreads) gelu_cat_kernel(GeluCatArgs a, int32_t attn_vecs, int32_t vecs_per_row) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;
  const bool is_attn = col < attn_vecs;
  const int64_t rows = a.batch * a.seq;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const T* src = static_cast<const T*>(is_attn ? a.attn : a.mlp) + static_cast<int64_t>(is_attn ? col : col - attn_vecs) * kVec;
  const int64_t stride_b = is_attn ? a.attn_stride_b : a.mlp_stride_b;
  const int64_t stride_s = is_attn ? a.attn_stride_s : a.mlp_stride_s;
  P* out = reinterpret_cast<P*>(a.out) + col;

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < rows;
       row0 += row_step * kRowsInFlight) {
    P v[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row < rows) {
        int64_t offset = row * stride_s;
        if constexpr (!kFlat) {
          const int64_t b = row / a.seq;
          offset = b * stride_b + (row - b * a.seq) * stride_s;
        }
        v[r] = *reinterpret_cast<const P*>(src + offset);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row >= rows) break;
      P o = v[r];
      if (!is_attn) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) o.v[i] = Storage<T>::store(gelu_tanh(Storage<T>::load(v[r].v[i])));
      }
      out[row * vecs_per_row] = o;
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch(const GeluCatArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.seq;
  if (rows == 0 || a.attn_dim + a.mlp_dim == 0) return cudaSuccess;
  if (a.attn_dim % kVec || a.mlp_dim % kVec || (a.attn_dim + a.mlp_dim) / kVec > 0x7fffffff) return cudaErrorInvalidValue;
  const int32_t attn_vecs = static_cast<int32_t>(a.attn_dim / kVec);
  const int32_t vecs_per_row = static_cast<int32_t>((a.attn_dim + a.mlp_dim) / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight, kBlocksPerSm);
  const bool flat =
      a.batch == 1 || (a.attn_stride_b == a.seq * a.attn_stride_s && a.mlp_stride_b == a.seq * a.mlp_stride_s);
  if (flat) {
    gelu_cat_kernel<T, true><<<shape.grid, shape.block, 0, stream>>>(a, attn_vecs, vecs_per_row);
  } else {
    gelu_cat_kernel<T, false><<<shape.grid, shape.block, 0, stream>>>(a, attn_vecs, vecs_per_row);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_gelu_cat(const GeluCatArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
