// Fused adaLN modulate: out = x * (1 + scale[:, None]) + shift[:, None], bit-identical to eager PyTorch.
//
// Eager runs three kernels and rounds to the storage dtype after each:
//   t1  = round(1 + scale)          (add with a wrapped scalar, fp32 opmath)
//   t2  = round(x * t1)             (mul, fp32 opmath)
//   out = round(t2 + shift)         (add, fp32 opmath)
// This kernel keeps all three rounding points and uses __fadd_rn/__fmul_rn so that nvcc cannot contract the
// multiply and the add into an FMA (which would skip the rounding of t2 and change about a quarter of the outputs
// on random bf16 data).
//
// Layout: x and out are [batch, seq, dim] contiguous; scale and shift are [batch, dim] rows (any batch stride,
// including the `emb.chunk(6, dim=1)` views of diffusers' AdaLayerNormZero, or 0 to broadcast one row). Each
// thread owns one 16-byte column vector and walks rows with a grid stride, so any seq length works; it keeps
// round(1 + scale) and shift for its column in registers while consecutive rows stay in the same batch.
//
// Indexed rows (`index` not null; MiniMax-H3's `scale.index_select(0, rows)` rows, never materialised): row r of x
// (of batch * seq) reads row index[r] of the [table_rows, dim] scale and shift tables (row strides the batch
// strides); the pair is kept in registers while consecutive rows pick the same table row. An index outside
// [0, table_rows) traps (as eager's index_select device-asserts): nothing is read out of bounds. Values move,
// nothing is computed: the same three roundings on the same values.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsInFlight = 4;  // independent 16-byte loads issued per thread before the first use

template <typename T>
__global__ void __launch_bounds__(kThreads) modulate_scale_shift_kernel(
    T* __restrict__ out, const T* __restrict__ x, const T* __restrict__ scale, const T* __restrict__ shift,
    int64_t rows, int64_t seq, int32_t vecs_per_row, int64_t scale_batch_stride, int64_t shift_batch_stride,
    const int32_t* __restrict__ index, int64_t table_rows) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;

  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  int64_t batch_begin = 0, batch_end = 0;  // rows [batch_begin, batch_end) share the cached scale/shift
  int64_t cached_row = -1;                  // indexed rows: the table row whose scale/shift are cached
  float one_plus_scale[kVec];
  float shift_f[kVec];

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < rows;
       row0 += row_step * kRowsInFlight) {
    P xin[kRowsInFlight];
    int32_t picked[kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row < rows) {
        xin[r] = reinterpret_cast<const P*>(x)[row * vecs_per_row + col];
        if (index != nullptr) picked[r] = index[row];
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row >= rows) break;
      int64_t b = -1;  // the scale/shift row to load, or -1 where the cached one serves
      if (index != nullptr) {
        if (picked[r] < 0 || picked[r] >= table_rows) __trap();  // eager's index_select: index out of bounds
        if (picked[r] != cached_row) b = cached_row = picked[r];
      } else if (row < batch_begin || row >= batch_end) {
        b = row / seq;
        batch_begin = b * seq;
        batch_end = batch_begin + seq;
      }
      if (b >= 0) {
        const P s = reinterpret_cast<const P*>(scale + b * scale_batch_stride)[col];
        const P h = reinterpret_cast<const P*>(shift + b * shift_batch_stride)[col];
#pragma unroll
        for (int i = 0; i < kVec; ++i) {
          one_plus_scale[i] = round_to<T>(__fadd_rn(Storage<T>::load(s.v[i]), 1.0f));
          shift_f[i] = Storage<T>::load(h.v[i]);
        }
      }
      P o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float scaled = round_to<T>(__fmul_rn(Storage<T>::load(xin[r].v[i]), one_plus_scale[i]));
        o.v[i] = Storage<T>::store(__fadd_rn(scaled, shift_f[i]));
      }
      reinterpret_cast<P*>(out)[row * vecs_per_row + col] = o;
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch(const ModulateScaleShiftArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.seq;
  if (rows == 0 || a.dim == 0) return cudaSuccess;
  const int32_t vecs_per_row = static_cast<int32_t>(a.dim / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight);
  modulate_scale_shift_kernel<T><<<shape.grid, shape.block, 0, stream>>>(
      static_cast<T*>(a.out), static_cast<const T*>(a.x), static_cast<const T*>(a.scale),
      static_cast<const T*>(a.shift), rows, a.seq, vecs_per_row, a.scale_batch_stride, a.shift_batch_stride,
      a.index, a.table_rows);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_modulate_scale_shift(const ModulateScaleShiftArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
