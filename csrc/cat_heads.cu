// torch.cat([a, b], dim=2) of two [batch, heads, seq, dim] operands into a contiguous [batch, heads, seq_a + seq_b,
// dim] tensor, bit-identical by construction (every element is moved, none is computed). SD3's JointAttnProcessor2_0
// concatenates its image and text q, k and v this way; each operand is a [B, H, S, D] view of a [B, S, H, D]
// projection (or the QK norm's output in that layout), whose rows aten's CatArrayBatchedCopy then reads element by
// element (non-contiguous inputs are not vectorised): 64 us per call at SD3.5-large's 1024x1024 shapes on the H200,
// a third of copy bandwidth. Here each thread moves one 16-byte vector of an output row; threads walk the rows
// (b, h, s) of the output in order with a grid stride, so the writes are contiguous and each read is a whole
// 16-byte vector of a source row.
//
// Layout: a and b have unit innermost stride and 16-byte aligned rows (dim and the strides multiples of the vector);
// out is contiguous.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

// a copy: gated_residual.cu's shape (256 threads, four rows' loads in flight per thread, 8 blocks per SM)
constexpr int kThreads = 256;
constexpr int kRowsInFlight = 4;
constexpr int kBlocksPerSm = 8;

template <typename T>
__global__ void __launch_bounds__(kThreads) cat_heads_kernel(CatHeadsArgs a, int32_t vecs_per_row) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;
  const int64_t seq = a.seq_a + a.seq_b;
  const int64_t rows = a.batch * a.heads * seq;
  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  const T* src_a = static_cast<const T*>(a.a) + static_cast<int64_t>(col) * kVec;
  const T* src_b = static_cast<const T*>(a.b) + static_cast<int64_t>(col) * kVec;
  P* out = reinterpret_cast<P*>(a.out) + col;

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < rows;
       row0 += row_step * kRowsInFlight) {
    P v[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row < rows) {
        const int64_t bh = row / seq;
        const int64_t s = row - bh * seq;
        const int64_t b = bh / a.heads;
        const int64_t h = bh - b * a.heads;
        const T* src = s < a.seq_a ? src_a + b * a.a_stride_b + h * a.a_stride_h + s * a.a_stride_s
                                   : src_b + b * a.b_stride_b + h * a.b_stride_h + (s - a.seq_a) * a.b_stride_s;
        v[r] = *reinterpret_cast<const P*>(src);
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row >= rows) break;
      out[row * vecs_per_row] = v[r];
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
template <typename T>
cudaError_t launch(const CatHeadsArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.heads * (a.seq_a + a.seq_b);
  if (rows == 0 || a.dim == 0) return cudaSuccess;
  if (a.dim % kVec || a.dim / kVec > 0x7fffffff) return cudaErrorInvalidValue;
  const int32_t vecs_per_row = static_cast<int32_t>(a.dim / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight, kBlocksPerSm);
  cat_heads_kernel<T><<<shape.grid, shape.block, 0, stream>>>(a, vecs_per_row);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_cat_heads(const CatHeadsArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
