// Device helpers shared by the fused elementwise kernels.
//
// Eager PyTorch runs a chain such as `x * (1 + scale) + shift` as one kernel per operator: each loads its
// fp16/bf16 operands into fp32 ("opmath"), performs exactly one IEEE operation, and rounds the result back to
// the storage dtype. A fused kernel is bit-identical to that chain only if it keeps every one of those rounding
// points and performs every multiply and add as a separate, correctly rounded operation. The intrinsics
// __fmul_rn/__fadd_rn are never contracted into an FMA by nvcc (the build also passes --fmad=false), and
// round_to<T>() reproduces the store-and-reload of an intermediate tensor.
#pragma once

#ifndef __CUDACC_RTC__
#include <cstdint>
#endif

// Under NVRTC these are the headers NVRTC is pointed at (ops/_nvrtc.py: the CUDA runtime wheel's include directory
// that CUDA builds of torch install, or NVRTC's bundled headers); they need no host headers there.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include "fastpath.h"

namespace diffusers_fastpath {

// std::is_same without <type_traits> (NVRTC builds these headers without the standard library).
template <typename A, typename B>
struct SameType {
  static constexpr bool value = false;
};
template <typename A>
struct SameType<A, A> {
  static constexpr bool value = true;
};

// std::conditional without <type_traits>: A where kFirst, else B.
template <bool kFirst, typename A, typename B>
struct Pick {
  using type = A;
};
template <typename A, typename B>
struct Pick<false, A, B> {
  using type = B;
};

template <typename T>
struct Storage;

template <>
struct Storage<__nv_bfloat16> {
  static __device__ __forceinline__ float load(__nv_bfloat16 v) { return __bfloat162float(v); }
  static __device__ __forceinline__ __nv_bfloat16 store(float v) { return __float2bfloat16_rn(v); }
};

template <>
struct Storage<__half> {
  static __device__ __forceinline__ float load(__half v) { return __half2float(v); }
  static __device__ __forceinline__ __half store(float v) { return __float2half_rn(v); }
};

// fp32 storage (the VAE copies and bias adds take an fp32 VAE's tensors): nothing to round.
template <>
struct Storage<float> {
  static __device__ __forceinline__ float load(float v) { return v; }
  static __device__ __forceinline__ float store(float v) { return v; }
};

// The unsigned word of T's size: what a copy moves without reading the value (a NaN's payload kept).
template <int kBytes>
struct Word;
template <>
struct Word<2> {
  using type = unsigned short;
};
template <>
struct Word<4> {
  using type = unsigned int;
};

// The value an eager op leaves in memory: fp32 result rounded (to nearest even) to T, read back as fp32.
template <typename T>
__device__ __forceinline__ float round_to(float v) {
  return Storage<T>::load(Storage<T>::store(v));
}

// aten's silu_kernel (aten/src/ATen/native/cuda/ActivationSiluKernel.cu) in fp32 opmath: x / (1 + exp(-x)) with CUDA's
// expf, an IEEE add and division. expf is libdevice's under both builds; whether the rest matches aten's build (nvcc
// with --fmad=true: no product feeds an add here) is proven by each op that uses it on every value of its dtype
// (silu_mul.cu, group_norm_silu.cu, channel_rmsnorm_silu.cu, per_channel_rmsnorm.cu: their Python ops).
__device__ __forceinline__ float silu(float x) { return __fdiv_rn(x, __fadd_rn(1.0f, expf(-x))); }

// LTX-Video's VAE norm of one element after aten's reduction and rsqrt (diffusers' weightless RMSNorm, eager's
// `(x.to(float32) * rsqrt(variance + eps)).to(T)`): round(x * r), the mixed-dtype multiply as one IEEE product rounded
// where eager's .to(T) rounds; with `silu_after` the SiLU module after it on that stored value (`silu`), rounded. The
// epilogue of ltx_vae_rmsnorm.cu's kernel and of causal_pad.cu's ltx_rmsnorm_pad_cl_kernel, one code for both.
template <typename T>
__device__ __forceinline__ T ltx_rmsnorm_value(T x, float r, bool silu_after) {
  float y = __fmul_rn(Storage<T>::load(x), r);
  if (silu_after) y = silu(round_to<T>(y));  // eager stores the norm's T result, the SiLU reads it back
  return Storage<T>::store(y);
}

// Wan's and Qwen-Image's VAE channel norm of one element after aten's reduction (diffusers' WanRMS_norm /
// QwenImageRMS_norm: `F.normalize(x.float(), dim=1).to(T) * scale * gamma + bias`), with `silu_after` the SiLU module
// after it: x the element, d its position's denominator (aten's norm.clamp_min(eps)), gamma and bias its channel's (a
// python-float bias as aten's add casts it), scale the module's python float as aten's mul casts it. F.normalize's
// division, the cast, the two products and the sum are separate IEEE operations (the build passes --fmad=false), each
// rounded to T where eager stores a tensor; the float returned is rounded to T by its store. The epilogue of
// channel_rmsnorm_silu.cu's kernel and of causal_pad.cu's channel_rmsnorm_pad_cl_kernel, one code for both.
template <typename T>
__device__ __forceinline__ float channel_rmsnorm_value(float x, float d, float gamma, float bias, float scale,
                                                       bool silu_after) {
  const float n = round_to<T>(__fdiv_rn(x, d));
  const float m = round_to<T>(__fmul_rn(n, scale));
  const float g = round_to<T>(__fmul_rn(m, gamma));
  const float y = __fadd_rn(g, bias);
  return silu_after ? silu(round_to<T>(y)) : y;
}

// LTX-Video's VAE norm's reciprocal of one position from its fp32 mean of squares m (eager's `torch.rsqrt(variance +
// eps)`: two fp32 tensors, nothing rounded between them but each op's fp32 result): aten's CUDA add of the python eps
// (the double cast to float: one IEEE add), then aten's rsqrt_kernel_cuda, `::rsqrt(v)` of a float, which is CUDA's
// rsqrtf. A function of the one value m: per_channel_rmsnorm.cu's ltx_rsqrt_probe_kernel runs it on every fp32 bit
// pattern for the Python op (ops/ltx_vae_rmsnorm_conv.py's proof), against torch.rsqrt(m + eps) on the device.
__device__ __forceinline__ float ltx_rsqrt(float m, float eps) { return rsqrtf(__fadd_rn(m, eps)); }

// aten's tanh_kernel_cuda (aten/src/ATen/native/cuda/UnaryGeometricTanhKernel.cu, the real types) in fp32 opmath:
// `::tanh(static_cast<opmath_t>(a))` of a T value, CUDA's tanhf, rounded to T (what eager's `gate.tanh()` leaves in
// memory). A function of the one value: the ops that fold it into a kernel (Qwen-Image 2.1's gates read through an
// index: gated_residual.cu, layernorm_scale_shift.cu's gated form) prove it on every value of T on the device against
// torch.tanh before they use it (ops/_unary_proof.py), else they read aten's own tanh of the table.
template <typename T>
__device__ __forceinline__ float tanh_of(float x) { return round_to<T>(tanhf(x)); }

// A gate value as the gated kernels use it (gated_residual.cu, layernorm_scale_shift.cu's gated form): the value
// loaded, or with kTanhGate its tanh_of (the table holds the gate rows before their `.tanh()`).
template <typename T, bool kTanhGate>
__device__ __forceinline__ float gate_value(float g) {
  if constexpr (kTanhGate) {
    return tanh_of<T>(g);
  } else {
    return g;
  }
}

// aten's sigmoid_kernel_cuda (aten/src/ATen/native/cuda/UnarySpecialOpsKernel.cu, the real types) in fp32 opmath:
// one / (one + std::exp(-x)), CUDA's expf, an IEEE add and division (correctly rounded: nvcc's 1 / y, whatever
// instructions it picks, is the same number); proven on every value of its dtype by its op (ops/sigmoid_mul.py).
__device__ __forceinline__ float sigmoid(float x) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-x))); }

// 16 bytes of T: one vectorised global load or store (LDG.128 / STG.128) when the address is 16-byte aligned.
template <typename T>
struct alignas(16) Pack {
  static constexpr int kSize = 16 / sizeof(T);
  T v[kSize];
};

// A word of a __shared__ array at its 32-bit shared-window address (`shared_address` of an element): nvcc's front end
// computes addresses into a __shared__ array with 32-bit arithmetic, NVRTC's with 64-bit generic pointers, so a tile
// indexed by thread (the transposing copies) compiles to other machine code under the two; through these both emit
// the same instructions (tests/test_nvrtc.py compares them).
__device__ __forceinline__ unsigned shared_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}
// The same through the instruction itself (cvta.to.shared of the generic address): nvcc's front end folds
// __cvta_generic_to_shared of a __shared__ array into a 32-bit move of its symbol, NVRTC's into a 64-bit move and a
// truncation, which ptxas scheduled differently in the wide tiles' kernels (other machine code); through the asm both
// hand ptxas the same instructions.
__device__ __forceinline__ unsigned shared_window(const void* p) {
  unsigned address;
  asm("{\n\t.reg .u64 t;\n\tcvta.to.shared.u64 t, %1;\n\tcvt.u32.u64 %0, t;\n\t}" : "=r"(address) : "l"(p));
  return address;
}
__device__ __forceinline__ void shared_store(unsigned address, unsigned short v) {
  asm volatile("st.shared.u16 [%0], %1;" ::"r"(address), "h"(v) : "memory");
}
__device__ __forceinline__ void shared_store(unsigned address, unsigned int v) {
  asm volatile("st.shared.u32 [%0], %1;" ::"r"(address), "r"(v) : "memory");
}
__device__ __forceinline__ void shared_store(unsigned address, float v) {
  asm volatile("st.shared.f32 [%0], %1;" ::"r"(address), "f"(v) : "memory");
}
__device__ __forceinline__ void shared_load(unsigned address, unsigned short& v) {
  asm volatile("ld.shared.u16 %0, [%1];" : "=h"(v) : "r"(address) : "memory");
}
__device__ __forceinline__ void shared_load(unsigned address, unsigned int& v) {
  asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(address) : "memory");
}
__device__ __forceinline__ void shared_load(unsigned address, float& v) {
  asm volatile("ld.shared.f32 %0, [%1];" : "=f"(v) : "r"(address) : "memory");
}
__device__ __forceinline__ void shared_store(unsigned address, unsigned long long v) {
  asm volatile("st.shared.u64 [%0], %1;" ::"r"(address), "l"(v) : "memory");
}
__device__ __forceinline__ void shared_load(unsigned address, unsigned long long& v) {
  asm volatile("ld.shared.u64 %0, [%1];" : "=l"(v) : "r"(address) : "memory");
}
// 16 bytes at a 16-byte aligned address: one LDS.128
__device__ __forceinline__ void shared_load(unsigned address, uint4& v) {
  asm volatile("ld.shared.v4.u32 {%0, %1, %2, %3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
               : "r"(address)
               : "memory");
}

// The same at `address` + kOffset bytes, the offset an immediate of the instruction: the wide tiles' accesses (below)
// give ptxas one address register and constant offsets under both front ends (with the offsets added in C++, NVVM
// folded them into the tile's symbol under nvcc and into a separate register under NVRTC: other machine code).
template <int kOffset>
__device__ __forceinline__ void shared_store_at(unsigned address, unsigned int v) {
  asm volatile("st.shared.u32 [%0+%2], %1;" ::"r"(address), "r"(v), "n"(kOffset) : "memory");
}
template <int kOffset>
__device__ __forceinline__ void shared_load_at(unsigned address, unsigned short& v) {
  asm volatile("ld.shared.u16 %0, [%1+%2];" : "=h"(v) : "r"(address), "n"(kOffset) : "memory");
}

// The bits of a value as the word of its size (Word<sizeof(T)>): what a staging tile of words holds.
__device__ __forceinline__ unsigned short bits_of(__nv_bfloat16 v) { return __bfloat16_as_ushort(v); }
__device__ __forceinline__ unsigned short bits_of(__half v) { return __half_as_ushort(v); }
__device__ __forceinline__ unsigned int bits_of(float v) { return __float_as_uint(v); }

// A Pack written with one 16-byte store (st.global.v4.u32: STG.E.128) at a 16-byte aligned global `dst`, its values'
// bits packed into four words. Where a kernel fills a Pack value by value (causal_pad.cu's wide kernels: a transposed
// tile's values, a norm of each), nvcc kept the values in separate registers and stored the Pack in 2- and 4-byte
// pieces, seven stores a lane where one was meant and two thirds of those kernels' L2 sectors (ncu on an H100,
// docs/results.md, session 44); a uint4 of the words was still stored as four words, hence the instruction itself
// (`store_words`: 16 bytes already packed, such as a uint4 read from a staging tile).
__device__ __forceinline__ void store_words(void* dst, const uint4& w) {
  asm volatile("st.global.v4.u32 [%0], {%1, %2, %3, %4};" ::"l"(dst), "r"(w.x), "r"(w.y), "r"(w.z), "r"(w.w) : "memory");
}
// The 4-byte word of a Pack's values k and k + 1 (16-bit values; the first in the low half, as memory holds them)
template <typename T>
__device__ __forceinline__ unsigned pair_word(const Pack<T>& p, int k) {
  return static_cast<unsigned>(bits_of(p.v[k])) | (static_cast<unsigned>(bits_of(p.v[k + 1])) << 16);
}
template <typename T>
__device__ __forceinline__ void store_pack(T* dst, const Pack<T>& p) {
  unsigned w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    if constexpr (sizeof(T) == 2) {
      w[k] = pair_word(p, 2 * k);
    } else {
      w[k] = bits_of(p.v[k]);
    }
  }
  store_words(dst, make_uint4(w[0], w[1], w[2], w[3]));
}

// A kTile x kTile tile moved through shared memory (at `base`, `shared_address` of a W[kTile][kTile + 1] array: the
// padding keeps a column's words in distinct banks) by kTile x kRows threads, the transposing copies' core: read(i)
// gives the value of tile row i at column threadIdx.x (a load along the source's unit stride), write(i, v) takes
// column i of tile row threadIdx.x (a store along the destination's), for i = threadIdx.y + k * kRows. W is the word
// moved: unsigned short for a 16-bit value's bits, float for a sum rounded where it is written.
// Every read is issued before the first shared store: the stores' asm carries a "memory" clobber (the compiler must
// not move shared accesses across __syncthreads), across which no load may move either, so reads interleaved with the
// stores waited for one global load at a time (each thread one load in flight, a fraction of the bandwidth).
template <typename W, int kTile, int kRows, typename Read, typename Write>
__device__ __forceinline__ void transpose_tile(unsigned base, Read read, Write write) {
  constexpr int kSteps = kTile / kRows;
  W v[kSteps];
#pragma unroll
  for (int k = 0; k < kSteps; ++k) v[k] = static_cast<W>(read(threadIdx.y + k * kRows));
#pragma unroll
  for (int k = 0; k < kSteps; ++k) {
    shared_store(base + sizeof(W) * ((threadIdx.y + k * kRows) * (kTile + 1) + threadIdx.x), v[k]);
  }
  __syncthreads();
#pragma unroll
  for (int k = 0; k < kSteps; ++k) shared_load(base + sizeof(W) * (threadIdx.x * (kTile + 1) + threadIdx.y + k * kRows), v[k]);
#pragma unroll
  for (int k = 0; k < kSteps; ++k) write(threadIdx.y + k * kRows, v[k]);
  __syncthreads();  // (the tile is refilled by the next call)
}

// A value of T from its bits (the wide tiles below, and group_norm_silu.cu's, hold 16-bit values as their words).
template <typename T>
__device__ __forceinline__ T from_bits(unsigned short bits);
template <>
__device__ __forceinline__ __nv_bfloat16 from_bits<__nv_bfloat16>(unsigned short bits) {
  return __ushort_as_bfloat16(bits);
}
template <>
__device__ __forceinline__ __half from_bits<__half>(unsigned short bits) {
  return __ushort_as_half(bits);
}

// A kRows x kCols tile of 16-bit values moved through shared memory by kThreads threads (threadIdx.x), 16 bytes at a
// time both ways: the wide form of transpose_tile, for the transposing copies whose rows are whole 16-byte vectors
// (causal_pad.cu's channels-last buffer, conv_bias.cu's bias_contiguous). Thread t's vector j (i = t + kThreads * j):
//   load(j, r, c)        the 8 values of source row r, columns c .. c + 7 (c = 8 * (i % (kCols / 8)), r = i / that):
//                        a 16-byte load along the source's unit stride, as a Pack<T> (zeros where there is none);
//   convert(j, p)        p as the tile holds it (the values the copy writes; every load is issued before the first);
//   store(j, c, r, p)    the 8 values of tile column c, rows r .. r + 7 (r = 8 * (i % (kRows / 8)), c = i / that):
//                        a 16-byte store along the destination's unit stride.
// A tile row is kCols + 2 values (kCols / 2 + 1 words): the converts' 4-byte shared stores of a warp (4 rows of 8
// vectors at kCols 64, 8 rows of 4 at kCols 32) hit distinct banks or two ways; the stores' 2-byte reads likewise.
// `base`: the shared address (shared_window, or shared_address) of kRows * (kCols + 2) 16-bit values. The tile is free
// again on return.
template <typename T, int kRows, int kCols, int kThreads, typename Load, typename Convert, typename Store>
__device__ __forceinline__ void transpose_tile_wide(unsigned base, Load load, Convert convert, Store store) {
  using P = Pack<T>;
  static_assert(P::kSize == 8, "16-bit values");
  constexpr int kStride = kCols + 2;
  constexpr int kVecs = kRows * kCols / 8 / kThreads;
  static_assert(kRows % 8 == 0 && kCols % 8 == 0 && kVecs * 8 * kThreads == kRows * kCols, "whole vectors a thread");
  P v[kVecs];
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + kThreads * j;
    v[j] = load(j, i / (kCols / 8), 8 * (i % (kCols / 8)));
  }
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + kThreads * j;
    const P p = convert(j, v[j]);
    const unsigned row = base + 2u * static_cast<unsigned>((i / (kCols / 8)) * kStride + 8 * (i % (kCols / 8)));
    shared_store_at<0>(row, pair_word(p, 0));
    shared_store_at<4>(row, pair_word(p, 2));
    shared_store_at<8>(row, pair_word(p, 4));
    shared_store_at<12>(row, pair_word(p, 6));
  }
  __syncthreads();
#pragma unroll
  for (int j = 0; j < kVecs; ++j) {
    const int i = threadIdx.x + kThreads * j;
    const int c = i / (kRows / 8), r = 8 * (i % (kRows / 8));
    const unsigned column = base + 2u * static_cast<unsigned>(r * kStride + c);
    unsigned short bits[8];
    shared_load_at<0 * 2 * kStride>(column, bits[0]);
    shared_load_at<1 * 2 * kStride>(column, bits[1]);
    shared_load_at<2 * 2 * kStride>(column, bits[2]);
    shared_load_at<3 * 2 * kStride>(column, bits[3]);
    shared_load_at<4 * 2 * kStride>(column, bits[4]);
    shared_load_at<5 * 2 * kStride>(column, bits[5]);
    shared_load_at<6 * 2 * kStride>(column, bits[6]);
    shared_load_at<7 * 2 * kStride>(column, bits[7]);
    P o;
#pragma unroll
    for (int k = 0; k < 8; ++k) o.v[k] = from_bits<T>(bits[k]);
    store(j, c, r, o);
  }
  __syncthreads();  // (the tile is refilled by the next call)
}

// An 8- or 16-byte vector (Quad, Pack, float4) read through the read-only data path (ld.global.nc), for inputs that no
// thread of the kernel writes (or only the thread that read them, after reading). The row kernels whose operands went
// through it ran faster on the H200 (rotary.cu, layernorm_scale_shift.cu); the values are the same bytes.
template <int kBytes>
struct ReadonlyRaw;
template <>
struct ReadonlyRaw<8> {
  using type = uint2;
};
template <>
struct ReadonlyRaw<16> {
  using type = uint4;
};

template <typename V>
__device__ __forceinline__ V load_readonly(const V* p) {
  using Raw = typename ReadonlyRaw<sizeof(V)>::type;
  union {
    Raw raw;
    V value;
  } u;
  u.raw = __ldg(reinterpret_cast<const Raw*>(p));
  return u.value;
}

// diffusers' real-form rotary embedding of one pair (a, b) = (x[2i], x[2i+1]), written as T: apply_rotary_emb's
// `(x.float() * cos + x_rotated.float() * sin).to(T)`, each product and the sum a separate fp32 kernel in eager
// (csrc/rotary.cu; the kRopeReal epilogue of csrc/rmsnorm_scale_shift.cu).
template <typename T>
__device__ __forceinline__ void rotate_pair(float a, float b, float c0, float c1, float s0, float s1, T& out0, T& out1) {
  out0 = Storage<T>::store(__fadd_rn(__fmul_rn(a, c0), __fmul_rn(-b, s0)));
  out1 = Storage<T>::store(__fadd_rn(__fmul_rn(b, c1), __fmul_rn(a, s1)));
}

#ifndef __CUDACC_RTC__
// Host only (NVRTC compiles the device code alone; ops/_nvrtc.py's row_grid is the Python twin of this one).
// The launch shape of the row kernels (modulate, gated residual, gelu_cat): blocks of `threads` threads, `tx` of
// them across a row's 16-byte vectors and `threads / tx` rows, each thread keeping `rows_in_flight` rows' loads in
// flight; the grid covers a row's vectors in x and, in y, at most about `blocks_per_sm` resident blocks per SM (a
// grid stride covers the remaining rows).
struct RowGrid {
  dim3 grid;
  dim3 block;
};

inline int num_sms() {
  int device = 0, count = 0;
  if (cudaGetDevice(&device) != cudaSuccess) return 132;
  static int cached[64] = {0};
  if (device < 64 && cached[device]) return cached[device];
  if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) count = 132;
  if (device < 64) cached[device] = count;
  return count;
}

inline RowGrid row_grid(int64_t rows, int32_t vecs_per_row, int threads, int rows_in_flight, int blocks_per_sm = 8) {
  const int tx = vecs_per_row < 128 ? vecs_per_row : 128;
  const int ty = threads / tx;
  const int64_t grid_x = (vecs_per_row + tx - 1) / tx;
  const int64_t rows_per_block = static_cast<int64_t>(ty) * rows_in_flight;
  int64_t grid_y = (rows + rows_per_block - 1) / rows_per_block;
  const int64_t cap_y = (static_cast<int64_t>(num_sms()) * blocks_per_sm + grid_x - 1) / grid_x;
  if (grid_y > cap_y) grid_y = cap_y;
  if (grid_y > 65535) grid_y = 65535;
  return {dim3(static_cast<unsigned>(grid_x), static_cast<unsigned>(grid_y)), dim3(tx, ty)};
}

// A one-dimensional grid-stride launch over `vecs` vectors: a thread per vector in blocks of `threads`, at most
// `blocks_per_sm` resident blocks per SM (the kernel's loop strides over the rest).
inline int64_t grid_stride_blocks(int64_t vecs, int threads, int blocks_per_sm) {
  const int64_t blocks = (vecs + threads - 1) / threads;
  const int64_t resident = static_cast<int64_t>(num_sms()) * blocks_per_sm;
  return blocks < resident ? blocks : resident;
}

// A one-dimensional grid-stride launch of one of a kernel's two forms over `items` work items (`vector`: its 16-byte
// vector form, else its one-element form; the kernel's __launch_bounds__ are `threads`).
template <typename Args>
cudaError_t launch_vector_or_element(void (*vector_kernel)(Args), void (*element_kernel)(Args), bool vector,
                                     int64_t items, int threads, int blocks_per_sm, const Args& a,
                                     cudaStream_t stream) {
  if (items == 0) return cudaSuccess;
  const int64_t blocks = grid_stride_blocks(items, threads, blocks_per_sm);
  (vector ? vector_kernel : element_kernel)<<<static_cast<unsigned>(blocks), threads, 0, stream>>>(a);
  return cudaGetLastError();
}

// Calls f(T{}) with T the storage type named by `dtype`: one switch for every launcher.
template <typename F>
cudaError_t dispatch_storage_type(DType dtype, F&& f) {
  switch (dtype) {
    case DType::kHalf:
      return f(__half{});
    case DType::kBFloat16:
      return f(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// dispatch_storage_type and fp32: for the VAEs' copies, bias adds and norms, which an fp32 VAE runs too.
template <typename F>
cudaError_t dispatch_storage_or_float(DType dtype, F&& f) {
  if (dtype == DType::kFloat32) return f(float{});
  return dispatch_storage_type(dtype, f);
}
#endif  // __CUDACC_RTC__

}  // namespace diffusers_fastpath
