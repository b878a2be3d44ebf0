// Registers the CUDA kernels as torch operators in the `diffusers_fastpath` namespace:
//   diffusers_fastpath::_modulate_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift) -> Tensor
//   diffusers_fastpath::_modulate_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()
// These are the raw CUDA entry points. The public, device-generic op `diffusers_fastpath::modulate_scale_shift`
// (with its fake implementation for torch.compile) is defined in Python, in ops/modulate_scale_shift.py; eager
// calls reach these directly to skip the Python custom-op layer (see that file's docstring for the numbers).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "fastpath.h"

namespace diffusers_fastpath {
namespace {

DType to_dtype(const at::Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf:
      return DType::kHalf;
    case at::kBFloat16:
      return DType::kBFloat16;
    default:
      TORCH_CHECK(false, "diffusers_fastpath: expected float16 or bfloat16, got ", t.scalar_type());
  }
}

bool aligned16(const at::Tensor& t) { return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0; }

// The Python guard admits only inputs that pass these checks; they stay here so that a direct call with bad
// input raises instead of reading out of bounds.
void check_modulate_inputs(const at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                           const at::Tensor& shift) {
  TORCH_CHECK(x.is_cuda(), "modulate_scale_shift: x must be a CUDA tensor");
  TORCH_CHECK(x.dim() == 3, "modulate_scale_shift: x must be [batch, seq, dim], got ", x.sizes());
  const int64_t batch = x.size(0), dim = x.size(2);
  const int64_t vec = 16 / x.element_size();
  to_dtype(x);
  for (const at::Tensor* t : {&out, &scale, &shift}) {
    TORCH_CHECK(t->scalar_type() == x.scalar_type(), "modulate_scale_shift: dtype mismatch");
    TORCH_CHECK(t->device() == x.device(), "modulate_scale_shift: device mismatch");
    TORCH_CHECK(aligned16(*t), "modulate_scale_shift: pointers must be 16-byte aligned");
  }
  TORCH_CHECK(out.sizes() == x.sizes() && out.is_contiguous() && x.is_contiguous(),
              "modulate_scale_shift: x and out must be contiguous and of one shape");
  TORCH_CHECK(aligned16(x) && dim % vec == 0, "modulate_scale_shift: dim must be a multiple of ", vec);
  for (const at::Tensor* t : {&scale, &shift}) {
    TORCH_CHECK(t->dim() == 2 && t->size(1) == dim && (t->size(0) == batch || t->size(0) == 1),
                "modulate_scale_shift: scale/shift must be [batch or 1, dim], got ", t->sizes());
    TORCH_CHECK(t->stride(1) == 1, "modulate_scale_shift: scale/shift must have unit innermost stride");
    TORCH_CHECK(t->size(0) == 1 || t->stride(0) % vec == 0,
                "modulate_scale_shift: scale/shift batch stride must keep rows 16-byte aligned");
  }
}

void modulate_scale_shift_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& scale,
                              const at::Tensor& shift) {
  check_modulate_inputs(out, x, scale, shift);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  ModulateScaleShiftArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.scale = scale.data_ptr();
  args.shift = shift.data_ptr();
  args.batch = x.size(0);
  args.seq = x.size(1);
  args.dim = x.size(2);
  args.scale_batch_stride = scale.size(0) == 1 ? 0 : scale.stride(0);
  args.shift_batch_stride = shift.size(0) == 1 ? 0 : shift.stride(0);
  args.dtype = to_dtype(x);
  const cudaError_t err = launch_modulate_scale_shift(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "modulate_scale_shift: kernel launch failed: ", cudaGetErrorString(err));
}

at::Tensor modulate_scale_shift(const at::Tensor& x, const at::Tensor& scale, const at::Tensor& shift) {
  at::Tensor out = at::empty(x.sizes(), x.options());
  modulate_scale_shift_out(out, x, scale, shift);
  return out;
}

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
  m.def("_modulate_scale_shift_cuda(Tensor x, Tensor scale, Tensor shift) -> Tensor");
  m.def("_modulate_scale_shift_cuda_out(Tensor(a!) out, Tensor x, Tensor scale, Tensor shift) -> ()");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
  m.impl("_modulate_scale_shift_cuda", &diffusers_fastpath::modulate_scale_shift);
  m.impl("_modulate_scale_shift_cuda_out", &diffusers_fastpath::modulate_scale_shift_out);
}
