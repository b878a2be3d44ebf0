// FLUX.1's adaLN: torch.nn.LayerNorm without affine, then the modulate, in one kernel that reads x once and writes
// once, bit-identical to eager F.layer_norm followed by `y * (1 + scale[:, None]) + shift[:, None]`.
//
// The eager chain, with its rounding points (T = bf16 or fp16 storage, every operation in fp32):
//   (mean, m2)  = aten's Welford statistics of the row (below)
//   rstd        = rsqrtf(m2 / float(D) + eps)          (c10::cuda::compat::rsqrt is ::rsqrtf)
//   y           = round_T(rstd * (x - mean))           (no gamma/beta: aten's expression has no add here)
//   out         = round_T(round_T(y * round_T(1 + scale)) + shift)   (the three modulate kernels)
//
// aten (torch 2.11, aten/src/ATen/native/cuda/layer_norm_kernel.cu) runs `vectorized_layer_norm_kernel` for a
// contiguous fp16/bf16/fp32 row of length D with D % 4 == 0, D <= 2^24 and X/Y 8-byte aligned (without gamma/beta
// nothing else is checked): one block of (32, num_threads() / 32) = (32, 4) threads per row. Its `compute_stats`:
//   - thread t = threadIdx.x + 32 * threadIdx.y loads 4-element vectors t, t + 128, ... and folds each element, in
//     order, into its (mean, m2, count) with `cuWelfordOnlineSum`:
//       delta = x - mean; count = count + 1; mean = mean + delta * (1 / count); m2 = m2 + delta * (x - mean)
//   - a shuffle-down tree over offsets 16, 8, 4, 2, 1, each step `cuWelfordCombine(own, shuffled)`:
//       delta = own.mean - other.mean; count = other.count + own.count; (count == 0: zeros)
//       coef = 1 / count; nA = other.count * coef; nB = own.count * coef
//       mean = nA * other.mean + nB * own.mean; m2 = other.m2 + own.m2 + delta * delta * other.count * nB
//   - lane 0 of each warp then combines through shared memory: warps 2, 3 into 0, 1, then warp 1 into warp 0.
// aten is built with nvcc's default --fmad=true, so nvcc contracts `a + b * c` into an FMA. The sm_90 SASS of
// torch 2.11.0+cu130's vectorized_layer_norm_kernel<BFloat16 or Half, float, rms_norm=false> (cuobjdump of
// libtorch_cuda.so, git 70d99e99) has exactly these FFMAs in the statistics, and nvcc 13.0 compiling the expressions
// above emits the same:
//   mean  = fma(delta, 1 / count, mean)           m2 = fma(delta, x - mean, m2)              (online update)
//   mean  = fma(nA, other.mean, nB * own.mean)    m2 = fma(delta * delta * other.count, nB, other.m2 + own.m2)
// Every other product is rounded on its own; 1 / count is the IEEE reciprocal (MUFU.RCP + Newton step + slow path:
// rcp.rn), m2 / D the IEEE division (div.rn), rsqrt MUFU.RSQ with rsqrtf's denormal scaling, and without gamma/beta
// the output is FADD then FMUL, rounded to T (F2FP, nearest even). This file is built with --fmad=false, so each of
// those choices is spelled out with __fmaf_rn / __fmul_rn / __fadd_rn and cannot drift with the compiler. That is
// variant 0 below; the other variants (alternative contraction choices, the argument order of the combine, eight warps
// per row) exist only for tools/layernorm_order_probe.py, which asks the GPU which of them matches the aten build
// it runs against (the SASS does not show the block shape: (32, 4) is thread_constants.h's num_threads() = 128 on
// CUDA). The Python op verifies itself against eager on its first call per (dtype, D) as well, because all of this is
// a property of the aten build.
//
// With fp32 scale/shift (Wan's blocks: `(self.norm1(x.float()) * (1 + scale) + shift).type_as(x)`, an fp32 LayerNorm
// of the upcast stream, then an fp32 modulate) the statistics are the same (aten's fp32 instantiation of the same
// vectorized kernel over the same floats; the op verifies itself against eager per (dtype, D) all the same) and the
// chain rounds once, at the end:
//   y   = rstd * (x - mean)                                   (fp32, not rounded: the LayerNorm's output is fp32)
//   out = round_T((y * (1 + scale)) + shift)                  (each operation rounded to fp32)
// and with the norm's own affine instead (`affine`: Wan's norm2, `self.norm2(x.float()).type_as(x)` of an
// FP32LayerNorm with weight and bias, the rows being weight.float() and bias.float()), aten's vectorized epilogue
// `gamma * (rstd * (x - mean)) + beta`, whose multiply-add nvcc contracts:
//   out = round_T(fma(weight, y, bias))
//
// Per-token rows (`layernorm_modulate`: FLUX.3's adaLN, `(1 + mod_scale) * norm(x) + mod_shift` with [B, S, D] chunks
// of a per-token modulation): token l of sample b reads its own scale and shift row, at b * batch stride + l * seq
// stride; the statistics and the rounding points are the ones above, only the rows' addressing differs. With the
// LayerNorm's own weight and bias (`norm_weight`, `norm_bias`: an affine nn.LayerNorm of T, or an FP32LayerNorm,
// CogVideoX's, EasyAnimate's; passed as fp32 rows, the values aten's `static_cast<T_ACC>(gamma)` reads) the normalised
// value is aten's affine epilogue `gamma * (rstd * (x - mean)) + beta`, nvcc's one FMA (as Wan's norm2 below), rounded
// to T once (an FP32LayerNorm's fp32 output cast back rounds the same fp32 value once), then the modulate:
//   y   = round_T(fma(weight, rstd * (x - mean), bias))
//   out = round_T(round_T(y * round_T(1 + scale)) + shift)
// and without a shift (a null shift: Qwen-Image 2.1's scale-only modulate `norm(x) * (1 + scale)`, per-token rows
// chosen by torch.where) the product is the output: out = round_T(y * round_T(1 + scale)).
//
// Gated (`gated_layernorm_scale_shift`: FLUX's `hidden_states = hidden_states + gate.unsqueeze(1) * update` followed by
// the LayerNorm-modulate of the new stream, in the dual block and across consecutive blocks) the row is first the
// residual update of gated_residual.cu, with its two rounding points, written out as well:
//   x   = round_T(residual + round_T(gate * update))       (__fmul_rn, __fadd_rn: no FMA contraction)
// and the statistics and the modulate above run on those x. The row stays in registers, so x is read from memory
// twice (residual and update) and written twice (x and out), against five reads and writes for the two kernels.
// The gated form takes the other T forms too (per-token or indexed rows, no shift, the norm's affine): Qwen-Image
// 2.1's in-block `x = x + gate.tanh() * attn` then `norm2(x) * (1 + scale)` (`gated_layernorm_scale_rows`), its gate
// and scale where-picked rows read through int32 indices (gate_index, row_index) of [R, dim] tables; with kTanhGate
// (a.tanh_gate) the gate table holds the rows before their `.tanh()` and each gate value loaded goes through aten's
// tanh rounded to T (elementwise.cuh's tanh_of, proven on every value of T by the Python op before it asks for it):
//   x   = round_T(residual + round_T(round_T(tanhf(gate)) * update))
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

// The variant production runs (see the bits below). Change it here if the probe names another one.
constexpr int kDefaultVariant = 0;

// Each bit departs from aten-as-compiled-by-nvcc-13 in one place.
constexpr int kOnlineMeanUnfused = 1;     // online update: mean + round(delta * (1 / count))
constexpr int kOnlineM2Unfused = 2;       // online update: m2 + round(delta * (x - mean))
constexpr int kCombineMeanOtherFma = 4;   // combine: fma(nB, own.mean, round(nA * other.mean))
constexpr int kCombineMeanUnfused = 8;    // combine: round(nA * other.mean) + round(nB * own.mean)
constexpr int kCombineM2Unfused = 16;     // combine: (other.m2 + own.m2) + round(delta * delta * other.count * nB)
constexpr int kCombineSwapped = 32;       // combine(shuffled, own) instead of combine(own, shuffled)
constexpr int kEightWarps = 64;           // block (32, 8): num_threads() = 256
constexpr int kVariantMask = 127;

constexpr int kWarpsMax = 8;
constexpr int kAtenWarps = 4;             // aten's block (32, num_threads() / 32) = (32, 4): the production launch
constexpr int kVec = 4;                   // aten's vec_size: 4 elements per load, whatever the dtype
constexpr int kVecsPerThreadMax = 12;     // 4 warps x 32 lanes x 12 vectors x 4 elements: D <= 6144 (FLUX.2) in registers

// 4 elements of T: the vector one aten thread loads.
template <typename T>
struct alignas(4 * sizeof(T)) Quad {
  T v[kVec];
};

struct Welford {
  float mean;
  float m2;
  float count;
};

// aten's cuWelfordOnlineSum for the n-th element a thread folds in (n = 1, 2, ...): its count, count + 1, is n
// whatever the data (the guard on a thread's vectors is monotone in k), so the fully unrolled loop below passes n
// as a constant and 1 / count folds to the correctly rounded quotient at compile time, the value rcp.rn gives (IEEE
// division of two representable floats), instead of a dependent MUFU.RCP + Newton + slow-path check per element.
__device__ __forceinline__ Welford online_update(float x, const Welford& w, int n, int variant) {
  const float delta = __fsub_rn(x, w.mean);
  const float count = static_cast<float>(n);  // w.count + 1: small integers, exact
  const float inv = 1.0f / static_cast<float>(n);  // folded (n is a constant): rcp.rn(count)
  const float mean = (variant & kOnlineMeanUnfused) ? __fadd_rn(w.mean, __fmul_rn(delta, inv))
                                                    : __fmaf_rn(delta, inv, w.mean);
  const float d2 = __fsub_rn(x, mean);
  const float m2 = (variant & kOnlineM2Unfused) ? __fadd_rn(w.m2, __fmul_rn(delta, d2)) : __fmaf_rn(delta, d2, w.m2);
  return {mean, m2, count};
}

// aten's cuWelfordCombine(dataB = b, dataA = a).
__device__ __forceinline__ Welford combine_ba(const Welford& b, const Welford& a, int variant) {
  const float delta = __fsub_rn(b.mean, a.mean);
  const float count = __fadd_rn(a.count, b.count);
  if (!(count > 0.0f)) return {0.0f, 0.0f, count};
  const float coef = __frcp_rn(count);
  const float na = __fmul_rn(a.count, coef);
  const float nb = __fmul_rn(b.count, coef);
  float mean;
  if (variant & kCombineMeanUnfused) {
    mean = __fadd_rn(__fmul_rn(na, a.mean), __fmul_rn(nb, b.mean));
  } else if (variant & kCombineMeanOtherFma) {
    mean = __fmaf_rn(nb, b.mean, __fmul_rn(na, a.mean));
  } else {
    mean = __fmaf_rn(na, a.mean, __fmul_rn(nb, b.mean));
  }
  const float m2s = __fadd_rn(a.m2, b.m2);
  const float t = __fmul_rn(__fmul_rn(delta, delta), a.count);
  const float m2 = (variant & kCombineM2Unfused) ? __fadd_rn(m2s, __fmul_rn(t, nb)) : __fmaf_rn(t, nb, m2s);
  return {mean, m2, count};
}

__device__ __forceinline__ Welford combine(const Welford& own, const Welford& other, int variant) {
  return (variant & kCombineSwapped) ? combine_ba(other, own, variant) : combine_ba(own, other, variant);
}

// The normalised, modulated quad i of a row (eager's rounding points, file head).
// (g, be: the norm's fp32 weight and bias, read where a.norm_weight is set; T's chain only.)
template <typename T, typename S>
__device__ __forceinline__ Quad<T> modulate_quad(const LayerNormScaleShiftArgs& a, const Quad<T>& xq, const Quad<S> s,
                                                 const Quad<S> h, const Quad<float>& g, const Quad<float>& be,
                                                 float mean, float rstd) {
  constexpr bool kFloatModulate = SameType<S, float>::value;
  Quad<T> o;
#pragma unroll
  for (int j = 0; j < kVec; ++j) {
    const float normed = __fmul_rn(rstd, __fsub_rn(Storage<T>::load(xq.v[j]), mean));
    if constexpr (kFloatModulate) {
      o.v[j] = a.affine ? Storage<T>::store(__fmaf_rn(s.v[j], normed, h.v[j]))  // weight * y + bias
                        : Storage<T>::store(__fadd_rn(__fmul_rn(normed, __fadd_rn(1.0f, s.v[j])), h.v[j]));
    } else {
      const float y = round_to<T>(a.norm_weight != nullptr ? __fmaf_rn(g.v[j], normed, be.v[j]) : normed);
      const float one_plus_scale = round_to<T>(__fadd_rn(Storage<T>::load(s.v[j]), 1.0f));
      const float scaled = round_to<T>(__fmul_rn(y, one_plus_scale));
      // no shift (a.shift null: Qwen-Image 2.1's scale-only `norm(x) * (1 + scale)`): the product, already of T
      o.v[j] = Storage<T>::store(a.shift != nullptr ? __fadd_rn(scaled, Storage<T>::load(h.v[j])) : scaled);
    }
  }
  return o;
}

// One block per row, laid out as aten's: blockDim = (32, warps). kKv: the vectors each thread holds, the production
// launch's kv_for(D), so that the registers, and with them the rows resident per multiprocessor, follow the row length
// (bf16 rows of 3072: 48 registers at kKv 6, 78 when every D held kVecsPerThreadMax; 22.6 against 30.0 us at
// 4096 x 3072 on the H200, cd192d2); 0: the probe's kernel, which holds kVecsPerThreadMax and reads its variant from
// the arguments (uniform branches). (A grid-stride launch of the resident
// blocks, each prefetching its next row into L2 while reducing the current one, timed the same on the H200 at
// 4f6d200: 29.8 us at 4096 x 3072 bf16, 46% of copy; so did one warp per row, emulating the block's four warps,
// slower at 36.5 us, 2e9fc06.) Its operands come through the read-only path, scale and shift as vectors (they were
// read element by element), and the production block is aten's (32, 4) at compile time (launch bounds 128, the
// combine unrolled): 21.0 against 22.4 us at 4096 x 3072 (29a53bb, 66% of copy). tools/kernel_layout_probe.py also
// timed launch bounds for 12 resident rows (no faster; 16 spill) and 64 threads a row playing two adjacent aten
// threads with 16-byte loads (20.6 us, the same): each row's serial Welford chain and shuffle combine, not the
// loads, bound it. S: the type of scale and shift, T (FLUX's chain, rounded after every operation) or float (Wan's
// fp32 modulate).
// kGated: the row is the gated residual update of a.x (the residual), a.gate and a.update, also written to a.x_out
// (file head); the kernel of dtype T's chain only (S = T).
// kTanhGate: the gate's tanh taken of each value loaded (gated only).
template <typename T, typename S, int kKv, bool kGated, bool kTanhGate = false>
__global__ void __launch_bounds__(kKv == 0 ? 32 * kWarpsMax : 32 * kAtenWarps)
    layernorm_scale_shift_kernel(LayerNormScaleShiftArgs a) {
  static_assert(!kGated || (kKv != 0 && SameType<S, T>::value), "gated: the production kernel of T's chain");
  static_assert(!kTanhGate || kGated, "the gate's tanh: the gated form's");
  constexpr bool kProbe = kKv == 0;
  constexpr int kHeld = kProbe ? kVecsPerThreadMax : kKv;
  const int variant = kProbe ? a.variant : kDefaultVariant;
  __shared__ float partial[3][kWarpsMax / 2];
  __shared__ float stats[2];

  const int lane = threadIdx.x;
  const int warp = threadIdx.y;
  const int warps = kProbe ? static_cast<int>(blockDim.y) : kAtenWarps;  // production: (32, 4), the loop unrolled
  const int thread = lane + 32 * warp;
  const int threads = 32 * warps;
  const int64_t row = blockIdx.x;
  const int64_t b = row / a.seq;
  const int vecs = static_cast<int>(a.dim / kVec);
  const Quad<T>* x = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.x) + row * a.dim);

  // Statistics, in aten's order; the row stays in registers for the second pass.
  Quad<T> data[kHeld];
  if constexpr (kGated) {
    const Quad<T>* update = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.update) + row * a.dim);
    // the gate's row: sample b's, or (gate_index: Qwen-Image 2.1's where-picked tanh rows) row gate_index[row] of a
    // [R, dim] table whose row stride gate_batch_stride is
    const int64_t gate_row = a.gate_index != nullptr ? static_cast<const int32_t*>(a.gate_index)[row] : b;
    const Quad<T>* gate = reinterpret_cast<const Quad<T>*>(static_cast<const T*>(a.gate) + gate_row * a.gate_batch_stride);
    Quad<T>* x_out = reinterpret_cast<Quad<T>*>(static_cast<T*>(a.x_out) + row * a.dim);
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int i = thread + k * threads;
      if (i < vecs) {
        const Quad<T> r = load_readonly(x + i), u = load_readonly(update + i), g = load_readonly(gate + i);
#pragma unroll
        for (int j = 0; j < kVec; ++j) {  // gated_residual.cu's chain: round(residual + round(gate * update))
          const float gv = gate_value<T, kTanhGate>(Storage<T>::load(g.v[j]));
          const float gated = round_to<T>(__fmul_rn(gv, Storage<T>::load(u.v[j])));
          data[k].v[j] = Storage<T>::store(__fadd_rn(Storage<T>::load(r.v[j]), gated));
        }
        x_out[i] = data[k];
      }
    }
  } else {
#pragma unroll
    for (int k = 0; k < kHeld; ++k) {
      const int i = thread + k * threads;
      if (i < vecs) data[k] = load_readonly(x + i);
    }
  }
  Welford w{0.0f, 0.0f, 0.0f};
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    if (thread + k * threads < vecs) {
#pragma unroll
      for (int j = 0; j < kVec; ++j) w = online_update(Storage<T>::load(data[k].v[j]), w, kVec * k + j + 1, variant);
    }
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const Welford other{__shfl_down_sync(0xffffffffu, w.mean, offset), __shfl_down_sync(0xffffffffu, w.m2, offset),
                        __shfl_down_sync(0xffffffffu, w.count, offset)};
    w = combine(w, other, variant);
  }
  for (int offset = warps / 2; offset > 0; offset /= 2) {
    if (lane == 0 && warp >= offset && warp < 2 * offset) {
      partial[0][warp - offset] = w.mean;
      partial[1][warp - offset] = w.m2;
      partial[2][warp - offset] = w.count;
    }
    __syncthreads();
    if (lane == 0 && warp < offset) {
      w = combine(w, Welford{partial[0][warp], partial[1][warp], partial[2][warp]}, variant);
    }
    __syncthreads();
  }
  if (thread == 0) {
    stats[0] = w.mean;
    stats[1] = __fdiv_rn(w.m2, static_cast<float>(a.dim));  // sigma2 / float(N): div.rn
  }
  __syncthreads();
  const float mean = stats[0];
  const float rstd = rsqrtf(__fadd_rn(stats[1], a.eps));

  // Normalise (the norm's affine where it has one), round to T, modulate with eager's three rounding points; the
  // rows of sample b, token l (per-token rows: seq strides; one row per sample: 0).
  // Indexed rows (row_index): row `row`'s entry picks one row of each [R, dim] table, the seq strides its row stride.
  const int64_t l = row - b * a.seq;
  const int64_t picked = a.row_index != nullptr ? static_cast<const int32_t*>(a.row_index)[row] : -1;
  const Quad<S>* scale = reinterpret_cast<const Quad<S>*>(
      static_cast<const S*>(a.scale) +
      (picked >= 0 ? picked * a.scale_seq_stride : b * a.scale_batch_stride + l * a.scale_seq_stride));
  const Quad<S>* shift =
      a.shift == nullptr ? nullptr  // scale only
                         : reinterpret_cast<const Quad<S>*>(
                               static_cast<const S*>(a.shift) +
                               (picked >= 0 ? picked * a.shift_seq_stride
                                            : b * a.shift_batch_stride + l * a.shift_seq_stride));
  const Quad<float>* weight = static_cast<const Quad<float>*>(a.norm_weight);
  const Quad<float>* bias = static_cast<const Quad<float>*>(a.norm_bias);
  Quad<T>* out = reinterpret_cast<Quad<T>*>(static_cast<T*>(a.out) + row * a.dim);
#pragma unroll
  for (int k = 0; k < kHeld; ++k) {
    const int i = thread + k * threads;
    if (i < vecs) {
      Quad<float> g{}, be{};
      if (weight != nullptr) {
        g = load_readonly(weight + i);
        be = load_readonly(bias + i);
      }
      const Quad<S> h = shift != nullptr ? load_readonly(shift + i) : Quad<S>{};
      out[i] = modulate_quad<T, S>(a, data[k], load_readonly(scale + i), h, g, be, mean, rstd);
    }
  }
}

// The vectors per aten thread the production kernel is instantiated for (kKv), each D taking the smallest that holds
// its row: D <= 3072 (FLUX.1, Qwen-Image, HunyuanVideo, SD3.5) 6, 4096 8, 6144 (FLUX.2, Wan's 5120) 12. (Fewer than 6
// would save registers for short rows only, and NVRTC 13.0 schedules the kKv 2 and 4 instantiations differently from
// nvcc: tests/test_nvrtc.py wants the same machine code both ways.)
__host__ __device__ constexpr int kv_for(int64_t dim) {
  const int64_t per_thread = (dim / kVec + 32 * kAtenWarps - 1) / (32 * kAtenWarps);
  return per_thread <= 6 ? 6 : per_thread <= 8 ? 8 : 12;
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T, typename S, bool kGated, bool kTanhGate = false>
cudaError_t launch_kv(const LayerNormScaleShiftArgs& a, dim3 grid, cudaStream_t stream) {
  const dim3 block(32, kAtenWarps);
  switch (kv_for(a.dim)) {
    case 6: layernorm_scale_shift_kernel<T, S, 6, kGated, kTanhGate><<<grid, block, 0, stream>>>(a); break;
    case 8: layernorm_scale_shift_kernel<T, S, 8, kGated, kTanhGate><<<grid, block, 0, stream>>>(a); break;
    default: layernorm_scale_shift_kernel<T, S, 12, kGated, kTanhGate><<<grid, block, 0, stream>>>(a); break;
  }
  return cudaGetLastError();
}

template <typename T, typename S>
cudaError_t launch(const LayerNormScaleShiftArgs& a, cudaStream_t stream) {
  const int64_t rows = a.batch * a.seq;
  if (rows == 0) return cudaSuccess;
  const int variant = a.probe ? a.variant : kDefaultVariant;
  if ((variant & ~kVariantMask) != 0) return cudaErrorInvalidValue;
  if (a.dim % kVec != 0 || a.dim / kVec > static_cast<int64_t>(32) * 4 * kVecsPerThreadMax || rows > 0x7fffffff) {
    return cudaErrorInvalidValue;
  }
  const dim3 grid(static_cast<unsigned>(rows));
  if (a.probe) {
    if (a.gated) return cudaErrorInvalidValue;
    layernorm_scale_shift_kernel<T, S, 0, false><<<grid, dim3(32, (variant & kEightWarps) ? 8 : 4), 0, stream>>>(a);
    return cudaGetLastError();
  }
  if ((a.norm_weight != nullptr || a.shift == nullptr || a.scale_seq_stride != 0 || a.shift_seq_stride != 0 ||
       a.row_index != nullptr) &&
      (a.modulate_fp32 || (a.norm_weight == nullptr) != (a.norm_bias == nullptr))) {
    return cudaErrorInvalidValue;  // the norm's affine, per-token rows, no shift: T's chain (bindings.cpp)
  }
  if (a.gate_index != nullptr && !a.gated) return cudaErrorInvalidValue;  // an indexed gate: the gated chain's
  if (a.tanh_gate && a.gate_index == nullptr) return cudaErrorInvalidValue;  // the tanh of indexed gate rows only
  if (a.gated) {
    if constexpr (SameType<S, T>::value) {
      return a.tanh_gate ? launch_kv<T, S, true, true>(a, grid, stream) : launch_kv<T, S, true>(a, grid, stream);
    } else {
      return cudaErrorInvalidValue;  // the gated chain is T's (bindings.cpp checks it)
    }
  }
  return launch_kv<T, S, false>(a, grid, stream);
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_layernorm_scale_shift(const LayerNormScaleShiftArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) {
    using T = decltype(tag);
    return args.modulate_fp32 ? launch<T, float>(args, stream) : launch<T, T>(args, stream);
  });
}
#endif

}  // namespace diffusers_fastpath
