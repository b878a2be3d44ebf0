// The VAEs' raw CUDA ops (upsample_nearest.cu, conv_bias.cu, causal_pad.cu, group_norm_silu.cu,
// channel_rmsnorm_silu.cu, ltx_vae_rmsnorm.cu, per_channel_rmsnorm.cu), registered as torch operators in the
// `diffusers_fastpath` namespace (see bindings.cpp).
#include "bindings_common.h"

namespace diffusers_fastpath {
namespace {

// The 2x nearest upsampling (upsample_nearest.cu): x a CUDA [N, C, H, W] tensor of bf16/fp16 with unit W stride, the
// result a contiguous [N, C, 2H, 2W].
at::Tensor upsample_nearest2x(const at::Tensor& x) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 4 && (x.size(3) <= 1 || x.stride(3) == 1),
              "upsample_nearest2x: x must be a CUDA [N, C, H, W] tensor with unit W stride, got ", shape_str(x.sizes()));
  UpsampleNearestArgs args;
  args.dtype = to_dtype_or_float(x);
  at::Tensor out = at::empty({x.size(0), x.size(1), 2 * x.size(2), 2 * x.size(3)}, x.options());
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.height = x.size(2);
  args.width = x.size(3);
  args.stride_n = x.stride(0);
  args.stride_c = x.stride(1);
  args.stride_h = x.stride(2);
  const cudaError_t err = launch_upsample_nearest2x(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "upsample_nearest2x: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// A convolution's bias added in place (conv_bias.cu): x a dense CUDA [N, C, *] tensor of bf16/fp16, contiguous or
// channels-last (C innermost), bias a contiguous [C] of x's dtype.
void conv_bias_(at::Tensor& x, const at::Tensor& bias) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && bias.is_cuda() && bias.dim() == 1 && bias.size(0) == x.size(1) &&
                  bias.is_contiguous() && bias.scalar_type() == x.scalar_type(),
              "conv_bias_: x must be a CUDA [N, C, *] tensor and bias a contiguous [C] of its dtype, got ",
              shape_str(x.sizes()), " and ", shape_str(bias.sizes()));
  const bool channels_last = !x.is_contiguous();
  if (channels_last) {
    TORCH_CHECK(x.is_contiguous(x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d),
                "conv_bias_: x must be contiguous or channels-last");
  }
  ConvBiasArgs args;
  args.dtype = to_dtype_or_float(x);
  if (x.numel() == 0) return;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.x = x.data_ptr();
  args.bias = bias.data_ptr();
  args.channels = x.size(1);
  args.channels_last = channels_last;
  args.cols = channels_last ? args.channels : x.numel() / (x.size(0) * args.channels);
  args.rows = x.numel() / args.cols;
  const cudaError_t err = launch_conv_bias(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "conv_bias_: kernel launch failed: ", cudaGetErrorString(err));
}

// A channels-last convolution output's bias added into a new contiguous tensor (conv_bias.cu): x a dense CUDA
// [N, C, *] tensor of bf16/fp16 laid out channels-last (C innermost), bias a contiguous [C] of its dtype; residual
// (or nullptr) a tensor of x's sizes, dtype and device, contiguous or (5-D) time-major ([B, C, T, H, W] laid out as
// [B, T, C, H, W]), added to the rounded sum (the kResidual variant).
at::Tensor bias_contiguous_into(const char* name, const at::Tensor& x, const at::Tensor& bias,
                                const at::Tensor* residual) {
  TORCH_CHECK(x.is_cuda() && (x.dim() == 4 || x.dim() == 5) && bias.is_cuda() && bias.dim() == 1 &&
                  bias.size(0) == x.size(1) && bias.is_contiguous() && bias.scalar_type() == x.scalar_type() &&
                  x.is_contiguous(x.dim() == 4 ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::ChannelsLast3d),
              name, ": x must be a channels-last CUDA [N, C, *] tensor and bias a contiguous [C] of its dtype, got ",
              shape_str(x.sizes()), " and ", shape_str(bias.sizes()));
  const bool time_major = residual != nullptr && !residual->is_contiguous() && residual->dim() == 5 &&
                          residual->permute({0, 2, 1, 3, 4}).is_contiguous();
  if (residual != nullptr) {
    TORCH_CHECK(residual->device() == x.device() && residual->sizes() == x.sizes() &&
                    residual->scalar_type() == x.scalar_type() && (residual->is_contiguous() || time_major),
                name, ": residual must be a contiguous or time-major tensor of x's sizes, dtype and device, got ",
                shape_str(residual->sizes()), " for x ", shape_str(x.sizes()));
  }
  BiasContiguousArgs args;
  args.residual_plane = time_major ? residual->size(3) * residual->size(4) : 0;
  args.dtype = to_dtype_or_float(x);
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.bias = bias.data_ptr();
  args.residual = residual != nullptr ? residual->data_ptr() : nullptr;
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.spatial = x.numel() / (args.batch * args.channels);
  const cudaError_t err = launch_bias_contiguous(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, name, ": kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

at::Tensor conv_bias_contiguous(const at::Tensor& x, const at::Tensor& bias) {
  return bias_contiguous_into("conv_bias_contiguous", x, bias, nullptr);
}

// ... and the residual added (a resnet's `conv2(...) + inputs`: ops/conv_bias_residual.py).
at::Tensor conv_bias_residual_contiguous(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual) {
  return bias_contiguous_into("conv_bias_residual_contiguous", x, bias, &residual);
}

// A residual upsampler's output from its convolution's channels-last output (conv_bias.cu's bias_depth_to_space:
// ops/ltx_upsampler.py): x a channels-last CUDA [N, 8 C', T, H, W] tensor of bf16/fp16, 16-byte aligned; bias a
// contiguous [8 C'] of its dtype; residual the upsampler's input, a contiguous [N, 8 G, T, H, W] of x's dtype and
// device (C' a multiple of G); out contiguous [N, C', 2 T - 1, 2 H, 2 W].
at::Tensor conv_bias_depth_to_space(const at::Tensor& x, const at::Tensor& bias, const at::Tensor& residual) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 5 && x.size(1) % 8 == 0 && x.size(2) > 0 && bias.is_cuda() &&
                  bias.dim() == 1 && bias.size(0) == x.size(1) && bias.is_contiguous() &&
                  bias.scalar_type() == x.scalar_type() && x.is_contiguous(at::MemoryFormat::ChannelsLast3d) &&
                  reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
              "conv_bias_depth_to_space: x must be a 16-byte aligned channels-last CUDA [N, 8 C, T, H, W] tensor and "
              "bias a contiguous [8 C] of its dtype, got ", shape_str(x.sizes()), " and ", shape_str(bias.sizes()));
  TORCH_CHECK(residual.device() == x.device() && residual.dim() == 5 && residual.size(0) == x.size(0) &&
                  residual.size(1) % 8 == 0 && residual.size(1) > 0 && (x.size(1) / 8) % (residual.size(1) / 8) == 0 &&
                  residual.size(2) == x.size(2) && residual.size(3) == x.size(3) && residual.size(4) == x.size(4) &&
                  residual.scalar_type() == x.scalar_type() && residual.is_contiguous(),
              "conv_bias_depth_to_space: residual must be a contiguous [N, 8 G, T, H, W] of x's dtype and device with "
              "G dividing x's channels / 8, got ", shape_str(residual.sizes()), " for x ", shape_str(x.sizes()));
  BiasDepthToSpaceArgs args;
  args.dtype = to_dtype(x);
  at::Tensor out = at::empty({x.size(0), x.size(1) / 8, 2 * x.size(2) - 1, 2 * x.size(3), 2 * x.size(4)},
                             x.options().memory_format(at::MemoryFormat::Contiguous));
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.bias = bias.data_ptr();
  args.residual = residual.data_ptr();
  args.batch = x.size(0);
  args.channels = x.size(1) / 8;
  args.groups = residual.size(1) / 8;
  args.frames = x.size(2);
  args.height = x.size(3);
  args.width = x.size(4);
  const cudaError_t err = launch_bias_depth_to_space(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "conv_bias_depth_to_space: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The arguments of causal_pad.cu's kernels for x, cache (optional), padding and the flags, and the output they write
// (the checks of causal_pad below; ltx_rmsnorm_pad_cl's too).
std::pair<CausalPadArgs, at::Tensor> causal_pad_args(const at::Tensor& x, const std::optional<at::Tensor>& cache,
                                                     at::IntArrayRef padding, bool channels_last, bool replicate_t,
                                                     bool reflect_hw) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 5 && (x.size(4) <= 1 || x.stride(4) == 1) && padding.size() == 6,
              "causal_pad: x must be a CUDA [B, C, T, H, W] tensor with unit W stride, got ", shape_str(x.sizes()));
  for (const int64_t p : padding) TORCH_CHECK(p >= 0, "causal_pad: padding must be non-negative");
  TORCH_CHECK(!reflect_hw || (padding[0] < x.size(4) && padding[1] < x.size(4) && padding[2] < x.size(3) &&
                              padding[3] < x.size(3)),
              "causal_pad: a reflected padding must be below the size of its dimension");
  TORCH_CHECK(!replicate_t || x.size(2) > 0 || (cache.has_value() && cache->size(2) > 0),
              "causal_pad: repeated frames need a frame to repeat");
  CausalPadArgs args;
  args.dtype = to_dtype_or_float(x);
  const int64_t cache_frames = cache.has_value() ? cache->size(2) : 0;
  if (cache.has_value()) {
    const at::Tensor& c = *cache;
    TORCH_CHECK(c.is_cuda() && c.dim() == 5 && c.scalar_type() == x.scalar_type() && c.size(0) == x.size(0) &&
                    c.size(1) == x.size(1) && c.size(3) == x.size(3) && c.size(4) == x.size(4) &&
                    (c.size(4) <= 1 || c.stride(4) == 1) && cache_frames <= padding[4],
                "causal_pad: cache must be [B, C, t, H, W] of x's dtype with unit W stride, t <= the time padding");
  }
  const int64_t pt0 = padding[4] - cache_frames;
  at::Tensor out = at::empty({x.size(0), x.size(1), pt0 + cache_frames + x.size(2) + padding[5],
                              x.size(3) + padding[2] + padding[3], x.size(4) + padding[0] + padding[1]},
                             x.options().memory_format(channels_last ? at::MemoryFormat::ChannelsLast3d
                                                                     : at::MemoryFormat::Contiguous));
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.cache = cache.has_value() ? cache->data_ptr() : nullptr;
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.frames = x.size(2);
  args.height = x.size(3);
  args.width = x.size(4);
  args.cache_frames = cache_frames;
  args.pad_t0 = pt0;
  args.pad_t1 = padding[5];
  args.pad_h0 = padding[2];
  args.pad_h1 = padding[3];
  args.pad_w0 = padding[0];
  args.pad_w1 = padding[1];
  args.x_stride_b = x.stride(0);
  args.x_stride_c = x.stride(1);
  args.x_stride_t = x.stride(2);
  args.x_stride_h = x.stride(3);
  args.cache_stride_b = cache.has_value() ? cache->stride(0) : 0;
  args.cache_stride_c = cache.has_value() ? cache->stride(1) : 0;
  args.cache_stride_t = cache.has_value() ? cache->stride(2) : 0;
  args.cache_stride_h = cache.has_value() ? cache->stride(3) : 0;
  args.channels_last = channels_last;
  args.replicate_t = replicate_t;
  args.reflect_hw = reflect_hw;
  return {args, out};
}

// A causal convolution's padded input (causal_pad.cu): x a CUDA [B, C, T, H, W] tensor of bf16/fp16 with unit W
// stride, cache (optional) the same but for its frames, padding (w0, w1, h0, h1, t0, t1) as F.pad takes it, t0 counting
// the cache frames as eager's concatenation does; the result a [B, C, T', H', W'], contiguous or channels-last. Its
// border zeros, or in time the first and last frames repeated (replicate_t: some frame needed) and in space F.pad's
// reflection (reflect_hw: each spatial padding below its axis' size, as reflection_pad3d requires).
at::Tensor causal_pad(const at::Tensor& x, const std::optional<at::Tensor>& cache, at::IntArrayRef padding,
                      bool channels_last, bool replicate_t, bool reflect_hw) {
  auto [args, out] = causal_pad_args(x, cache, padding, channels_last, replicate_t, reflect_hw);
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaError_t err = launch_causal_pad(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "causal_pad: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-Video's VAE norm and the SiLU after it written as the padded channels-last input of the causal convolution that
// reads them (causal_pad.cu's ltx_rmsnorm_pad_cl_kernel): x as causal_pad's (bf16 / fp16, no cache), its frames
// repeated in time, with reflect_hw its rows and columns reflected; rsqrt the contiguous fp32 [B, T * H * W] that eager
// multiplies by. The result a channels-last [B, C, T', H', W'] of round(silu(round(x * rsqrt))) where causal_pad puts x.
at::Tensor ltx_rmsnorm_pad_cl(const at::Tensor& x, const at::Tensor& rsqrt, at::IntArrayRef padding, bool reflect_hw) {
  auto [args, out] = causal_pad_args(x, std::nullopt, padding, true, true, reflect_hw);
  TORCH_CHECK(args.dtype != DType::kFloat32, "ltx_rmsnorm_pad_cl: x must be bf16 or fp16");
  TORCH_CHECK(rsqrt.scalar_type() == at::kFloat && rsqrt.device() == x.device() && rsqrt.is_contiguous() &&
                  rsqrt.numel() == x.size(0) * x.size(2) * x.size(3) * x.size(4),
              "ltx_rmsnorm_pad_cl: rsqrt must be a contiguous fp32 [B, T * H * W] tensor on x's device");
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaError_t err = launch_ltx_rmsnorm_pad_cl(args, rsqrt.data_ptr<float>(), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ltx_rmsnorm_pad_cl: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// Wan's / Qwen-Image's VAE channel norm and the SiLU after it written as the padded channels-last input of the causal
// convolution that reads them (causal_pad.cu's channel_rmsnorm_pad_cl_kernel): x as causal_pad's (bf16 / fp16, no
// cache, the zero border), denom the contiguous fp32 [B, T * H * W] that eager divides by, gamma (and bias, or the
// python-float `bias_value`) contiguous [C] of x's dtype. The result a channels-last [B, C, T', H', W'] of
// round(silu(channel_rmsnorm_value(x))) where causal_pad puts x, zeros elsewhere.
at::Tensor channel_rmsnorm_pad_cl(const at::Tensor& x, const at::Tensor& denom, const at::Tensor& gamma,
                                  const std::optional<at::Tensor>& bias, double scale, double bias_value,
                                  at::IntArrayRef padding) {
  auto [args, out] = causal_pad_args(x, std::nullopt, padding, true, false, false);
  TORCH_CHECK(args.dtype != DType::kFloat32, "channel_rmsnorm_pad_cl: x must be bf16 or fp16");
  TORCH_CHECK(denom.scalar_type() == at::kFloat && denom.device() == x.device() && denom.is_contiguous() &&
                  denom.numel() == x.size(0) * x.size(2) * x.size(3) * x.size(4),
              "channel_rmsnorm_pad_cl: denom must be a contiguous fp32 [B, T * H * W] tensor on x's device");
  TORCH_CHECK(gamma.scalar_type() == x.scalar_type() && gamma.device() == x.device() && gamma.dim() == 1 &&
                  gamma.size(0) == x.size(1) && gamma.is_contiguous(),
              "channel_rmsnorm_pad_cl: gamma must be a contiguous [C] tensor of x's dtype and device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->device() == x.device() && bias->dim() == 1 &&
                    bias->size(0) == x.size(1) && bias->is_contiguous(),
                "channel_rmsnorm_pad_cl: bias must be a contiguous [C] tensor of x's dtype and device");
  }
  if (out.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const cudaError_t err = launch_channel_rmsnorm_pad_cl(
      args, denom.data_ptr<float>(), gamma.data_ptr(), bias.has_value() ? bias->data_ptr() : nullptr,
      static_cast<float>(scale), static_cast<float>(bias_value), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "channel_rmsnorm_pad_cl: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// torch.nn.GroupNorm (weight and bias) of [N, C, *], then SiLU if `silu` (group_norm_silu.cu). `eps` is the module's:
// the kernel adds aten's static_cast<T>(eps). The Python guard admits only inputs that pass these checks.
// `channels_last`: out is a 4-D x's channels-last tensor (group_norm_apply_cl_kernel), for the convolution after it.
void group_norm_silu_into(at::Tensor& out, const at::Tensor& x_in, const at::Tensor& weight_in,
                          const at::Tensor& bias_in, int64_t groups, double eps, bool silu, int64_t variant,
                          bool channels_last) {
  TORCH_CHECK(x_in.is_cuda(), "group_norm_silu: x must be a CUDA tensor");
  TORCH_CHECK(x_in.dim() >= 3, "group_norm_silu: x must be [N, C, *], got ", shape_str(x_in.sizes()));
  const DType dtype = to_dtype(x_in);
  const int64_t batch = x_in.size(0), channels = x_in.size(1);
  TORCH_CHECK(groups > 0 && channels % groups == 0, "group_norm_silu: channels must be a multiple of groups");
  for (const at::Tensor* t : {&weight_in, &bias_in}) {
    TORCH_CHECK(t->scalar_type() == x_in.scalar_type() && t->device() == x_in.device() && t->dim() == 1 &&
                    t->size(0) == channels,
                "group_norm_silu: weight and bias must be [C] tensors of x's dtype and device");
  }
  const int64_t hxw = x_in.numel() / (batch * channels > 0 ? batch * channels : 1);
  const int64_t vec = 16 / x_in.element_size();
  TORCH_CHECK(hxw > 1 && hxw % vec == 0, "group_norm_silu: HxW must be above 1 and a multiple of ",
              std::to_string(vec));
  TORCH_CHECK(batch * groups <= 65535, "group_norm_silu: at most 65535 rows (N * groups)");
  const int64_t row_size = channels / groups * hxw;
  TORCH_CHECK(row_size < (int64_t{1} << 31), "group_norm_silu: rows too long");
  TORCH_CHECK(variant >= 0 && variant <= 255, "group_norm_silu: no such variant");
  const at::Tensor x = x_in.contiguous();  // aten's group_norm makes a CUDA input contiguous too
  const at::Tensor weight = weight_in.contiguous();
  const at::Tensor bias = bias_in.contiguous();
  TORCH_CHECK(aligned16(x), "group_norm_silu: x must be 16-byte aligned");
  TORCH_CHECK(!channels_last || (x.dim() == 4 && channels % 8 == 0),
              "group_norm_silu: a channels-last output is of a 4-D x with channels a multiple of 8");
  TORCH_CHECK(out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type() && out.device() == x.device() &&
                  out.is_contiguous(channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous) &&
                  aligned16(out),
              "group_norm_silu: out must be a contiguous (channels-last where asked), 16-byte aligned tensor of x's "
              "shape, dtype and device");
  if (x.numel() == 0) return;
  const int32_t threads = row_size < 512 ? 32 : 512;  // RowwiseMomentsCUDAKernel's block
  at::Tensor partial = at::empty({batch * groups * (threads / 32) * 3}, x.options().dtype(at::kFloat));
  const c10::cuda::CUDAGuard device_guard(x.device());
  GroupNormSiluArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.gamma = weight.data_ptr();
  args.beta = bias.data_ptr();
  args.partial = partial.data_ptr<float>();
  args.batch = batch;
  args.channels = channels;
  args.groups = groups;
  args.hxw = hxw;
  args.row_size = row_size;
  // aten's GroupNormKernelImpl: static_cast<scalar_t>(eps) (a double, converted to float, then to T)
  args.eps = dtype == DType::kHalf ? static_cast<float>(c10::Half(static_cast<float>(eps)))
                                   : static_cast<float>(c10::BFloat16(static_cast<float>(eps)));
  args.threads = threads;
  args.variant = static_cast<int32_t>(variant);
  args.silu = silu;
  args.dtype = dtype;
  args.channels_last = channels_last;
  const cudaError_t err = launch_group_norm_silu(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "group_norm_silu: kernel launch failed: ", cudaGetErrorString(err));
}

void group_norm_silu_out(at::Tensor& out, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                         int64_t groups, double eps, bool silu, int64_t variant) {
  group_norm_silu_into(out, x, weight, bias, groups, eps, silu, variant, false);
}

at::Tensor group_norm_silu(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t groups,
                           double eps, bool silu, int64_t variant) {
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  group_norm_silu_into(out, x, weight, bias, groups, eps, silu, variant, false);
  return out;
}

at::Tensor group_norm_silu_cl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias, int64_t groups,
                              double eps, bool silu, int64_t variant) {
  TORCH_CHECK(x.dim() == 4, "group_norm_silu_cl: x must be [N, C, H, W], got ", shape_str(x.sizes()));
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::ChannelsLast));
  group_norm_silu_into(out, x, weight, bias, groups, eps, silu, variant, true);
  return out;
}

// Wan's / Qwen-Image's channel RMS norm from F.normalize's division on, then SiLU if `silu`
// (channel_rmsnorm_silu.cu): x [B, C, *] contiguous (any trailing size: 16-byte vectors where it holds a multiple of
// them, elements elsewhere), denom the fp32 [B, 1, *] that eager divides by, gamma (and bias,
// or the python-float `bias_value`) [C] of x's dtype. `probe`: the SiLU alone (y = x). The Python guard admits only
// inputs that pass these checks.
at::Tensor channel_rmsnorm(const at::Tensor& x, const at::Tensor& denom, const at::Tensor& gamma,
                           const std::optional<at::Tensor>& bias, double scale, double bias_value, bool silu,
                           bool probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && x.is_contiguous() && aligned16(x),
              "channel_rmsnorm: x must be a contiguous, 16-byte aligned CUDA tensor [B, C, *]");
  const DType dtype = to_dtype_or_float(x);
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t spatial = x.numel() / (batch * channels > 0 ? batch * channels : 1);
  TORCH_CHECK(denom.scalar_type() == at::kFloat && denom.device() == x.device() && denom.is_contiguous() &&
                  denom.numel() == batch * spatial && aligned16(denom),
              "channel_rmsnorm: denom must be a contiguous fp32 [B, 1, *] tensor on x's device");
  TORCH_CHECK(gamma.scalar_type() == x.scalar_type() && gamma.device() == x.device() && gamma.dim() == 1 &&
                  gamma.size(0) == channels && gamma.is_contiguous(),
              "channel_rmsnorm: gamma must be a contiguous [C] tensor of x's dtype and device");
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == x.scalar_type() && bias->device() == x.device() && bias->dim() == 1 &&
                    bias->size(0) == channels && bias->is_contiguous(),
                "channel_rmsnorm: bias must be a contiguous [C] tensor of x's dtype and device");
  }
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  ChannelRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.denom = denom.data_ptr<float>();
  args.gamma = gamma.data_ptr();
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.batch = batch;
  args.channels = channels;
  args.spatial = spatial;
  args.scale = static_cast<float>(scale);  // aten's mul casts the python scalar to its float opmath
  args.bias_value = static_cast<float>(bias_value);
  args.silu = silu ? 1 : 0;
  args.probe = probe ? 1 : 0;
  args.dtype = dtype;
  const cudaError_t err = launch_channel_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "channel_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-Video's VAE norm from eager's multiply on (ltx_vae_rmsnorm.cu): x [B, C, *] (the channel-first memory of the
// norm's channel-last view) with each channel's trailing elements contiguous, rsqrt the fp32 [B, *] that eager
// multiplies by; `silu`: the SiLU after the norm; `square`: the fp32 x * x for aten's mean instead; `probe`: the SiLU of
// x alone (the Python op's proof; rsqrt unused). The Python guard admits only inputs that pass these checks.
at::Tensor ltx_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& rsqrt, bool square, bool silu,
                       bool probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() >= 3 && aligned16(x), "ltx_rmsnorm: x must be a 16-byte aligned CUDA tensor [B, C, *]");
  int64_t expected = 1;
  for (int64_t d = x.dim() - 1; d >= 2; --d) {
    TORCH_CHECK(x.size(d) == 1 || x.stride(d) == expected, "ltx_rmsnorm: each channel of x must be contiguous");
    expected *= x.size(d);
  }
  const DType dtype = to_dtype(x);
  const int64_t batch = x.size(0), channels = x.size(1);
  const int64_t spatial = x.numel() / (batch * channels > 0 ? batch * channels : 1);
  const int64_t vec = 16 / x.element_size();
  TORCH_CHECK(spatial % vec == 0 && x.stride(0) % vec == 0 && x.stride(1) % vec == 0 && x.stride(1) >= spatial,
              "ltx_rmsnorm: the trailing sizes and x's strides must be multiples of ", std::to_string(vec), " elements");
  TORCH_CHECK(int(square) + int(silu) + int(probe) <= 1, "ltx_rmsnorm: at most one of square, silu and probe");
  TORCH_CHECK(square || probe ||
                  (rsqrt.has_value() && rsqrt->scalar_type() == at::kFloat && rsqrt->device() == x.device() &&
                   rsqrt->is_contiguous() && rsqrt->numel() == batch * spatial && aligned16(*rsqrt)),
              "ltx_rmsnorm: rsqrt must be a contiguous fp32 [B, *] tensor on x's device");
  at::Tensor out = at::empty(x.sizes(), x.options()
                                            .dtype(square ? at::kFloat : x.scalar_type())
                                            .memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  LtxRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.rsqrt = square || probe ? nullptr : rsqrt->data_ptr<float>();
  args.batch = batch;
  args.channels = channels;
  args.spatial = spatial;
  args.x_batch_stride = x.stride(0);
  args.x_channel_stride = x.stride(1);
  args.square = square ? 1 : 0;
  args.silu = silu ? 1 : 0;
  args.probe = probe ? 1 : 0;
  args.dtype = dtype;
  const cudaError_t err = launch_ltx_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ltx_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The launch arguments of both per-channel norm kernels (per_channel_rmsnorm.cu) for x [B, C, S] into `out`.
PerChannelRmsNormArgs per_channel_args(const at::Tensor& x, const at::Tensor& out, const void* mean, double eps,
                                       bool silu, int64_t probe) {
  PerChannelRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.mean = mean;
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.spatial = x.size(2);
  args.x_batch_stride = x.stride(0);
  args.x_channel_stride = x.stride(1);
  args.eps = static_cast<float>(eps);  // aten's CUDA add casts the python scalar (a double) to its float opmath
  args.silu = silu ? 1 : 0;
  args.probe = static_cast<int32_t>(probe);
  args.dtype = to_dtype_or_float(x);
  return args;
}

// LTX-2's VAE norm from aten's mean on, then SiLU if `silu` (per_channel_rmsnorm.cu): x [B, C, S] with each channel's S
// elements contiguous (channels and batches at any strides), mean the [B, 1, S] (any view of B * S contiguous values)
// of x's dtype that aten's torch.mean(x**2, 1, keepdim=True) gave; `probe` 1: the SiLU of x alone, 2: the kernel's
// round(sqrt(round(x + eps))) of x alone (the Python op's proofs; mean unused). The Python guard admits only inputs
// that pass these checks.
at::Tensor per_channel_rmsnorm(const at::Tensor& x, const std::optional<at::Tensor>& mean, double eps, bool silu,
                               int64_t probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "per_channel_rmsnorm: x must be a CUDA tensor [B, C, S] with unit stride along S");
  TORCH_CHECK(probe >= 0 && probe <= 2 && (probe == 0 || !silu),
              "per_channel_rmsnorm: probe must be 0, 1 or 2 (0 with silu)");
  to_dtype_or_float(x);  // (its check of the dtype, before the output is allocated)
  TORCH_CHECK(probe != 0 || (mean.has_value() && mean->scalar_type() == x.scalar_type() &&
                             mean->device() == x.device() && mean->is_contiguous() &&
                             mean->numel() == x.size(0) * x.size(2)),
              "per_channel_rmsnorm: mean must be a contiguous [B, 1, S] tensor of x's dtype and device");
  at::Tensor out = at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const void* mean_data = probe == 0 ? mean->data_ptr() : nullptr;
  const PerChannelRmsNormArgs args = per_channel_args(x, out, mean_data, eps, silu, probe);
  const cudaError_t err = launch_per_channel_rmsnorm(args, c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "per_channel_rmsnorm: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-2's VAE norm with aten's mean of x**2 computed in the kernel (per_channel_rmsnorm.cu's fused kernel), then SiLU
// if `silu`: x [B, C, S] as for per_channel_rmsnorm; `rows` (a power of two up to 512) and `ctas` the partial sums of
// aten's reduction order and `factor` its MeanOps factor, all as the Python op derives them from setReduceConfig
// (ops/per_channel_rmsnorm.py: `mean_order`); `probe` 3: the mean alone, [B, S]. The Python guard admits only inputs
// that pass these checks.
at::Tensor per_channel_rmsnorm_fused(const at::Tensor& x, double eps, bool silu, int64_t rows, int64_t ctas,
                                     double factor, int64_t probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "per_channel_rmsnorm_fused: x must be a CUDA tensor [B, C, S] with unit stride along S");
  TORCH_CHECK((probe == 0 || (probe == 3 && !silu)) && rows >= 1 && rows <= 512 && (rows & (rows - 1)) == 0 &&
                  ctas >= 1 && ctas <= 65536,
              "per_channel_rmsnorm_fused: probe must be 0 or 3 (without silu), rows a power of two up to 512, ctas "
              "from 1 to 65536");
  to_dtype_or_float(x);  // (its check of the dtype, before the output is allocated)
  at::Tensor out = probe == 3 ? at::empty({x.size(0), x.size(2)}, x.options())
                              : at::empty(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const PerChannelRmsNormArgs args = per_channel_args(x, out, nullptr, eps, silu, probe);
  // `factor` is a float the Python op computed as aten's host does; the double it arrives as holds it exactly
  const cudaError_t err =
      launch_per_channel_rmsnorm_fused(args, static_cast<int32_t>(rows), static_cast<int32_t>(ctas),
                                       static_cast<float>(factor), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "per_channel_rmsnorm_fused: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The pad kernels' geometry (per_channel_rmsnorm.cu's NormPadArgs) for x's trailing dims `frames`, `height`, `width`
// and `padding` in F.pad's order (w0, w1, h0, h1, t0, t1), checked: non-negative, and with `reflect_hw` each spatial
// one below its axis' size (F.pad's reflection), else none in h and w; and aten's order of the mean (`rows` a power of
// two up to 512, `ctas` from 1 to 65536).
NormPadArgs norm_pad_args(int64_t frames, int64_t height, int64_t width, at::IntArrayRef padding, bool reflect_hw,
                          int64_t rows, int64_t ctas) {
  TORCH_CHECK(rows >= 1 && rows <= 512 && (rows & (rows - 1)) == 0 && ctas >= 1 && ctas <= 65536,
              "per-channel norm pad: rows a power of two up to 512, ctas from 1 to 65536");
  TORCH_CHECK(padding.size() == 6, "per-channel norm pad: padding must be (w0, w1, h0, h1, t0, t1)");
  for (const int64_t p : padding) TORCH_CHECK(p >= 0, "per-channel norm pad: padding must be non-negative");
  TORCH_CHECK(reflect_hw ? padding[0] < width && padding[1] < width && padding[2] < height && padding[3] < height
                         : padding[0] == 0 && padding[1] == 0 && padding[2] == 0 && padding[3] == 0,
              "per-channel norm pad: a reflected padding must be below its axis' size, none without reflection");
  NormPadArgs pad;
  pad.frames = frames;
  pad.height = height;
  pad.width = width;
  pad.pad_w0 = padding[0];
  pad.pad_w1 = padding[1];
  pad.pad_h0 = padding[2];
  pad.pad_h1 = padding[3];
  pad.pad_t0 = padding[4];
  pad.pad_t1 = padding[5];
  pad.reflect_hw = reflect_hw ? 1 : 0;
  return pad;
}

// The pad kernels' output for x [B, C, ...]: [B, C, t0 + frames + t1, h0 + height + h1, w0 + width + w1] of x's dtype,
// channels_last_3d.
at::Tensor norm_pad_output(const at::Tensor& x, const NormPadArgs& g) {
  return at::empty({x.size(0), x.size(1), g.pad_t0 + g.frames + g.pad_t1, g.pad_h0 + g.height + g.pad_h1,
                    g.pad_w0 + g.width + g.pad_w1},
                   x.options().memory_format(at::MemoryFormat::ChannelsLast3d));
}

// The fused norm (per_channel_rmsnorm_fused, probe 0) written as the padded channels-last input of the causal
// convolution after it (per_channel_rmsnorm.cu's pad kernel; ops/ltx_norm_conv.py): x [B, C, S] as there, `frames`
// `height` `width` x's trailing dims (S their product), `padding` F.pad's order (w0, w1, h0, h1, t0, t1): the frames
// repeated, and F.pad's reflection in h and w where `reflect_hw` (each below its axis' size), else h and w unpadded.
// The result is [B, C, t0 + frames + t1, h0 + height + h1, w0 + width + w1], channels_last_3d. The Python guard admits
// only inputs that pass these checks.
at::Tensor per_channel_rmsnorm_pad_cl(const at::Tensor& x, double eps, bool silu, int64_t rows, int64_t ctas,
                                      double factor, at::IntArrayRef dims, at::IntArrayRef padding, bool reflect_hw) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "per_channel_rmsnorm_pad_cl: x must be a CUDA tensor [B, C, S] with unit stride along S");
  TORCH_CHECK(dims.size() == 3 && dims[0] >= 1 && dims[1] >= 1 && dims[2] >= 1 &&
                  dims[0] * dims[1] * dims[2] == x.size(2),
              "per_channel_rmsnorm_pad_cl: dims must be x's (frames, height, width)");
  const NormPadArgs pad = norm_pad_args(dims[0], dims[1], dims[2], padding, reflect_hw, rows, ctas);
  to_dtype_or_float(x);  // (its check of the dtype, before the output is allocated)
  at::Tensor out = norm_pad_output(x, pad);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  const PerChannelRmsNormArgs args = per_channel_args(x, out, nullptr, eps, silu, 0);
  const cudaError_t err =
      launch_per_channel_rmsnorm_pad_cl(args, pad, static_cast<int32_t>(rows), static_cast<int32_t>(ctas),
                                        static_cast<float>(factor), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "per_channel_rmsnorm_pad_cl: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// LTX-Video's VAE norm (and SiLU if `silu`) with its fp32 squares, aten's mean of them and the rsqrt in the kernel,
// written as per_channel_rmsnorm_pad_cl writes (per_channel_rmsnorm.cu's pad kernel, kLtx; ops/ltx_vae_rmsnorm_conv.py):
// x a bf16 / fp16 [B, C, S] as there (S = frames * height * width: `dims`), `rows` / `ctas` / `factor` aten's order
// of the fp32 mean as the Python op derives it, `padding` and `reflect_hw` as there; `probe` 3: the fp32 mean alone,
// [B, S]. The Python guard admits only inputs that pass these checks.
at::Tensor ltx_rmsnorm_fused_pad_cl(const at::Tensor& x, double eps, bool silu, int64_t rows, int64_t ctas,
                                    double factor, at::IntArrayRef dims, at::IntArrayRef padding, bool reflect_hw,
                                    int64_t probe) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 3 && (x.size(2) <= 1 || x.stride(2) == 1),
              "ltx_rmsnorm_fused_pad_cl: x must be a CUDA tensor [B, C, S] with unit stride along S");
  TORCH_CHECK(dims.size() == 3 && dims[0] >= 1 && dims[1] >= 1 && dims[2] >= 1 &&
                  dims[0] * dims[1] * dims[2] == x.size(2),
              "ltx_rmsnorm_fused_pad_cl: dims must be x's (frames, height, width)");
  TORCH_CHECK(probe == 0 || (probe == 3 && !silu), "ltx_rmsnorm_fused_pad_cl: probe must be 0 or 3 (without silu)");
  const NormPadArgs pad = norm_pad_args(dims[0], dims[1], dims[2], padding, reflect_hw, rows, ctas);
  const DType dtype = to_dtype(x);  // (bf16 / fp16 only: its check, before the output is allocated)
  at::Tensor out = probe == 3 ? at::empty({x.size(0), x.size(2)}, x.options().dtype(at::kFloat))
                              : norm_pad_output(x, pad);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  PerChannelRmsNormArgs args = per_channel_args(x, out, nullptr, eps, silu, probe);
  args.dtype = dtype;
  const cudaError_t err =
      launch_ltx_rmsnorm_fused_pad_cl(args, pad, static_cast<int32_t>(rows), static_cast<int32_t>(ctas),
                                      static_cast<float>(factor), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ltx_rmsnorm_fused_pad_cl: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// rsqrtf(m + eps) of every value of the fp32 tensor m (contiguous), as the kLtx pad kernel computes each position's
// reciprocal (the Python op's proof); the result of m's shape.
at::Tensor ltx_rsqrt_probe(const at::Tensor& m, double eps) {
  TORCH_CHECK(m.is_cuda() && m.scalar_type() == at::kFloat && m.is_contiguous(),
              "ltx_rsqrt_probe: m must be a contiguous CUDA fp32 tensor");
  at::Tensor out = at::empty(m.sizes(), m.options());
  if (m.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(m.device());
  const cudaError_t err = launch_ltx_rsqrt_probe(m.data_ptr<float>(), out.data_ptr<float>(), m.numel(),
                                                 static_cast<float>(eps), c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "ltx_rsqrt_probe: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

// The same padded channels-last output (per_channel_rmsnorm.cu's channels-last kernel; ops/ltx_bias_norm_conv.py) from
// x, the channels-last result of the convolution before the norm without its bias: x a CUDA [B, C, T, H, W] tensor
// laid out channels_last_3d, bias a contiguous [C] of its dtype, both 16-byte aligned, C a multiple of 16 bytes; each
// value read as round(x + bias[c]). `rows`, `ctas`, `factor`, `padding` and `reflect_hw` as for
// per_channel_rmsnorm_pad_cl (x's trailing dims its frames, height and width). The Python guard admits only inputs
// that pass these checks (and the kernel's cl_shape).
at::Tensor per_channel_rmsnorm_cl_pad_cl(const at::Tensor& x, const at::Tensor& bias, double eps, bool silu,
                                         int64_t rows, int64_t ctas, double factor, at::IntArrayRef padding,
                                         bool reflect_hw) {
  TORCH_CHECK(x.is_cuda() && x.dim() == 5 && x.is_contiguous(at::MemoryFormat::ChannelsLast3d),
              "per_channel_rmsnorm_cl_pad_cl: x must be a CUDA [B, C, T, H, W] tensor laid out channels_last_3d");
  TORCH_CHECK(bias.device() == x.device() && bias.dim() == 1 && bias.size(0) == x.size(1) && bias.is_contiguous() &&
                  bias.scalar_type() == x.scalar_type(),
              "per_channel_rmsnorm_cl_pad_cl: bias must be a contiguous [C] of x's dtype and device");
  TORCH_CHECK((x.size(1) * x.element_size()) % 16 == 0 && aligned16(x) && aligned16(bias),
              "per_channel_rmsnorm_cl_pad_cl: the channels must be a multiple of 16 bytes, x and bias 16-byte aligned");
  const NormPadArgs pad = norm_pad_args(x.size(2), x.size(3), x.size(4), padding, reflect_hw, rows, ctas);
  const DType dtype = to_dtype_or_float(x);  // (its check of the dtype, before the output is allocated)
  at::Tensor out = norm_pad_output(x, pad);
  if (x.numel() == 0) return out;
  const c10::cuda::CUDAGuard device_guard(x.device());
  PerChannelRmsNormArgs args;
  args.out = out.data_ptr();
  args.x = x.data_ptr();
  args.mean = nullptr;
  args.batch = x.size(0);
  args.channels = x.size(1);
  args.spatial = x.size(2) * x.size(3) * x.size(4);
  args.x_batch_stride = x.stride(0);
  args.x_channel_stride = 1;
  args.eps = static_cast<float>(eps);  // aten's CUDA add casts the python scalar (a double) to its float opmath
  args.silu = silu ? 1 : 0;
  args.probe = 0;
  args.dtype = dtype;
  const cudaError_t err = launch_per_channel_rmsnorm_cl_pad_cl(args, pad, bias.data_ptr(), static_cast<int32_t>(rows),
                                                               static_cast<int32_t>(ctas), static_cast<float>(factor),
                                                               c10::cuda::getCurrentCUDAStream());
  TORCH_CHECK(err == cudaSuccess, "per_channel_rmsnorm_cl_pad_cl: kernel launch failed: ", cudaGetErrorString(err));
  return out;
}

}  // namespace
}  // namespace diffusers_fastpath

TORCH_LIBRARY_FRAGMENT(diffusers_fastpath, m) {
  m.def("_upsample_nearest2x_cuda(Tensor x) -> Tensor");
  m.def("_conv_bias_cuda_(Tensor(a!) x, Tensor bias) -> ()");
  m.def("_conv_bias_contiguous_cuda(Tensor x, Tensor bias) -> Tensor");
  m.def("_conv_bias_residual_contiguous_cuda(Tensor x, Tensor bias, Tensor residual) -> Tensor");
  m.def("_conv_bias_depth_to_space_cuda(Tensor x, Tensor bias, Tensor residual) -> Tensor");
  m.def("_causal_pad_cuda(Tensor x, Tensor? cache, int[] padding, bool channels_last=False, bool replicate_t=False, "
        "bool reflect_hw=False) -> Tensor");
  m.def("_group_norm_silu_cuda(Tensor x, Tensor weight, Tensor bias, int groups, float eps, bool silu, int variant) "
        "-> Tensor");
  m.def("_group_norm_silu_cuda_out(Tensor(a!) out, Tensor x, Tensor weight, Tensor bias, int groups, float eps, "
        "bool silu, int variant) -> ()");
  m.def("_group_norm_silu_cl_cuda(Tensor x, Tensor weight, Tensor bias, int groups, float eps, bool silu, "
        "int variant) -> Tensor");
  m.def("_channel_rmsnorm_cuda(Tensor x, Tensor denom, Tensor gamma, Tensor? bias, float scale, float bias_value, "
        "bool silu, bool probe) -> Tensor");
  m.def("_ltx_rmsnorm_cuda(Tensor x, Tensor? rsqrt, bool square, bool silu, bool probe) -> Tensor");
  m.def("_ltx_rmsnorm_pad_cl_cuda(Tensor x, Tensor rsqrt, int[] padding, bool reflect_hw) -> Tensor");
  m.def("_channel_rmsnorm_pad_cl_cuda(Tensor x, Tensor denom, Tensor gamma, Tensor? bias, float scale, "
        "float bias_value, int[] padding) -> Tensor");
  m.def("_per_channel_rmsnorm_cuda(Tensor x, Tensor? mean, float eps, bool silu, int probe) -> Tensor");
  m.def("_per_channel_rmsnorm_fused_cuda(Tensor x, float eps, bool silu, int rows, int ctas, float factor, "
        "int probe) -> Tensor");
  m.def("_per_channel_rmsnorm_pad_cl_cuda(Tensor x, float eps, bool silu, int rows, int ctas, float factor, "
        "int[] dims, int[] padding, bool reflect_hw) -> Tensor");
  m.def("_per_channel_rmsnorm_cl_pad_cl_cuda(Tensor x, Tensor bias, float eps, bool silu, int rows, int ctas, "
        "float factor, int[] padding, bool reflect_hw) -> Tensor");
  m.def("_ltx_rmsnorm_fused_pad_cl_cuda(Tensor x, float eps, bool silu, int rows, int ctas, float factor, "
        "int[] dims, int[] padding, bool reflect_hw, int probe) -> Tensor");
  m.def("_ltx_rsqrt_probe_cuda(Tensor m, float eps) -> Tensor");
}

TORCH_LIBRARY_IMPL(diffusers_fastpath, CUDA, m) {
  m.impl("_upsample_nearest2x_cuda", &diffusers_fastpath::upsample_nearest2x);
  m.impl("_conv_bias_cuda_", &diffusers_fastpath::conv_bias_);
  m.impl("_conv_bias_contiguous_cuda", &diffusers_fastpath::conv_bias_contiguous);
  m.impl("_conv_bias_residual_contiguous_cuda", &diffusers_fastpath::conv_bias_residual_contiguous);
  m.impl("_conv_bias_depth_to_space_cuda", &diffusers_fastpath::conv_bias_depth_to_space);
  m.impl("_causal_pad_cuda", &diffusers_fastpath::causal_pad);
  m.impl("_group_norm_silu_cuda", &diffusers_fastpath::group_norm_silu);
  m.impl("_group_norm_silu_cuda_out", &diffusers_fastpath::group_norm_silu_out);
  m.impl("_group_norm_silu_cl_cuda", &diffusers_fastpath::group_norm_silu_cl);
  m.impl("_channel_rmsnorm_cuda", &diffusers_fastpath::channel_rmsnorm);
  m.impl("_ltx_rmsnorm_cuda", &diffusers_fastpath::ltx_rmsnorm);
  m.impl("_ltx_rmsnorm_pad_cl_cuda", &diffusers_fastpath::ltx_rmsnorm_pad_cl);
  m.impl("_channel_rmsnorm_pad_cl_cuda", &diffusers_fastpath::channel_rmsnorm_pad_cl);
  m.impl("_per_channel_rmsnorm_cuda", &diffusers_fastpath::per_channel_rmsnorm);
  m.impl("_per_channel_rmsnorm_fused_cuda", &diffusers_fastpath::per_channel_rmsnorm_fused);
  m.impl("_per_channel_rmsnorm_pad_cl_cuda", &diffusers_fastpath::per_channel_rmsnorm_pad_cl);
  m.impl("_per_channel_rmsnorm_cl_pad_cl_cuda", &diffusers_fastpath::per_channel_rmsnorm_cl_pad_cl);
  m.impl("_ltx_rmsnorm_fused_pad_cl_cuda", &diffusers_fastpath::ltx_rmsnorm_fused_pad_cl);
  m.impl("_ltx_rsqrt_probe_cuda", &diffusers_fastpath::ltx_rsqrt_probe);
}
