// The 2x nearest upsampling of Wan's and Qwen-Image's VAE decoders (diffusers' WanUpsample, QwenImageUpsample:
// nn.Upsample(scale_factor=(2.0, 2.0), mode="nearest-exact") on x.float(), the result .type_as(x)), in one pass:
//   out[n, c, 2y + dy, 2x + dx] = round(float(x[n, c, y, x]))       dy, dx in {0, 1}
// For an exact factor of 2 both nearest modes read source index floor((dst + 0.5) * 0.5) = floor(dst * 0.5) =
// dst / 2 (aten's nearest_neighbor_exact_compute_source_index / nearest_neighbor_compute_source_index with the scale
// 1 / 2.0 = 0.5 exactly). The float round trip is the one eager makes: the upcast is exact, the interpolation copies
// floats, and the cast back is the same conversion (__float2bfloat16 / __float2half on sm_80+, what c10's
// BFloat16 / Half constructors call on the device), which leaves every value as it was but for a NaN's payload and
// sign: the one rounding here does the same. Exact by construction.
//
// Layout: x a [N, C, H, W] view with unit W stride (contiguous, or the time-major [T, C, H, W] view WanResample makes
// of [C, T, H, W] memory), out a contiguous [N, C, 2H, 2W] (eager's: its upsampling writes a contiguous result for
// any such x): input row r = (n * C + c) * H + y becomes output rows 2r and 2r + 1. A block takes kThreads columns
// of a row, the rows in turn with a grid stride; each thread writes its element's 2x2 block as two pairs.
#include "elementwise.cuh"
#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

constexpr int kThreads = 256;
constexpr int kMaxRowBlocks = 65535;  // grid.y: min(rows, kMaxRowBlocks); grid.x: ceil(W / kThreads)

template <typename T>
struct alignas(2 * sizeof(T)) Two {
  T v[2];
};

template <typename T>
__global__ void __launch_bounds__(kThreads) upsample_nearest2x_kernel(const UpsampleNearestArgs a) {
  const int64_t col = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x;
  if (col >= a.width) return;
  const T* x = static_cast<const T*>(a.x);
  Two<T>* out = static_cast<Two<T>*>(a.out);  // [2 * rows, W] pairs
  const int64_t rows = a.batch * a.channels * a.height;
  for (int64_t r = blockIdx.y; r < rows; r += gridDim.y) {
    const int64_t plane = r / a.height;
    const int64_t y = r - plane * a.height;
    const int64_t n = plane / a.channels;
    const int64_t c = plane - n * a.channels;
    const T v = Storage<T>::store(Storage<T>::load(x[n * a.stride_n + c * a.stride_c + y * a.stride_h + col]));
    Two<T> pair;
    pair.v[0] = v;
    pair.v[1] = v;
    out[2 * r * a.width + col] = pair;
    out[(2 * r + 1) * a.width + col] = pair;
  }
}

#ifndef __CUDACC_RTC__  // the host launcher; NVRTC builds only the kernel above (ops/_nvrtc.py launches it)
template <typename T>
cudaError_t launch(const UpsampleNearestArgs& a, cudaStream_t stream) {
  const int64_t rows = a.batch * a.channels * a.height;
  if (rows == 0 || a.width == 0) return cudaSuccess;
  if (rows < 0 || a.width < 0) return cudaErrorInvalidValue;
  const dim3 grid(static_cast<unsigned>((a.width + kThreads - 1) / kThreads),
                  static_cast<unsigned>(rows < kMaxRowBlocks ? rows : kMaxRowBlocks));
  upsample_nearest2x_kernel<T><<<grid, kThreads, 0, stream>>>(a);
  return cudaGetLastError();
}
#endif  // __CUDACC_RTC__

}  // namespace

#ifndef __CUDACC_RTC__
cudaError_t launch_upsample_nearest2x(const UpsampleNearestArgs& args, cudaStream_t stream) {
  return dispatch_storage_or_float(args.dtype, [&](auto tag) { return launch<decltype(tag)>(args, stream); });
}
#endif

}  // namespace diffusers_fastpath
