"""LTX-Video's VAE norm, its SiLU and the causal convolution after them (diffusers' weightless ``RMSNorm`` on the
channel-last view, ``nn.SiLU``, ``LTXVideoCausalConv3d``: ``norm1 -> nonlinearity -> conv1`` and ``norm2 ->
nonlinearity -> dropout -> conv2`` of every ``LTXVideoResnetBlock3d``, ``norm_out -> conv_act -> conv_out`` of the
encoder and the decoder), with the norm's result written straight into the convolution's padded, channels-last input;
bit-identical to eager, checked per signature.

Eager runs, for x ``[B, C, T, H, W]`` (the module calls; `diffusers_fastpath.models.vae_ltx2_chain` proves from the
block's forward that nothing else reads the values between them)::

    r      = torch.rsqrt(x.movedim(1, -1).to(float32).pow(2).mean(-1, keepdim=True) + eps)   # aten
    y      = F.silu((x.movedim(1, -1).to(float32) * r).to(T)).movedim(-1, 1)   # the norm's multiply and cast, SiLU
    padded = cat([y[:, :, :1].repeat(k - 1), y], dim=2)   # the convolution's forward (non-causal: the first and the
                                                          # last frame, (k - 1) // 2 times each)
    out    = F.conv3d(padded, w, b, ...)                  # cuDNN, which transposes padded to channels-last first

The patched sites before this op ran, after the norm's squares pass, aten's mean and rsqrt, two passes for what is one
here (``ltx_vae_rmsnorm_silu``'s multiply, cast and SiLU wrote y; ``ltx_causal_conv3d``'s ``causal_pad`` read it and
wrote the padded buffer channels-last); here one kernel from x::

    padded = ltx_rmsnorm_fused_pad_cl(x)            # csrc/per_channel_rmsnorm_pad.cu's pad kernel, kLtx: LTX-2's
                                                    # statistics (aten's reduce order, `mean_order`) on the fp32 squares
                                                    # (exact: nothing rounds), m fp32, r = rsqrtf(m + eps), each value
                                                    # the pair kernel's epilogue (elementwise.cuh's ltx_rmsnorm_value:
                                                    # one IEEE product rounded, the SiLU of it rounded), staged in
                                                    # shared memory and stored along the channels in 16-byte vectors
                                                    # at every padded position whose source it is
    out    = convolve_channels_last(conv, padded)   # cuDNN's convolution and the bias + transpose back, as
                                                    # `ltx_causal_conv3d` runs it

The mean: eager's ``x.movedim(1, -1).to(float32).pow(2)`` keeps x's memory order (channel-first, dense), so its
``mean(-1)`` is aten's reduce kernel over the iterator ``[C, S, B]`` with an fp32 input: the reduction LTX-2's
``torch.mean(x**2, dim=1)`` runs, whose order `per_channel_rmsnorm` ports (`mean_order`; the same float adds in the
same order, `ltx_mean_arithmetic` in torch); the square of a bf16 / fp16 value is exact in fp32, so the kernel's
squares are eager's. At LTX-Video's decoder shapes (132 SMs) every norm is 4 partial sums per position in one block.
``rsqrt(m + eps)`` is a function of the one value m: proven on all 2^32 fp32 bit patterns against eager's
``torch.rsqrt(m + eps)`` on the device (`_prove_rsqrt`, once per device and eps); the tail proven as before (below).
Where aten's order is not reproduced (`mean_order`'s reasons, counted in `MEAN_FALLBACKS`) the path before runs::

    r      = reciprocal(x)                          # as ltx_vae_rmsnorm_silu: the squares kernel, aten's mean, rsqrt
    padded = ltx_rmsnorm_pad_cl(x, r)               # csrc/causal_pad.cu's ltx_rmsnorm_pad_cl_kernel: causal_pad's
                                                    # channels-last copy, each value of x replaced as it is read by
                                                    # the pair kernel's epilogue

Each element of the buffer is the value ``ltx_vae_rmsnorm_silu`` computes for its source position (the same device
function on the same operands, so the same bits: its reciprocal the same float operations as aten's mean and rsqrt),
placed where ``causal_pad`` would copy it; the convolution is the one `ltx_causal_conv3d` runs on the same buffer. So
the result is eager's wherever those two ops' are, and the op verifies itself as they do: the first call of each
signature (the norm's `ltx_vae_rmsnorm._signature`, the mean's order and the convolution's `ltx_causal_conv._signature`)
is compared with the eager chain, and the kernels' own tail is proven on every value of the dtype with the reciprocal 1
(`_prove`: its multiply, rounding and SiLU against eager's ``F.silu((v.float() * 1).to(T))``, all 65536 values; the
fused kernel's tail is the same device function); a mismatch disables the op for the process (one warning).

What the guard admits: what both ops' guards admit for x (the norm's on the view ``x.movedim(1, -1)``: a registered
weightless ``RMSNorm``, x's channels each contiguous, 16-byte aligned, sizes the squares kernel takes; the
convolution's: a registered ``LTXVideoCausalConv3d`` (or LTX-2's class: `causal` then its argument), its inner
``nn.Conv3d`` without hooks, a shape it takes), the activation exactly ``nn.SiLU``, and the convolution's
channels-last path (bf16 / fp16, a bias, a contiguous weight: fp32 is refused there); the three modules without hooks
(their calls are what this stands for). Anything else runs the module calls as written (`vae_ltx2_chain`: the pair's
own site, then the convolution's).
"""

from __future__ import annotations

import importlib
from collections import Counter

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from . import causal_conv_pad as _pad
from . import ltx_causal_conv as _conv
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site, wide_probe
from ._unary_proof import mismatches, prove_fp32
from .causal_conv_cl import convolve_channels_last
from .gelu_cat import every_value

# the norm's module (the package binds the name `ltx_vae_rmsnorm` to its op function); read through it, so that what
# tests replace there is what runs here
_norm = importlib.import_module(f"{__package__}.ltx_vae_rmsnorm")
# LTX-2's norm and its chain: the port of aten's reduce order and the pad kernel (its kLtx instantiation) live there
_pcr = importlib.import_module(f"{__package__}.per_channel_rmsnorm")
_ltx2_chain = importlib.import_module(f"{__package__}.ltx_norm_conv")


def _conv_call(conv: nn.Module, y: torch.Tensor, causal: bool | None) -> torch.Tensor:
    """The convolution's module call as the block makes it: LTX-Video's without an argument (`causal` None)."""
    return conv(y) if causal is None else conv(y, causal=causal)


def ltx_vae_rmsnorm_conv_ref(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor,
                             causal: bool | None = None) -> torch.Tensor:
    """The eager chain: diffusers' norm on the channel-last view and ``F.silu`` (`ltx_vae_rmsnorm_silu_ref`), moved
    back, then diffusers' convolution."""
    y = _norm.ltx_vae_rmsnorm_silu_ref(norm, x.movedim(1, -1)).movedim(-1, 1)
    return _conv.ltx_causal_conv3d_ref(conv, y, causal)


def _fallback(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor,
              causal: bool | None = None) -> torch.Tensor:
    """The module calls, as the block's statements make them."""
    return _conv_call(conv, act(norm(x.movedim(1, -1)).movedim(-1, 1)), causal)


def _guard(norm, act, conv, x: torch.Tensor, causal=None, check_pointers: bool = True) -> str | None:
    """``None`` when the one-buffer chain takes these inputs, else the reason it does not (counted at the site)."""
    if type(act) is not nn.SiLU:
        return f"{type(act).__name__} is not nn.SiLU"
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return "x not [B, C, T, H, W]"
    reason = _norm._guard(norm, x.movedim(1, -1), check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    device_reason = reason  # (the norm's last check: given after the convolution's own, as causal_conv_cl does)
    reason = _conv._guard(conv, x, causal, check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    if not _conv._channels_last(conv.conv, x):
        return "the convolution's channels-first path"
    return device_reason or reason


def _signature(norm, act, conv, x: torch.Tensor, causal=None):
    """What one first-call check vouches for: the norm's signature (the dtype, x dense or with its channels apart:
    where the squares come from), the mean's order (`mean_order`: the channels, rows and ctas of the fused kernel's
    statistics, or aten's own mean) and the convolution's signature (what cuDNN picks its engine by)."""
    order = _mean_order(x)
    mean = (f"mean of {x.shape[1]} in {order.rows} x {order.ctas}" if type(order) is _pcr.MeanOrder
            else "aten's mean")
    return _norm._signature(norm, x.movedim(1, -1)), mean, _conv._signature(conv, x, causal)


def tail_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel on a ``[1, 1, n]`` row as x ``[1, 1, 1, 1, n]`` with the reciprocal 1.0 everywhere and nothing
    padded: ``round(silu(round(v * 1.0)))`` of each value, for `_unary_proof.mismatches`."""
    ones = torch.ones(1, row.shape[-1], dtype=torch.float32, device=row.device)
    return _launch(row.reshape(1, 1, 1, 1, -1), ones, [0] * 6, False).reshape(row.shape)


def tail_ref(values: torch.Tensor) -> torch.Tensor:
    """Eager's chain of the norm's tail and the SiLU with the reciprocal 1.0: the mixed-dtype multiply (a float32
    tensor of ones), ``.to(T)``, ``F.silu``."""
    return F.silu((values.to(torch.float32) * torch.ones_like(values, dtype=torch.float32)).to(values.dtype))


_RSQRT_PROVEN: set = set()  # (device, eps) where `_prove_rsqrt` passed


def rsqrt_ref(eps: float):
    """Eager's reciprocal of a position's mean m: ``torch.rsqrt(m + eps)`` (two aten kernels on fp32 tensors)."""
    return lambda m: torch.rsqrt(m + eps)


def _prove_rsqrt(eps: float, device: torch.device) -> bool:
    """The fused kernel's ``rsqrtf(m + eps)`` (its device function, through the probe kernel) equals eager's on all
    2^32 fp32 bit patterns (`_unary_proof.prove_fp32`), once per device and eps."""
    key = (device, float(eps))
    if key not in _RSQRT_PROVEN:
        if not prove_fp32(device, lambda row: _launch_rsqrt(row.contiguous(), float(eps)), rsqrt_ref(eps)):
            return False
        _RSQRT_PROVEN.add(key)
    return True


def _prove(norm, act, conv, x: torch.Tensor, causal=None) -> bool:
    """The kernels' tail (multiply, rounding, SiLU) equals eager's on every value of x's dtype, on x's device; where
    the fused kernel runs (`mean_order`), its reciprocal equals eager's on every fp32 value (`_prove_rsqrt`)."""
    if int(mismatches(every_value(x.dtype, x.device).flatten(), tail_probe, tail_ref)) != 0:
        return False
    return type(_mean_order(x)) is not _pcr.MeanOrder or _prove_rsqrt(norm.eps, x.device)


# --- aten's order of the norm's mean, as the fused kernel takes it ---------------------------------------------------

MEAN_FALLBACKS: Counter = Counter()  # calls that ran aten's squares, mean and rsqrt, by `mean_order`'s reason


def mean_order(x: torch.Tensor, limits: tuple | None = None):
    """aten's order of eager's ``x.movedim(1, -1).to(float32).pow(2).mean(-1)`` for x ``[B, C, T, H, W]`` (the
    guard's layouts: each channel's positions contiguous, channels and batches possibly apart) on x's device
    (`per_channel_rmsnorm.MeanOrder`: the partial sums of its reduce kernel, its factor), or why the fused kernel does
    not reproduce it. The upcast keeps the view's memory order (``_to_copy``'s preserve format: x's strides where x is
    dense, else dense strides in the same order, so an upsampler's sliced output too) and the square keeps the
    upcast's: the mean reads a dense channel-first fp32 tensor whatever the gaps in x, the iterator ``[C, S, B]`` of
    LTX-2's ``torch.mean(x**2, dim=1)``, whose order `per_channel_rmsnorm` ports (`aten_reduce_config` of an fp32
    input: the element size enters only through the output vectors, which the same pointer alignment and strides in
    elements give alike), with its refusals for an fp32 input (the squares' bytes beyond 32-bit indexing, C a multiple
    of 1024: other accumulators) and its kernel's (the scratch, the grid). `limits` (SMs, threads per SM) stand for the
    device's (the tests' emulated kernels: a CPU x as an H100's)."""
    limits = _pcr._device_limits(x.device) if limits is None else limits
    if limits is None:
        return "not on a CUDA device"
    batch, channels = int(x.shape[0]), int(x.shape[1])
    return _pcr._order(batch, channels, x.numel() // max(1, batch * channels), torch.float32, limits, x.dtype)


def _mean_order(x: torch.Tensor):
    """`mean_order` (the tests' emulated kernels take a CPU for a GPU here)."""
    return mean_order(x)


def _kernel(norm, act, conv, x: torch.Tensor, causal=None) -> torch.Tensor:
    padding, conv_padding, reflect = _conv._plan(conv, causal)
    order = _mean_order(x)
    if type(order) is _pcr.MeanOrder:  # one kernel from x: the squares, aten's mean, the rsqrt, the tail, the pad
        batch, channels = x.shape[:2]
        padded = _launch_fused(x.reshape(batch, channels, -1), float(norm.eps), True, order.rows, order.ctas,
                               order.factor, list(x.shape[2:]), padding, reflect, 0)
    else:
        MEAN_FALLBACKS[order] += 1
        # (aten's [B, T, H, W, 1], one per position, contiguous as the pair kernel takes it: `ltx_vae_rmsnorm._fused`)
        r = _norm.reciprocal(x.movedim(1, -1), norm.eps, _norm._square).contiguous()
        padded = _launch(x, r.view(x.shape[0], -1), padding, reflect)
    return convolve_channels_last(conv.conv, padded, conv_padding)


# The NVRTC way (ops/_nvrtc.py): csrc/causal_pad.cu's norm kernels, launched as its launch_norm and bindings_vae.cpp's
# ltx_rmsnorm_pad_cl do: causal_pad's arguments and output (`causal_conv_pad.launch_fields`: channels-last, the frames
# repeated, no cache; the wide kernel where its vectors are whole), the grid of that kernel, then the reciprocal.
_NVRTC, _NVRTC_WIDE = (_nvrtc.Kernel("causal_pad.cu", f"diffusers_fastpath::{name}",
                                     {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
                                     _nvrtc.Params(name, ("a", _pad._ARGS), ("rsqrt", "P")))
                       for name in ("ltx_rmsnorm_pad_cl_kernel", "ltx_rmsnorm_pad_cl_wide_kernel"))


def _raw_guard(x, rsqrt, padding, reflect_hw):
    reason = _pad._raw_guard(x, None, padding, True, True, reflect_hw)
    if reason is not None:
        return reason
    if x.dtype not in HALF_DTYPES:
        return "dtype"
    if not (rsqrt.dtype == torch.float32 and rsqrt.is_contiguous() and rsqrt.device == x.device
            and rsqrt.numel() == x.shape[0] * x.shape[2] * x.shape[3] * x.shape[4]):
        return "rsqrt"
    return None


def _nvrtc_kernel(x: torch.Tensor, rsqrt: torch.Tensor, padding: list[int], reflect_hw: bool) -> torch.Tensor:
    out, fields, wide, grid, block = _pad.launch_fields(x, None, padding, True, True, reflect_hw, rsqrt)
    if out.numel():
        (_NVRTC_WIDE if wide else _NVRTC).launch(x.device.index, x.dtype, grid, block, *fields, rsqrt.data_ptr())
    return out


_nvrtc.raw_op("_ltx_rmsnorm_pad_cl_cuda", "(Tensor x, Tensor rsqrt, int[] padding, bool reflect_hw) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_ltx_rmsnorm_pad_cl_cuda")  # (x, rsqrt, padding, reflect_hw)

# The fused kernel the NVRTC way: csrc/per_channel_rmsnorm_pad.cu's pad kernel with kLtx, launched as its
# launch_ltx_pad_cl and bindings_vae.cpp's ltx_rmsnorm_fused_pad_cl do: LTX-2's pad kernel's parameters, output and
# shape (`ltx_norm_conv._nvrtc_pad`), the mean alone (fp32 [B, S]) in probe mode 3.
_NVRTC_FUSED = _nvrtc.Kernel("per_channel_rmsnorm_pad.cu", "diffusers_fastpath::per_channel_rmsnorm_pad_cl_kernel",
                             {(dtype, vector): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(vector).lower()}, true"
                              for dtype in HALF_DTYPES for vector in (True, False)},
                             _ltx2_chain._NVRTC_PAD.params)


def _raw_fused_guard(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe):
    if x.dim() == 3 and x.dtype not in HALF_DTYPES:
        return "dtype"
    if probe not in (0, _pcr.PROBE_MEAN) or (probe and silu):
        return "probe"
    return _ltx2_chain._raw_guard(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw)


def _nvrtc_fused(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe):
    out = (torch.empty(x.shape[0], x.shape[2], dtype=torch.float32, device=x.device) if probe == _pcr.PROBE_MEAN
           else None)  # (else the padded buffer)
    return _ltx2_chain.pad_launch(_NVRTC_FUSED, "ltx_rmsnorm_fused_pad_cl", x, eps, silu, rows, ctas, factor, dims,
                                  padding, reflect_hw, probe, out)


_nvrtc.raw_op("_ltx_rmsnorm_fused_pad_cl_cuda",
              "(Tensor x, float eps, bool silu, int rows, int ctas, float factor, int[] dims, int[] padding, "
              "bool reflect_hw, int probe) -> Tensor", _raw_fused_guard, _nvrtc_fused)

# (x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw, probe)
_launch_fused = LazyLauncher(_nvrtc_fused, "_ltx_rmsnorm_fused_pad_cl_cuda")

# The reciprocal's probe (its proof), launched as launch_ltx_rsqrt_probe does: a grid stride over m's values.
_PROBE_THREADS, _PROBE_BLOCKS_PER_SM = 256, 8  # csrc/per_channel_rmsnorm.cuh's kThreads, kBlocksPerSm
_NVRTC_RSQRT = _nvrtc.Kernel("per_channel_rmsnorm_pad.cu", "diffusers_fastpath::ltx_rsqrt_probe_kernel",
                             {torch.float32: "float"},
                             _nvrtc.Params("ltx_rsqrt_probe_kernel", ("m", "P"), ("out", "P"), ("n", "q"),
                                           ("eps", "f")))


def _raw_rsqrt_guard(m, eps):
    if m.dtype != torch.float32 or not m.is_contiguous():
        return "m"
    if not m.is_cuda:
        return "device"
    return None


def _nvrtc_rsqrt(m, eps):
    out = torch.empty_like(m)
    if m.numel() == 0:
        return out
    device = m.device.index
    blocks = _nvrtc.grid_stride_blocks(device, m.numel(), _PROBE_THREADS, _PROBE_BLOCKS_PER_SM)
    _NVRTC_RSQRT.launch(device, torch.float32, (blocks, 1, 1), (_PROBE_THREADS, 1, 1), m.data_ptr(), out.data_ptr(),
                        m.numel(), eps)
    return out


_nvrtc.raw_op("_ltx_rsqrt_probe_cuda", "(Tensor m, float eps) -> Tensor", _raw_rsqrt_guard, _nvrtc_rsqrt)

_launch_rsqrt = LazyLauncher(_nvrtc_rsqrt, "_ltx_rsqrt_probe_cuda")  # (m, eps)


def norm_pad_arithmetic(x: torch.Tensor, rsqrt: torch.Tensor, padding, reflect_hw: bool) -> torch.Tensor:
    """What the kernel writes, in torch, for x ``[B, C, T, H, W]`` and its ``[B, T * H * W]`` reciprocal (the tests'
    emulation, and the kernel's documentation in code): the pair's arithmetic (`ltx_rmsnorm_arithmetic` with the SiLU),
    then ``causal_pad``'s buffer of it (`causal_conv_pad.pad_arithmetic`: the repeated frames, the reflected border),
    channels-last."""
    view = x.movedim(1, -1)
    y = _norm.ltx_rmsnorm_arithmetic(view, rsqrt.reshape(*view.shape[:-1], 1), silu=True).movedim(-1, 1)
    return _pad.pad_arithmetic(y, None, list(padding), True, True, reflect_hw)


def ltx_mean_arithmetic(x: torch.Tensor, order) -> torch.Tensor:
    """The fused kernel's statistics in torch for x ``[B, C, S]`` (bf16 / fp16) in the order `order`: LTX-2's
    `channel_mean_arithmetic` of the fp32 upcast (its squares rounded to fp32: exact, nothing rounds; its mean fp32),
    ``[B, S]`` fp32: eager's ``x.movedim(1, -1).to(float32).pow(2).mean(-1)`` where `order` is aten's."""
    return _pcr.channel_mean_arithmetic(x.float(), order)


def fused_pad_arithmetic(x: torch.Tensor, mean: torch.Tensor, eps: float, silu: bool, dims, padding,
                         reflect_hw: bool) -> torch.Tensor:
    """What the fused kernel writes, in torch, for x ``[B, C, S]`` and its fp32 ``[B, S]`` mean of squares (the
    kernel's: `ltx_mean_arithmetic` in aten's order; the tests' emulated kernel passes eager's own): ``rsqrt(mean +
    eps)`` (two fp32 ops, as eager; the kernel's rsqrtf is proven equal to CUDA's ``torch.rsqrt`` on every value), the
    pair's arithmetic and ``causal_pad``'s buffer of it (`norm_pad_arithmetic`; `silu` False: the norm alone)."""
    r = torch.rsqrt(mean + eps)
    batch, channels = x.shape[:2]
    view = x.reshape(batch, channels, *dims).movedim(1, -1)
    y = _norm.ltx_rmsnorm_arithmetic(view, r.reshape(*view.shape[:-1], 1), silu=silu).movedim(-1, 1)
    return _pad.pad_arithmetic(y, None, list(padding), True, True, reflect_hw)


LTX_VAE_RMSNORM_CONV = FusedOp("ltx_vae_rmsnorm_conv", ref=ltx_vae_rmsnorm_conv_ref, guard=_guard, kernel=_kernel,
                               custom_op=ltx_vae_rmsnorm_conv_ref, verify_key=_signature, prove=_prove,
                               fallback=_fallback, probe=wide_probe(3),
                               modules=(0, 1, 2))  # the norm, the SiLU and the convolution: what this stands for


def ltx_vae_rmsnorm_conv(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor,
                         causal: bool | None = None, site: Site | None = None) -> torch.Tensor:
    """``conv(act(norm(x.movedim(1, -1)).movedim(-1, 1)))`` for LTX-Video's VAE norm, its ``nn.SiLU`` and the causal
    convolution that reads them, the norm written into the convolution's padded channels-last input (see the module
    doc), bit-identical to eager (checked on the first call of each signature).

    Args:
        norm: the weightless ``RMSNorm`` (registered by the VAE adapter).
        act: the ``nn.SiLU`` after it.
        conv: the ``LTXVideoCausalConv3d`` that reads the SiLU's result.
        x: ``[B, C, T, H, W]`` activations (channel first; the norm runs on ``x.movedim(1, -1)``).
        causal: ``None`` for LTX-Video's convolution (it reads ``self.is_causal``); LTX-2's argument otherwise.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LTX_VAE_RMSNORM_CONV(site, norm, act, conv, x, causal)
