// Fused gated residual add: out = residual + gate * update, bit-identical to eager PyTorch.
//
// Eager (every FLUX block: `attn_output = gate_msa.unsqueeze(1) * attn_output; hidden_states = hidden_states +
// attn_output`) runs two kernels and rounds to the storage dtype after each:
//   t   = round(gate * update)         (mul, fp32 opmath)
//   out = round(residual + t)          (add, fp32 opmath)
// This kernel keeps both rounding points and uses __fmul_rn/__fadd_rn so that nvcc cannot contract the multiply
// and the add into an FMA (which would skip the rounding of t).
//
// With an fp32 gate (Wan's blocks: `(hidden_states.float() + attn_output * gate_msa).type_as(hidden_states)`, the gate
// an fp32 adaLN chunk) the product and the sum are fp32 results, rounded to T once at the end:
//   out = round(float(residual) + float(update) * gate)      (mul and add each rounded to fp32)
//
// Layout: residual, update and out are [batch, seq, dim] contiguous. The gate row of (b, s) starts at
// gate + b * gate_batch_stride + s * gate_seq_stride (unit innermost stride): gate_seq_stride == 0 is diffusers'
// `gate.unsqueeze(1)` of an adaLN chunk (one row per batch, any batch stride, 0 to broadcast one row), anything
// else a full [batch, seq, dim] gate. Each thread owns one 16-byte column vector and walks rows with a grid stride
// (any seq length); a row gate is kept in registers while consecutive rows stay in the same batch.
//
// Indexed rows (`index` not null; Qwen-Image 2.1's `torch.where(mask, params[:-1], params[-1:])` rows, never
// materialised): the gate row of (b, s) is row index[b * seq + s] of a [R, dim] table, at gate + that *
// gate_seq_stride (R = table_rows). An index outside [0, R) traps, as eager's index_select device-asserts (MiniMax-H3's
// `gate.index_select(0, rows)` rows, the caller's indices): nothing is read out of bounds. Values move, nothing is
// computed: the same gate, the same product and sum. kTanhGate (the table the gate's rows before their `.tanh()`,
// Qwen-Image 2.1's `gate.tanh()` of where-picked rows): each loaded gate value goes through aten's tanh in fp32,
// rounded to T (elementwise.cuh's tanh_of, proven on every value of T by the Python op before it asks for this
// kernel), then the same product and sum: eager's tanh kernel, its where and its two kernels, in one pass.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kRowsInFlight = 4;  // independent 16-byte loads per operand issued per thread before the first use

// The kVec gate values of column vector `col` of one gate row, as floats: one 16-byte load of T, or kVec / 4 of fp32.
template <typename T, typename G>
__device__ __forceinline__ void load_gate(const G* row, int32_t col, float (&g)[Pack<T>::kSize]) {
  constexpr int kVec = Pack<T>::kSize;
  if constexpr (SameType<G, float>::value) {
    const float4* f = reinterpret_cast<const float4*>(row) + static_cast<int64_t>(col) * (kVec / 4);
#pragma unroll
    for (int j = 0; j < kVec / 4; ++j) {
      const float4 v = f[j];
      g[4 * j] = v.x;
      g[4 * j + 1] = v.y;
      g[4 * j + 2] = v.z;
      g[4 * j + 3] = v.w;
    }
  } else {
    const Pack<T> gp = reinterpret_cast<const Pack<T>*>(row)[col];
#pragma unroll
    for (int i = 0; i < kVec; ++i) g[i] = Storage<T>::load(gp.v[i]);
  }
}

// G: the gate's type, T (FLUX's chain) or float (Wan's). kTanhGate: the gate rows' tanh taken here (indexed rows of T).
template <typename T, typename G, bool kRowGate, bool kTanhGate = false>
__global__ void __launch_bounds__(kThreads) gated_residual_kernel(
    T* __restrict__ out, const T* __restrict__ residual, const G* __restrict__ gate, const T* __restrict__ update,
    int64_t rows, int64_t seq, int32_t vecs_per_row, int64_t gate_batch_stride, int64_t gate_seq_stride,
    const int32_t* __restrict__ index, int64_t table_rows) {
  using P = Pack<T>;
  constexpr int kVec = P::kSize;
  constexpr bool kFloatGate = SameType<G, float>::value;
  static_assert(!kTanhGate || (!kRowGate && !kFloatGate), "the tanh of indexed gate rows of T");
  const int32_t col = blockIdx.x * blockDim.x + threadIdx.x;
  if (col >= vecs_per_row) return;

  const int64_t row_step = static_cast<int64_t>(gridDim.y) * blockDim.y;
  int64_t batch_begin = 0, batch_end = 0;  // row gate: rows [batch_begin, batch_end) share the cached gate
  float gate_row[kVec];

  for (int64_t row0 = static_cast<int64_t>(blockIdx.y) * blockDim.y + threadIdx.y; row0 < rows;
       row0 += row_step * kRowsInFlight) {
    P res[kRowsInFlight], upd[kRowsInFlight], gat[kRowGate || kFloatGate ? 1 : kRowsInFlight];
    float gat_f[kRowGate || !kFloatGate ? 1 : kRowsInFlight][kVec];
#pragma unroll
    for (int r = 0; r < kRowsInFlight; ++r) {
      const int64_t row = row0 + r * row_step;
      if (row < rows) {
        res[r] = reinterpret_cast<const P*>(residual)[row * vecs_per_row + col];
        upd[r] = reinterpret_cast<const P*>(update)[row * vecs_per_row + col];
        if constexpr (!kRowGate) {
          const int64_t b = row / seq;
          const G* g;
          if (index != nullptr) {
            const int32_t t = index[row];
            if (t < 0 || t >= table_rows) __trap();  // eager's index_select: index out of bounds
            g = gate + static_cast<int64_t>(t) * gate_seq_stride;
          } else {
            g = gate + b * gate_batch_stride + (row - b * seq) * gate_seq_stride;
          }
          if constexpr (kFloatGate) {
            load_gate<T, G>(g, col, gat_f[r]);
          } else {
            gat[r] = reinterpret_cast<const P*>(g)[col];
          }
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
          load_gate<T, G>(gate + b * gate_batch_stride, col, gate_row);
        }
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[i] = gate_row[i];
      } else if constexpr (kFloatGate) {
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[i] = gat_f[r][i];
      } else {
#pragma unroll
        for (int i = 0; i < kVec; ++i) g[i] = gate_value<T, kTanhGate>(Storage<T>::load(gat[r].v[i]));
      }
      P o;
#pragma unroll
      for (int i = 0; i < kVec; ++i) {
        if constexpr (kFloatGate) {  // float(update) * gate and the sum stay fp32; one rounding to T
          o.v[i] = Storage<T>::store(__fadd_rn(Storage<T>::load(res[r].v[i]),
                                               __fmul_rn(Storage<T>::load(upd[r].v[i]), g[i])));
        } else {
          const float gated = round_to<T>(__fmul_rn(g[i], Storage<T>::load(upd[r].v[i])));
          o.v[i] = Storage<T>::store(__fadd_rn(Storage<T>::load(res[r].v[i]), gated));
        }
      }
      reinterpret_cast<P*>(out)[row * vecs_per_row + col] = o;
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T, typename G>
cudaError_t launch(const GatedResidualArgs& a, cudaStream_t stream) {
  constexpr int kVec = Pack<T>::kSize;
  const int64_t rows = a.batch * a.seq;
  if (rows == 0 || a.dim == 0) return cudaSuccess;
  const int32_t vecs_per_row = static_cast<int32_t>(a.dim / kVec);
  const RowGrid shape = row_grid(rows, vecs_per_row, kThreads, kRowsInFlight);
  auto* out = static_cast<T*>(a.out);
  const auto* residual = static_cast<const T*>(a.residual);
  const auto* gate = static_cast<const G*>(a.gate);
  const auto* update = static_cast<const T*>(a.update);
  if (a.tanh_gate) {
    if constexpr (SameType<G, T>::value) {
      if (a.index == nullptr) return cudaErrorInvalidValue;  // the tanh of indexed rows only (bindings.cpp)
      gated_residual_kernel<T, G, false, true><<<shape.grid, shape.block, 0, stream>>>(
          out, residual, gate, update, rows, a.seq, vecs_per_row, a.gate_batch_stride, a.gate_seq_stride, a.index,
          a.table_rows);
      return cudaGetLastError();
    } else {
      return cudaErrorInvalidValue;  // an fp32 gate: Wan's chain, no tanh
    }
  }
  if (a.gate_seq_stride == 0 && a.index == nullptr) {
    gated_residual_kernel<T, G, true><<<shape.grid, shape.block, 0, stream>>>(
        out, residual, gate, update, rows, a.seq, vecs_per_row, a.gate_batch_stride, 0, nullptr, 0);
  } else {
    gated_residual_kernel<T, G, false><<<shape.grid, shape.block, 0, stream>>>(
        out, residual, gate, update, rows, a.seq, vecs_per_row, a.gate_batch_stride, a.gate_seq_stride, a.index,
        a.table_rows);
  }
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_gated_residual(const GatedResidualArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return args.gate_fp32 ? launch<T, float>(args, stream) : launch<T, T>(args, stream);
  });
}
#endif

}  // namespace diffusers_fastpath
