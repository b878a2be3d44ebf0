// A convolution's bias, added in place in one vectorised pass, bit-identical to aten's.
//
// cuDNN's convolutions take no bias: aten runs `output = at::cudnn_convolution(...)` and then
// `output.add_(reshape_bias(input.dim(), bias))` (Convolution.cpp, ConvBackend::Cudnn), a broadcast add that aten's
// elementwise kernel does not vectorise (the FLUX.1 decode's 35 convolutions: 6.6 ms of 44 on an H100; the Wan 2.1
// decode's 754: 125 ms). The add is one fp32 operation rounded to the storage dtype T (fp32: no further rounding), as here:
//   x[n, c, s] = round(float(x[n, c, s]) + float(bias[c]))        (aten's `a + alpha * b` with alpha 1: 1 * b is b)
//
// Layout: the convolution's output as cuDNN wrote it, dense, seen as [rows, cols]:
//   channels-first (NC* contiguous): rows = N * C planes of cols = S spatial elements, bias[row % C] for the row;
//   channels-last (N*C contiguous):  rows = N * S positions of cols = C channels, bias[col] for the column.
// kVector: cols a multiple of 16 / sizeof(T) and x 16-byte aligned, each thread a 16-byte vector; else one element.
// A block takes kThreads columns (vectors or elements) of a row, the rows in turn with a grid stride.
//
// bias_contiguous: a channels-last output (cuDNN's, for a channels-last input) with its bias added, written into a new
// contiguous tensor: the same add, and the transpose cuDNN would otherwise run after a channels-first convolution
// (its nhwcToNchw pass) in the same pass. Each block moves a kTile x kTile tile of (spatial, channel) of one sample
// through shared memory, reading along the channels (x's unit stride) and writing along the positions (out's).
//
// bias_contiguous with kResidual: the sum written with a residual added, for `h = conv(x)` read only by
// `h + residual` (LTX-2's resnets: `hidden_states + inputs` after conv2; ops/conv_bias_residual.py). Eager rounds
// twice, once per op (the bias add's result is h, stored in T; aten's add of two T tensors is one fp32 add rounded to
// T), and so does this:
//   out[n, c, s] = round(float(round(float(x[n, s, c]) + float(bias[c]))) + float(residual[n, c, s]))
// (IEEE addition commutes, so `residual + h` is the same word.) The residual is read where out is written, contiguous
// as out; each thread loads its kTile / kTileRows values before the tile's shared stores, with x's.
//
// bias_depth_to_space: a residual upsampler (LTX-Video's and LTX-2's LTX*VideoUpsampler3d, stride (2, 2, 2); the
// LTX-2 decoder's three; ops/ltx_upsampler.py) written from its convolution's channels-last output in one pass. Eager
// runs the convolution and its bias add (h, contiguous), the depth-to-space of h's 8 C' channels (a reshape, a permute:
// a copy), `[:, :, 1:]`, the depth-to-space of the input x and its `.repeat(1, 4, 1, 1, 1)` (two copies), and the add
// (one fp32 add rounded to T). The copies move values; the two roundings are the bias add's and the add's:
//   out[n, c, 2t+dt-1, 2h+dh, 2w+dw] = round(float(round(float(raw[n, t, h, w, 8c + j]) + float(bias[8c + j])))
//                                             + float(x[n, (c % groups) * 8 + j, t, h, w]))    (j = 4 dt + 2 dh + dw)
// A thread takes one (c, position): the 16-byte vector of raw's 8 channels 8c..8c+7 (the 2x2x2 outputs of c), the 8
// residual values (each channel's plane apart: the warp's columns are consecutive), and writes 4 pairs of T (dw 0 and
// 1 of each (dt, dh)), each warp 128 contiguous bytes a store. Block (kD2sWidth columns, kD2sChannels channels): the
// block's 8 warps read the 8 vectors of one position's 128 bytes. Frame t = 0's dt = 0 is the sliced-off frame -1.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // grid.y: min(rows, kMaxRowBlocks); grid.x: ceil(cols / kVec / kThreads)
constexpr int kTile = 32;             // bias_contiguous: a tile of 32 positions x 32 channels, 32 x 8 threads
constexpr int kTileRows = 8;
constexpr int kD2sWidth = 32;    // bias_depth_to_space: columns (w) a block, along threadIdx.x
constexpr int kD2sChannels = 8;  // ... and output channels, along threadIdx.y

template <typename T, bool kChannelsLast, bool kVector>
__global__ void __launch_bounds__(kThreads) conv_bias_kernel(const ConvBiasArgs a) {
  constexpr int kVec = kVector ? Pack<T>::kSize : 1;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;  // in vectors (or elements)
  if (col * kVec >= a.cols) return;
  T* x = static_cast<T*>(a.x);
  const T* bias = static_cast<const T*>(a.bias);
  float b[kVec];
  if constexpr (kChannelsLast) {  // the same channels on every row: read once
#pragma unroll
    for (int j = 0; j < kVec; ++j) b[j] = Storage<T>::load(bias[col * kVec + j]);
  }
  for (int64_t r = blockIdx.y; r < a.rows; r += gridDim.y) {
    if constexpr (!kChannelsLast) {
      const float c = Storage<T>::load(bias[r % a.channels]);
#pragma unroll
      for (int j = 0; j < kVec; ++j) b[j] = c;
    }
    if constexpr (kVector) {
      Pack<T>* p = reinterpret_cast<Pack<T>*>(x + r * a.cols) + col;
      Pack<T> v = *p;
#pragma unroll
      for (int j = 0; j < kVec; ++j) v.v[j] = Storage<T>::store(__fadd_rn(Storage<T>::load(v.v[j]), b[j]));
      *p = v;
    } else {
      T* p = x + r * a.cols + col;
      *p = Storage<T>::store(__fadd_rn(Storage<T>::load(*p), b[0]));
    }
  }
}

// The residual's element (n, c, s): contiguous, or time-major (a.residual_plane positions a frame, the channels
// outside them: [B, T, C, H * W])
__device__ __forceinline__ int64_t residual_index(const BiasContiguousArgs& a, int64_t n, int64_t c, int64_t s) {
  if (a.residual_plane == 0) return (n * a.channels + c) * a.spatial + s;
  const int64_t t = s / a.residual_plane;
  return ((n * (a.spatial / a.residual_plane) + t) * a.channels + c) * a.residual_plane + (s - t * a.residual_plane);
}

// grid (ceil(spatial / kTile), min(ceil(channels / kTile), kMaxRowBlocks), min(batch, kMaxRowBlocks)), block (kTile,
// kTileRows); the channel tiles in turn over grid.y and the samples over grid.z, each with a grid stride (grid.y and
// grid.z are at most 65535: more than 2M channels take several tiles per block).
template <typename T, bool kResidual>
__global__ void __launch_bounds__(kTile * kTileRows) bias_contiguous_kernel(const BiasContiguousArgs a) {
  constexpr int kSteps = kTile / kTileRows;  // the positions' rows a thread writes (transpose_tile's steps)
  __shared__ float tile[kTile][kTile + 1];  // [position][channel], the sums (rounded when written)
  const unsigned base = shared_address(&tile[0][0]);
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kTile;
  const T* x = static_cast<const T*>(a.x);
  const T* bias = static_cast<const T*>(a.bias);
  const T* residual = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.out);
  const int64_t s_write = s0 + threadIdx.x;
  for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kTile; c0 < a.channels;
       c0 += static_cast<int64_t>(gridDim.y) * kTile) {  // (bounds uniform over the block: __syncthreads is safe)
    const int64_t c_read = c0 + threadIdx.x;
    const float b = c_read < a.channels ? Storage<T>::load(bias[c_read]) : 0.0f;
    for (int64_t n = blockIdx.z; n < a.batch; n += gridDim.z) {
      // kResidual: the residual at the positions this thread writes (channel c0 + threadIdx.y + k * kTileRows of
      // step k), loaded ahead of x's values (all in flight together: the tile's shared stores order what follows)
      float res[kSteps];
      if constexpr (kResidual) {
#pragma unroll
        for (int k = 0; k < kSteps; ++k) {
          const int64_t c = c0 + threadIdx.y + k * kTileRows;
          res[k] = c < a.channels && s_write < a.spatial
                       ? Storage<T>::load(residual[residual_index(a, n, c, s_write)])
                       : 0.0f;
        }
      }
      transpose_tile<float, kTile, kTileRows>(
          base,
          [&](unsigned i) -> float {
            const int64_t s = s0 + i;
            return s < a.spatial && c_read < a.channels
                       ? __fadd_rn(Storage<T>::load(x[(n * a.spatial + s) * a.channels + c_read]), b)
                       : 0.0f;
          },
          [&](unsigned i, float v) {  // (i = threadIdx.y + k * kTileRows of step k, unrolled: res[k] a register)
            const int64_t c = c0 + i;
            if (c < a.channels && s_write < a.spatial) {
              if constexpr (kResidual) v = __fadd_rn(round_to<T>(v), res[(i - threadIdx.y) / kTileRows]);
              out[(n * a.channels + c) * a.spatial + s_write] = Storage<T>::store(v);
            }
          });
    }
  }
}

// The wide bias_contiguous: the same values (and with kResidual the same second rounding), moved 16 bytes at a time
// both ways (elementwise.cuh's transpose_tile_wide), where every vector is whole: 16-bit values, channels and spatial
// multiples of 8, x and the residual 16-byte aligned (wide_fits below; ops/conv_bias.py's wide_fits its twin). A block
// moves a tile of kWidePositions positions x kWideChannels channels of one sample: each thread loads two 16-byte
// vectors (8 channels of one position), adds their biases and rounds to T (aten's add), and stores two (8 positions of
// one channel, with kResidual each the residual's vector at that place added to it and rounded: loaded before the
// tile's shared stores). grid (ceil(spatial / kWidePositions), min(ceil(C / kWideChannels), 65535), min(batch, 65535)),
// block kWideThreads, the channel tiles and samples with grid strides as bias_contiguous_kernel's.
constexpr int kWidePositions = 64;
constexpr int kWideChannels = 32;
constexpr int kWideThreads = 128;
constexpr int kWideVecs = kWidePositions * kWideChannels / 8 / kWideThreads;  // 16-byte vectors a thread moves

template <typename T, bool kResidual>
__global__ void __launch_bounds__(kWideThreads) bias_contiguous_wide_kernel(const BiasContiguousArgs a) {
  using P = Pack<T>;
  __shared__ __align__(16) unsigned short tile[kWidePositions * (kWideChannels + 2)];  // [position][channel]
  const unsigned base = shared_window(&tile[0]);
  const int64_t s0 = static_cast<int64_t>(blockIdx.x) * kWidePositions;
  const T* x = static_cast<const T*>(a.x);
  const T* bias = static_cast<const T*>(a.bias);
  const T* residual = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.out);
  // the channels this thread loads: 8 * (i % 4) of the tile for every vector i = threadIdx.x + kWideThreads * j
  // (kWideThreads a multiple of kWideChannels / 8); the positions of its stores: 8 * (i % 8) of the tile's, of channel
  // i / 8 (transpose_tile_wide's order)
  static_assert(kWideThreads % (kWideChannels / 8) == 0, "one channel vector a thread");
  const int cl_load = 8 * (threadIdx.x % (kWideChannels / 8));
  for (int64_t c0 = static_cast<int64_t>(blockIdx.y) * kWideChannels; c0 < a.channels;
       c0 += static_cast<int64_t>(gridDim.y) * kWideChannels) {  // (uniform over the block: __syncthreads is safe)
    float b[8];
#pragma unroll
    for (int k = 0; k < 8; ++k) b[k] = c0 + cl_load + k < a.channels ? Storage<T>::load(bias[c0 + cl_load + k]) : 0.0f;
    for (int64_t n = blockIdx.z; n < a.batch; n += gridDim.z) {
      P res[kWideVecs];  // kResidual: the residual where this thread stores
      if constexpr (kResidual) {
#pragma unroll
        for (int j = 0; j < kWideVecs; ++j) {
          const int i = threadIdx.x + kWideThreads * j;
          const int64_t c = c0 + i / (kWidePositions / 8), s = s0 + 8 * (i % (kWidePositions / 8));
          res[j] = c < a.channels && s < a.spatial
                       ? load_readonly(reinterpret_cast<const P*>(residual + residual_index(a, n, c, s)))
                       : P{};
        }
      }
      transpose_tile_wide<T, kWidePositions, kWideChannels, kWideThreads>(
          base,
          [&](int, int sl, int cl) -> P {  // position s0 + sl, channels c0 + cl .. + 7
            const int64_t s = s0 + sl, c = c0 + cl;
            return s < a.spatial && c < a.channels
                       ? load_readonly(reinterpret_cast<const P*>(x + (n * a.spatial + s) * a.channels + c))
                       : P{};
          },
          [&](int, P p) -> P {  // (the channels of every vector of this thread: cl_load's)
#pragma unroll
            for (int k = 0; k < 8; ++k) p.v[k] = Storage<T>::store(__fadd_rn(Storage<T>::load(p.v[k]), b[k]));
            return p;
          },
          [&](int j, int cl, int sl, P p) {  // channel c0 + cl, positions s0 + sl .. + 7
            const int64_t c = c0 + cl, s = s0 + sl;
            if (c >= a.channels || s >= a.spatial) return;
            if constexpr (kResidual) {
#pragma unroll
              for (int k = 0; k < 8; ++k) {
                p.v[k] = Storage<T>::store(__fadd_rn(Storage<T>::load(p.v[k]), Storage<T>::load(res[j].v[k])));
              }
            }
            store_pack(out + (n * a.channels + c) * a.spatial + s, p);
          });
    }
  }
}

// grid (ceil(width / kD2sWidth) * ceil(channels / kD2sChannels), min(batch * frames * height, kMaxRowBlocks)), block
// (kD2sWidth, kD2sChannels); the rows (n, t, h) in turn over grid.y with a grid stride.
template <typename T>
__global__ void __launch_bounds__(kD2sWidth * kD2sChannels) bias_depth_to_space_kernel(const BiasDepthToSpaceArgs a) {
  struct alignas(4) Two {
    T v[2];
  };
  const int64_t wtiles = (a.width + kD2sWidth - 1) / kD2sWidth;
  const int64_t w = (blockIdx.x % wtiles) * kD2sWidth + threadIdx.x;
  const int64_t c = (blockIdx.x / wtiles) * kD2sChannels + threadIdx.y;
  if (w >= a.width || c >= a.channels) return;
  const T* bias = static_cast<const T*>(a.bias) + c * 8;
  float b[8];
#pragma unroll
  for (int j = 0; j < 8; ++j) b[j] = Storage<T>::load(bias[j]);
  const Pack<T>* x = reinterpret_cast<const Pack<T>*>(a.x);
  const T* residual = static_cast<const T*>(a.residual);
  T* out = static_cast<T*>(a.out);
  const int64_t plane = a.frames * a.height * a.width;  // the residual's channel stride
  const int64_t out_w = 2 * a.width, out_plane = 2 * a.height * out_w, out_frames = 2 * a.frames - 1;
  const int64_t rows = a.batch * a.frames * a.height;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t h = r % a.height, t = (r / a.height) % a.frames, n = r / (a.height * a.frames);
    const Pack<T> v = x[(r * a.width + w) * a.channels + c];  // (position r * width + w, channels 8c..8c+7)
    const T* res = residual + (((n * a.groups + c % a.groups) * 8 * a.frames + t) * a.height + h) * a.width + w;
    // (the output frame 2t - 1 of dt = 0: an index, of frame -1 only where that pair is not written)
    const int64_t o = ((n * a.channels + c) * out_frames + 2 * t - 1) * out_plane + 2 * h * out_w + 2 * w;
#pragma unroll
    for (int dt = 0; dt < 2; ++dt) {
      if (dt == 0 && t == 0) continue;  // (frame -1: sliced off)
#pragma unroll
      for (int dh = 0; dh < 2; ++dh) {
        Two pair;
#pragma unroll
        for (int dw = 0; dw < 2; ++dw) {
          const int j = dt * 4 + dh * 2 + dw;
          const float h_value = round_to<T>(__fadd_rn(Storage<T>::load(v.v[j]), b[j]));
          pair.v[dw] = Storage<T>::store(__fadd_rn(h_value, Storage<T>::load(res[j * plane])));
        }
        *reinterpret_cast<Two*>(out + o + dt * out_plane + dh * out_w) = pair;
      }
    }
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch_depth_to_space(const BiasDepthToSpaceArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.channels == 0 || a.frames == 0 || a.height == 0 || a.width == 0) return cudaSuccess;
  if (a.batch < 0 || a.channels < 0 || a.groups <= 0 || a.frames < 0 || a.height < 0 || a.width < 0 ||
      reinterpret_cast<uintptr_t>(a.x) % 16 != 0) {
    return cudaErrorInvalidValue;
  }
  const int64_t tiles = (a.width + kD2sWidth - 1) / kD2sWidth * ((a.channels + kD2sChannels - 1) / kD2sChannels);
  const int64_t rows = a.batch * a.frames * a.height;
  if (tiles > 0x7fffffff) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>(tiles), static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks));
  bias_depth_to_space_kernel<T><<<grid, dim3(kD2sWidth, kD2sChannels), 0, stream>>>(a);
  return cudaGetLastError();
}

// The wide kernel's inputs (16-bit values: the caller's dtype): whole 16-byte vectors of x, the residual and out at
// every position and channel (a time-major residual's vectors inside one frame's plane); ops/conv_bias.py's wide_fits
// is its Python twin.
bool wide_fits(const BiasContiguousArgs& a) {
  const auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  return a.channels % 8 == 0 && a.spatial % 8 == 0 && aligned(a.x) && aligned(a.out) &&
         (a.residual == nullptr || (aligned(a.residual) && a.residual_plane % 8 == 0));
}

// bias_contiguous's grids: the positions in tiles of `position_tile`, the channels in tiles of `channel_tile`, the
// samples
dim3 contiguous_grid(const BiasContiguousArgs& a, int position_tile, int channel_tile) {
  const int64_t ctiles = (a.channels + channel_tile - 1) / channel_tile;
  return dim3(static_cast<unsigned>((a.spatial + position_tile - 1) / position_tile),
              static_cast<unsigned>(ctiles < kMaxRowBlocks ? ctiles : kMaxRowBlocks),
              static_cast<unsigned>(a.batch < kMaxRowBlocks ? a.batch : kMaxRowBlocks));
}

template <typename T>
cudaError_t launch_contiguous(const BiasContiguousArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.spatial == 0 || a.channels == 0) return cudaSuccess;
  if (a.batch < 0 || a.spatial < 0 || a.channels < 0) return cudaErrorInvalidValue;
  if constexpr (sizeof(T) == 2) {
    if (wide_fits(a)) {
      if ((a.spatial + kWidePositions - 1) / kWidePositions > 0x7fffffff) return cudaErrorInvalidValue;
      const dim3 grid = contiguous_grid(a, kWidePositions, kWideChannels);
      if (a.residual != nullptr) {
        bias_contiguous_wide_kernel<T, true><<<grid, kWideThreads, 0, stream>>>(a);
      } else {
        bias_contiguous_wide_kernel<T, false><<<grid, kWideThreads, 0, stream>>>(a);
      }
      return cudaGetLastError();
    }
  }
  const dim3 grid = contiguous_grid(a, kTile, kTile);
  if (a.residual != nullptr) {
    bias_contiguous_kernel<T, true><<<grid, dim3(kTile, kTileRows), 0, stream>>>(a);
  } else {
    bias_contiguous_kernel<T, false><<<grid, dim3(kTile, kTileRows), 0, stream>>>(a);
  }
  return cudaGetLastError();
}

template <typename T, bool kChannelsLast, bool kVector>
cudaError_t launch_layout(const ConvBiasArgs& a, cudaStream_t stream) {
  constexpr int kVec = kVector ? Pack<T>::kSize : 1;
  const int64_t vecs = (a.cols + kVec - 1) / kVec;
  const dim3 grid(static_cast<unsigned>((vecs + kThreads - 1) / kThreads),
                  static_cast<unsigned>(a.rows < kMaxRowBlocks ? a.rows : kMaxRowBlocks));
  conv_bias_kernel<T, kChannelsLast, kVector><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch(const ConvBiasArgs& a, cudaStream_t stream) {
  if (a.rows == 0 || a.cols == 0) return cudaSuccess;
  if (a.rows < 0 || a.cols < 0 || a.channels <= 0) return cudaErrorInvalidValue;
  const bool vector = a.cols % Pack<T>::kSize == 0 && reinterpret_cast<uintptr_t>(a.x) % 16 == 0;
  if (a.channels_last) {
    return vector ? launch_layout<T, true, true>(a, stream) : launch_layout<T, true, false>(a, stream);
  }
  return vector ? launch_layout<T, false, true>(a, stream) : launch_layout<T, false, false>(a, stream);
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_conv_bias(const ConvBiasArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}

cudaError_t launch_bias_contiguous(const BiasContiguousArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch_contiguous<decltype(tag)>(args, stream); });
}

cudaError_t launch_bias_depth_to_space(const BiasDepthToSpaceArgs& args, cudaStream_t stream) {
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch_depth_to_space<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
