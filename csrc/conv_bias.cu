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
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // grid.y: min(rows, kMaxRowBlocks); grid.x: ceil(cols / kVec / kThreads)
constexpr int kTile = 32;             // bias_contiguous: a tile of 32 positions x 32 channels, 32 x 8 threads
constexpr int kTileRows = 8;

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
                       ? Storage<T>::load(residual[(n * a.channels + c) * a.spatial + s_write])
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

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernels above (ops/_nvrtc.py launches them)
template <typename T>
cudaError_t launch_contiguous(const BiasContiguousArgs& a, cudaStream_t stream) {
  if (a.batch == 0 || a.spatial == 0 || a.channels == 0) return cudaSuccess;
  if (a.batch < 0 || a.spatial < 0 || a.channels < 0) return cudaErrorInvalidValue;
  const int64_t ctiles = (a.channels + kTile - 1) / kTile;
  const dim3 grid(static_cast<unsigned>((a.spatial + kTile - 1) / kTile),
                  static_cast<unsigned>(ctiles < kMaxRowBlocks ? ctiles : kMaxRowBlocks),
                  static_cast<unsigned>(a.batch < kMaxRowBlocks ? a.batch : kMaxRowBlocks));
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
#endif

}  // namespace diffusers_fastpath
