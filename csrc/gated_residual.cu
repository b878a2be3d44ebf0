// Fused gated residual add: out = residual + gate * update, bit-identical to eager PyTorch.
//
// Eager (every FLUX block: `attn_output = gate_msa.unsqueeze(1) * attn_output; hidden_states = hidden_states +
// attn_output`) runs two kernels and rounds to the storage dtype after each:
//   t   = round(gate * update)         (mul, fp32 opmath)
//   out = round(residual + t)          (add, fp32 opmath)
// This kernel keeps both rounding points and uses __fmul_rn/__fadd_rn so that nvcc cannot contract the multiply
// and the add into an FMA (which would skip the rounding of t).
//
// Layout: residual, update and out are [batch, seq, dim] contiguous. The gate row of (b, s) starts at
// gate + b * gate_batch_stride + s * gate_seq_stride (unit innermost stride): gate_seq_stride == 0 is diffusers'
// `gate.unsqueeze(1)` of an adaLN chunk (one row per batch, any batch stride, 0 to broadcast one row), anything
// else a full [batch, seq, dim] gate. Each thread owns one 16-byte column vector and walks rows with a grid stride
// (any seq length); a row gate is kept in registers while consecutive rows stay in the same batch.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsInFlight = 4;  // independent 16-byte loads per operand issued per thread before the first use

template <typename T, bool kRowGate>
__global__ void __launch_bounds__(kThreads) gated_residual_kernel(
    T* __restrict__ out, const T* __restrict__ residual, const T* __restrict__ gate, const T* __restrict__ update,
    int64_t rows, int64_t seq, int32_t vecs_per_row, int64_t gate_batch_stride, int64_t gate_seq_stride) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;

  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  int64_t batch_begin = 0, batch_end = 0;  // row gate: rows [batch_begin, batch_end) share the cached gate
  float gate_row[kVec];

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < rows;
       row0 += row_step * kRowsInFlight) {
    P res[kRowsInFlight], upd[kRowsInFlight], gat[kRowGate ? 1 : kRowsInFlight];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row < rows) {
        res[r] = reinterpret_cast<const P*>(residual)[row * vecs_per_row + col];
        upd[r] = reinterpret_cast<const P*>(update)[row * vecs_per_row + col];
        if constexpr (!kRowGate) {
          const int64_t b = row / seq;
          const T* g = gate + b * gate_batch_stride + (row - b * seq) * gate_seq_stride;
          gat[r] = reinterpret_cast<const P*>(g)[col];
        }
      }
    }
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row >= rows) break;
      float g[kVec];
      if constexpr (kRowGate) {
        if (row < batch_begin || row >= batch_end) {
          const int64_t b = row / seq;
          batch_begin = b * seq;
          batch_end = batch_begin + seq;
          const P gp = reinterpret_cast<const P*>(gate + b * gate_batch_stride)[col];
#pragma unroll
          for (int i = 0; i < kVec; ++i) gate_row[i] = Storage<T>::load(gp.v[i]);
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[i] = gate_row[i];
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[i] = Storage<T>::load(gat[r].v[i]);
      }
      P o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        const float gated = round_to<T>(__fmul_rn(g[i], Storage<T>::load(upd[r].v[i])));
        o.v[i] = Storage<T>::store(__fadd_rn(Storage<T>::load(res[r].v[i]), gated));
      }
      reinterpret_cast<P*>(out)[row * vecs_per_row + col] = o;
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch(const GatedResidualArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.seq;
  if (rows == 0 || a.dim == 0) return cudaSuccess;
  const int32_t vecs_per_row = static_cast<int32_t>(a.dim / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight);
  auto* out = static_cast<T*>(a.out);
  const auto* residual = static_cast<const T*>(a.residual);
  const auto* gate = static_cast<const T*>(a.gate);
  const auto* update = static_cast<const T*>(a.update);
  if (a.gate_seq_stride == 0) {
    gated_residual_kernel<T, true><<<shape.grid, shape.block, 0, stream>>>(
        out, residual, gate, update, rows, a.seq, vecs_per_row, a.gate_batch_stride, 0);
  } else {
    gated_residual_kernel<T, false><<<shape.grid, shape.block, 0, stream>>>(
        out, residual, gate, update, rows, a.seq, vecs_per_row, a.gate_batch_stride, a.gate_seq_stride);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_gated_residual(const GatedResidualArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
