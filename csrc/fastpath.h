// Host-side interface between the torch bindings (bindings.cpp, compiled by the host compiler with torch's
// headers) and the CUDA kernels (*.cu, compiled by nvcc without them). Keeping torch's headers out of the .cu
// files keeps the one-time JIT build short.
#pragma once

#include <cstdint>

#include <cuda_runtime.h>

namespace diffusers_fastpath {

enum class DType : int { kHalf = 0, kBFloat16 = 1 };

// out[b, l, :] = round(round(x[b, l, :] * round(1 + scale[b, :])) + shift[b, :])
struct ModulateScaleShiftArgs {
  void* out;           // [batch, seq, dim], contiguous
  const void* x;       // [batch, seq, dim], contiguous
  const void* scale;   // [batch or 1, dim], innermost stride 1
  const void* shift;   // [batch or 1, dim], innermost stride 1
  int64_t batch;
  int64_t seq;
  int64_t dim;                 // a multiple of 16 / sizeof(element)
  int64_t scale_batch_stride;  // in elements; 0 broadcasts one row over the batch
  int64_t shift_batch_stride;
  DType dtype;
};

cudaError_t launch_modulate_scale_shift(const ModulateScaleShiftArgs& args, cudaStream_t stream);

}  // namespace diffusers_fastpath
