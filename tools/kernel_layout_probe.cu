// Layouts of two fused kernels, each doing the production kernel's operations in the same order (so every variant
// must be torch.equal to eager), for tools/kernel_layout_probe.py to time against a device-to-device copy:
// - rotary_norm_v: FLUX's per-head RMSNorm + rotary + text/image concatenation (csrc/rotary.cu) with kWarps warps a
//   row and kLanes lanes a head (32: four elements and 8-byte loads each; 16: eight elements and 16-byte loads, the
//   shuffle tree over 16 lanes of two partial sums that reproduces aten's 32-lane tree). csrc/rotary.cu's
//   head_norm_rotary_kernel is variant 1 (four warps, 32 lanes, six slots).
// - ln_a / ln_b: csrc/layernorm_scale_shift.cu's LayerNorm + modulate, aten's (32, 4) thread layout with launch
//   bounds forcing more resident rows (ln_a), or 64 threads a row each playing two adjacent aten threads with 16-byte
//   loads (ln_b: the Welford shuffle tree over 16 lanes, then the pair, then aten's cross-warp order).
// - ln_c: the production layout, persistent, the next row's loads in registers while the current row reduces.
// PROBE_NO_TORCH compiles the kernels alone (nvcc -Xptxas=-v, for their registers).
#ifndef PROBE_NO_TORCH
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>
#endif
#include "layernorm_scale_shift.cu"  // its Welford steps (and elementwise.cuh)

using namespace diffusers_fastpath;

// ---------------------------------------------------------------- rotary with per-head norm, shared [S, D] table
template <typename T, int E>
struct alignas(E * sizeof(T)) VecT {
  T v[E];
};

// kLanes lanes per head (32: 4 elements each, 8-byte loads; 16: 8 elements each, 16-byte loads); D == 128.
template <typename T, int kWarps, int kLanes, int kSlots>
__global__ void __launch_bounds__(kWarps * 32) rotary_norm_v(
    T* __restrict__ out, const T* __restrict__ xt, int64_t t_seq, int64_t t_sb, int64_t t_ss, int64_t t_sh,
    const T* __restrict__ wt, float et, const T* __restrict__ xi, int64_t i_seq, int64_t i_sb, int64_t i_ss,
    int64_t i_sh, const T* __restrict__ wi, float ei, const float* __restrict__ cos, const float* __restrict__ sin,
    int heads) {
  constexpr int E = 128 / kLanes;
  constexpr int kHeadsPerWarp = 32 / kLanes;
  using V = VecT<T, E>;
  const int lane = threadIdx.x & 31;
  const int warp = threadIdx.x >> 5;
  const int seg = lane / kLanes;
  const int o = lane % kLanes;
  const int64_t s = blockIdx.x;
  const int64_t b = blockIdx.y;
  const bool is_txt = s < t_seq;
  const T* x_row = is_txt ? xt + b * t_sb + s * t_ss : xi + b * i_sb + (s - t_seq) * i_ss;
  const int64_t sh = is_txt ? t_sh : i_sh;
  const T* wrow = is_txt ? wt : wi;
  const float eps = is_txt ? et : ei;
  const int64_t seq = t_seq + i_seq;
  T* out_row = out + (b * seq + s) * heads * 128;
  float c[E], sn[E], w[E];
#pragma unroll
  for (int q = 0; q < E / 4; ++q) {
    const float4 cc = reinterpret_cast<const float4*>(cos + s * 128)[o * (E / 4) + q];
    const float4 ss = reinterpret_cast<const float4*>(sin + s * 128)[o * (E / 4) + q];
    c[4 * q] = cc.x; c[4 * q + 1] = cc.y; c[4 * q + 2] = cc.z; c[4 * q + 3] = cc.w;
    sn[4 * q] = ss.x; sn[4 * q + 1] = ss.y; sn[4 * q + 2] = ss.z; sn[4 * q + 3] = ss.w;
  }
  {
    const V wv = reinterpret_cast<const V*>(wrow)[o];
#pragma unroll
    for (int j = 0; j < E; ++j) w[j] = Storage<T>::load(wv.v[j]);
  }
  V xin[kSlots];
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int h = (i * kWarps + warp) * kHeadsPerWarp + seg;
    if (h < heads) xin[i] = reinterpret_cast<const V*>(x_row + h * sh)[o];
  }
#pragma unroll
  for (int i = 0; i < kSlots; ++i) {
    const int h = (i * kWarps + warp) * kHeadsPerWarp + seg;
    if ((i * kWarps + warp) * kHeadsPerWarp >= heads) break;  // warp-uniform
    float v[E];
#pragma unroll
    for (int j = 0; j < E; ++j) v[j] = Storage<T>::load(xin[i].v[j]);
    float part[E / 4];
#pragma unroll
    for (int q = 0; q < E / 4; ++q) {
      float acc = 0.f;
#pragma unroll
      for (int j = 0; j < 4; ++j) acc = __fmaf_rn(v[4 * q + j], v[4 * q + j], acc);
      part[q] = acc;
    }
    float total;
    if (E == 4) {
      float acc = part[0];
#pragma unroll
      for (int off = 16; off > 0; off >>= 1) acc = __fadd_rn(acc, __shfl_down_sync(0xffffffffu, acc, off));
      total = __shfl_sync(0xffffffffu, acc, 0);
    } else {
      float a0 = part[0], a1 = part[E / 4 - 1];
#pragma unroll
      for (int off = 8; off > 0; off >>= 1) {
        a0 = __fadd_rn(a0, __shfl_down_sync(0xffffffffu, a0, off, 16));
        a1 = __fadd_rn(a1, __shfl_down_sync(0xffffffffu, a1, off, 16));
      }
      total = __shfl_sync(0xffffffffu, __fadd_rn(a0, a1), 0, 16);
    }
    const float rstd = rsqrtf(__fadd_rn(__fdiv_rn(total, 128.0f), eps));
    V r;
#pragma unroll
    for (int j = 0; j < E; j += 2) {
      const float y0 = round_to<T>(__fmul_rn(w[j], __fmul_rn(rstd, v[j])));
      const float y1 = round_to<T>(__fmul_rn(w[j + 1], __fmul_rn(rstd, v[j + 1])));
      rotate_pair<T>(y0, y1, c[j], c[j + 1], sn[j], sn[j + 1], r.v[j], r.v[j + 1]);
    }
    if (h < heads) reinterpret_cast<V*>(out_row + h * 128)[o] = r;
  }
}

#ifndef PROBE_NO_TORCH
template <int kWarps, int kLanes>
void launch_rotary_v(torch::Tensor out, torch::Tensor xt, torch::Tensor wt, double et, torch::Tensor xi,
                     torch::Tensor wi, double ei, torch::Tensor cos, torch::Tensor sin) {
  const int heads = xi.size(2);
  const int hpw = 32 / kLanes;
  const int per_slot = kWarps * hpw;
  const int slots = (heads + per_slot - 1) / per_slot;
  const dim3 grid(xt.size(1) + xi.size(1), xi.size(0));
  auto stream = at::cuda::getCurrentCUDAStream();
  using T = __nv_bfloat16;
  auto p = [](torch::Tensor t) { return reinterpret_cast<const T*>(t.data_ptr()); };
#define LAUNCH_SLOTS(S)                                                                                      \
  rotary_norm_v<T, kWarps, kLanes, S><<<grid, kWarps * 32, 0, stream>>>(                                     \
      reinterpret_cast<T*>(out.data_ptr()), p(xt), xt.size(1), xt.stride(0), xt.stride(1), xt.stride(2), p(wt), \
      (float)et, p(xi), xi.size(1), xi.stride(0), xi.stride(1), xi.stride(2), p(wi), (float)ei,              \
      cos.data_ptr<float>(), sin.data_ptr<float>(), heads)
  switch (slots) {
    case 1: LAUNCH_SLOTS(1); break;
    case 2: LAUNCH_SLOTS(2); break;
    case 3: LAUNCH_SLOTS(3); break;
    case 4: LAUNCH_SLOTS(4); break;
    case 6: LAUNCH_SLOTS(6); break;
    case 12: LAUNCH_SLOTS(12); break;
    default: TORCH_CHECK(false, "slots ", slots);
  }
#undef LAUNCH_SLOTS
}

void rotary_variant(int variant, torch::Tensor out, torch::Tensor xt, torch::Tensor wt, double et, torch::Tensor xi,
                    torch::Tensor wi, double ei, torch::Tensor cos, torch::Tensor sin) {
  switch (variant) {
    case 0: launch_rotary_v<8, 32>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 1: launch_rotary_v<4, 32>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 2: launch_rotary_v<2, 32>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 3: launch_rotary_v<6, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 4: launch_rotary_v<4, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 5: launch_rotary_v<3, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 6: launch_rotary_v<2, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 7: launch_rotary_v<1, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    case 8: launch_rotary_v<12, 16>(out, xt, wt, et, xi, wi, ei, cos, sin); break;
    default: TORCH_CHECK(false, "variant");
  }
}

#endif
// ---------------------------------------------------------------- layernorm + modulate (bf16 scale/shift)
// the production kernel's Welford steps (variant 0: aten's, as nvcc 13 contracts them)
__device__ __forceinline__ Welford upd(float x, const Welford& w, int n) { return online_update(x, w, n, 0); }
__device__ __forceinline__ Welford comb(const Welford& own, const Welford& other) { return combine(own, other, 0); }

__device__ __forceinline__ Welford shfl_w(const Welford& w, int off, int width) {
  return {__shfl_down_sync(0xffffffffu, w.mean, off, width), __shfl_down_sync(0xffffffffu, w.m2, off, width),
          __shfl_down_sync(0xffffffffu, w.count, off, width)};
}

template <typename T>
__device__ __forceinline__ T mod1(float xv, float mean, float rstd, float s, float h) {
  const float y = round_to<T>(__fmul_rn(rstd, __fsub_rn(xv, mean)));
  const float ops = round_to<T>(__fadd_rn(s, 1.0f));
  const float scaled = round_to<T>(__fmul_rn(y, ops));
  return Storage<T>::store(__fadd_rn(scaled, h));
}

// One row of aten's (32, 4) layout, its vectors already in `data`: the statistics in aten's order, then normalise,
// modulate and write (ln_a and ln_c).
template <typename T, int kKv>
__device__ __forceinline__ void ln_row(const VecT<T, 4> (&data)[kKv], int64_t row, T* __restrict__ out,
                                       const T* __restrict__ scale, const T* __restrict__ shift, int64_t seq,
                                       int64_t sbs, int64_t hbs, int dim, float eps, float (&partial)[3][2],
                                       float (&stats)[2]) {
  using Q = VecT<T, 4>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, thread = threadIdx.x;
  const int vecs = dim / 4;
  Welford w{0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    if (thread + k * 128 < vecs) {
#pragma unroll
      for (int j = 0; j < 4; ++j) w = upd(Storage<T>::load(data[k].v[j]), w, 4 * k + j + 1);
    }
  }
#pragma unroll
  for (int off = 16; off > 0; off >>= 1) w = comb(w, shfl_w(w, off, 32));
#pragma unroll
  for (int offset = 2; offset > 0; offset /= 2) {
    if (lane == 0 && warp >= offset && warp < 2 * offset) {
      partial[0][warp - offset] = w.mean; partial[1][warp - offset] = w.m2; partial[2][warp - offset] = w.count;
    }
    __syncthreads();
    if (lane == 0 && warp < offset) w = comb(w, Welford{partial[0][warp], partial[1][warp], partial[2][warp]});
    __syncthreads();
  }
  if (thread == 0) { stats[0] = w.mean; stats[1] = __fdiv_rn(w.m2, static_cast<float>(dim)); }
  __syncthreads();
  const float mean = stats[0];
  const float rstd = rsqrtf(__fadd_rn(stats[1], eps));
  const int64_t b = row / seq;
  const Q* sc = reinterpret_cast<const Q*>(scale + b * sbs);
  const Q* sh = reinterpret_cast<const Q*>(shift + b * hbs);
  Q* o = reinterpret_cast<Q*>(out + row * dim);
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    const int i = thread + k * 128;
    if (i < vecs) {
      const Q s = load_readonly(sc + i), h = load_readonly(sh + i);
      Q r;
#pragma unroll
      for (int j = 0; j < 4; ++j)
        r.v[j] = mod1<T>(Storage<T>::load(data[k].v[j]), mean, rstd, Storage<T>::load(s.v[j]), Storage<T>::load(h.v[j]));
      o[i] = r;
    }
  }
}

// Row `row`'s vectors of aten thread threadIdx.x into `d`.
template <typename T, int kKv>
__device__ __forceinline__ void ln_load(VecT<T, 4> (&d)[kKv], const T* __restrict__ x, int64_t row, int dim) {
  const VecT<T, 4>* xr = reinterpret_cast<const VecT<T, 4>*>(x + row * dim);
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    const int i = threadIdx.x + k * 128;
    if (i < dim / 4) d[k] = load_readonly(xr + i);
  }
}

// (a) the production layout (one aten thread per thread, (32, 4) block) with launch bounds (128, kMinBlocks)
template <typename T, int kKv, int kMinBlocks>
__global__ void __launch_bounds__(128, kMinBlocks) ln_a(T* __restrict__ out, const T* __restrict__ x,
                                                      const T* __restrict__ scale, const T* __restrict__ shift,
                                                      int64_t seq, int64_t sbs, int64_t hbs, int dim, float eps) {
  __shared__ float partial[3][2];
  __shared__ float stats[2];
  VecT<T, 4> data[kKv];
  ln_load<T, kKv>(data, x, blockIdx.x, dim);
  ln_row<T, kKv>(data, blockIdx.x, out, scale, shift, seq, sbs, hbs, dim, eps, partial, stats);
}

// (b) 64 threads per row, each thread two adjacent aten threads (2j, 2j + 1): 16-byte loads; lanes 0-15 of warp W
// are aten warp 2W, lanes 16-31 aten warp 2W + 1. kRows rows per block (2 warps each).
template <typename T, int kKv, int kRows>
__global__ void __launch_bounds__(64 * kRows) ln_b(T* __restrict__ out, const T* __restrict__ x,
                                                  const T* __restrict__ scale, const T* __restrict__ shift,
                                                  int64_t rows, int64_t seq, int64_t sbs, int64_t hbs, int dim,
                                                  float eps) {
  using P = VecT<T, 8>;
  __shared__ float partial[kRows][3][2];
  __shared__ float stats[kRows][2];
  const int r = threadIdx.x / 64;
  const int j = threadIdx.x % 64;
  const int lane = j & 31, warp = j >> 5, seg = lane >> 4;
  const int64_t row = blockIdx.x * static_cast<int64_t>(kRows) + r;
  const bool live = row < rows;
  const int pairs = dim / 8;
  const P* xr = reinterpret_cast<const P*>(x + (live ? row : 0) * dim);
  P data[kKv];
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    const int i = j + k * 64;
    if (live && i < pairs) data[k] = xr[i];
  }
  Welford wa{0.f, 0.f, 0.f}, wb{0.f, 0.f, 0.f};
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    if (j + k * 64 < pairs) {
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        wa = upd(Storage<T>::load(data[k].v[q]), wa, 4 * k + q + 1);
        wb = upd(Storage<T>::load(data[k].v[4 + q]), wb, 4 * k + q + 1);
      }
    }
  }
#pragma unroll
  for (int off = 8; off > 0; off >>= 1) {
    wa = comb(wa, shfl_w(wa, off, 16));
    wb = comb(wb, shfl_w(wb, off, 16));
  }
  Welford w = comb(wa, wb);  // aten lane 0 of aten warp 2 * warp + seg, own, with aten lane 1
  // aten's shared-memory step offset 2: aten warps 2, 3 (my warp 1, seg 0 / 1) into aten warps 0, 1 (my warp 0)
  if (warp == 1 && (lane & 15) == 0) {
    partial[r][0][seg] = w.mean; partial[r][1][seg] = w.m2; partial[r][2][seg] = w.count;
  }
  __syncthreads();
  if (warp == 0 && (lane & 15) == 0) w = comb(w, Welford{partial[r][0][seg], partial[r][1][seg], partial[r][2][seg]});
  // offset 1: aten warp 1 (my warp 0, lane 16) into aten warp 0 (my warp 0, lane 0)
  const Welford other = shfl_w(w, 16, 32);
  if (warp == 0 && lane == 0) {
    w = comb(w, other);
    stats[r][0] = w.mean;
    stats[r][1] = __fdiv_rn(w.m2, static_cast<float>(dim));
  }
  __syncthreads();
  if (!live) return;
  const float mean = stats[r][0];
  const float rstd = rsqrtf(__fadd_rn(stats[r][1], eps));
  const int64_t b = row / seq;
  const P* sc = reinterpret_cast<const P*>(scale + b * sbs);
  const P* sh = reinterpret_cast<const P*>(shift + b * hbs);
  P* o = reinterpret_cast<P*>(out + row * dim);
#pragma unroll
  for (int k = 0; k < kKv; ++k) {
    const int i = j + k * 64;
    if (i < pairs) {
      const P s = sc[i], h = sh[i];
      P res;
#pragma unroll
      for (int q = 0; q < 8; ++q)
        res.v[q] = mod1<T>(Storage<T>::load(data[k].v[q]), mean, rstd, Storage<T>::load(s.v[q]), Storage<T>::load(h.v[q]));
      o[i] = res;
    }
  }
}

// (c) aten's (32, 4) layout, persistent: gridDim.x blocks walk the rows (row, row + gridDim.x, ...), each holding the
// next row's loads in registers (a double buffer) while it reduces and writes the current one.
template <typename T, int kKv, int kMinBlocks>
__global__ void __launch_bounds__(128, kMinBlocks) ln_c(T* __restrict__ out, const T* __restrict__ x,
                                                      const T* __restrict__ scale, const T* __restrict__ shift,
                                                      int64_t rows, int64_t seq, int64_t sbs, int64_t hbs, int dim,
                                                      float eps) {
  __shared__ float partial[3][2];
  __shared__ float stats[2];
  VecT<T, 4> cur[kKv], nxt[kKv];
  int64_t row = blockIdx.x;
  if (row < rows) ln_load<T, kKv>(cur, x, row, dim);
  for (; row < rows; row += gridDim.x) {
    if (row + gridDim.x < rows) ln_load<T, kKv>(nxt, x, row + gridDim.x, dim);
    ln_row<T, kKv>(cur, row, out, scale, shift, seq, sbs, hbs, dim, eps, partial, stats);
#pragma unroll
    for (int k = 0; k < kKv; ++k) cur[k] = nxt[k];
  }
}

#ifndef PROBE_NO_TORCH
void ln_variant(int variant, torch::Tensor out, torch::Tensor x, torch::Tensor scale, torch::Tensor shift,
                double eps) {
  using T = __nv_bfloat16;
  const int64_t rows = x.size(0) * x.size(1);
  const int dim = x.size(2);
  TORCH_CHECK(dim == 3072);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto p = [](torch::Tensor t) { return reinterpret_cast<const T*>(t.data_ptr()); };
  T* o = reinterpret_cast<T*>(out.data_ptr());
  const int64_t seq = x.size(1);
  switch (variant) {
    case 0: ln_a<T, 6, 1><<<rows, 128, 0, stream>>>(o, p(x), p(scale), p(shift), seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 1: ln_a<T, 6, 12><<<rows, 128, 0, stream>>>(o, p(x), p(scale), p(shift), seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 2: ln_a<T, 6, 16><<<rows, 128, 0, stream>>>(o, p(x), p(scale), p(shift), seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 3: ln_b<T, 6, 1><<<rows, 64, 0, stream>>>(o, p(x), p(scale), p(shift), rows, seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 4: ln_b<T, 6, 2><<<(rows + 1) / 2, 128, 0, stream>>>(o, p(x), p(scale), p(shift), rows, seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 5: ln_b<T, 6, 4><<<(rows + 3) / 4, 256, 0, stream>>>(o, p(x), p(scale), p(shift), rows, seq, scale.stride(0), shift.stride(0), dim, (float)eps); break;
    case 6: case 7: case 8: case 9: {
      const int sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
      // 6: 8 resident blocks an SM; 7: 6; 8: four rows a block (rows / 4 blocks); 9: two rows a block
      const int64_t grid = variant == 6 ? 8 * sms : variant == 7 ? 6 * sms : variant == 8 ? (rows + 3) / 4 : (rows + 1) / 2;
      if (variant == 7) {
        ln_c<T, 6, 6><<<grid, 128, 0, stream>>>(o, p(x), p(scale), p(shift), rows, seq, scale.stride(0), shift.stride(0), dim, (float)eps);
      } else {
        ln_c<T, 6, 8><<<grid, 128, 0, stream>>>(o, p(x), p(scale), p(shift), rows, seq, scale.stride(0), shift.stride(0), dim, (float)eps);
      }
      break;
    }
    default: TORCH_CHECK(false, "variant");
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rotary_variant", &rotary_variant);
  m.def("ln_variant", &ln_variant);
}
#endif
