// A convolution's bias, added in place in one vectorised pass, bit-identical to aten's.
//
// cuDNN's convolutions take no bias: aten runs `output = at::cudnn_convolution(...)` and then
// `output.add_(reshape_bias(input.dim(), bias))` (Convolution.cpp, ConvBackend::Cudnn), a broadcast add that aten's
// elementwise kernel does not vectorise (the FLUX.1 decode's 35 convolutions: 6.6 ms of 44 on an H100; the Wan 2.1
// decode's 754: 125 ms). The add is one fp32 operation rounded to the storage dtype T, as here:
//   x[n, c, s] = round(float(x[n, c, s]) + float(bias[c]))        (aten's `a + alpha * b` with alpha 1: 1 * b is b)
//
// Layout: the convolution's output as cuDNN wrote it, dense, seen as [rows, cols]:
//   channels-first (NC* contiguous): rows = N * C planes of cols = S spatial elements, bias[row % C] for the row;
//   channels-last (N*C contiguous):  rows = N * S positions of cols = C channels, bias[col] for the column.
// kVector: cols a multiple of 16 / sizeof(T) and x 16-byte aligned, each thread a 16-byte vector; else one element.
// A block takes kThreads columns (vectors or elements) of a row, the rows in turn with a grid stride.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // grid.y: min(rows, kMaxRowBlocks); grid.x: ceil(cols / kVec / kThreads)

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

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
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
  return dispatch_storage_type(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
