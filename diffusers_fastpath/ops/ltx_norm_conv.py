"""LTX-2's VAE norm, its SiLU and the causal convolution after them (diffusers' ``PerChannelRMSNorm``, ``nn.SiLU``,
``LTX2VideoCausalConv3d``: ``norm1 -> nonlinearity -> conv1`` and ``norm2 -> nonlinearity -> dropout -> conv2`` of
every ``LTX2VideoResnetBlock3d``, ``norm_out -> conv_act -> conv_out`` of the encoder and the decoder), with the
norm's result written straight into the convolution's padded, channels-last input; bit-identical to eager, checked
per signature.

Eager runs, for x ``[B, C, T, H, W]`` (the module calls, `diffusers_fastpath.models.vae_ltx2_chain` proves from the
block's forward that nothing else reads the values between them)::

    y      = F.silu(x / sqrt(mean(x**2, dim=1) + eps))       # the norm and its SiLU, each op rounded to T
    padded = F.pad(cat([y[:, :, :1] * t0, y, y[:, :, -1:] * t1], dim=2), reflect in h, w)   # the conv's input
    out    = F.conv3d(padded, w, b, ...)                     # cuDNN, which transposes padded to channels-last first

The patched sites before this op ran three passes for what is one here (``per_channel_rmsnorm_silu`` wrote y,
``ltx_causal_conv3d``'s ``causal_pad`` read it and wrote the padded buffer channels-last); here::

    padded = per_channel_rmsnorm_pad_cl(x)   # csrc/per_channel_rmsnorm_pad.cu's pad kernel: the fused norm kernel's
                                             # statistics and values (the same code: aten's mean order from
                                             # `mean_order`, r and the SiLU proven on every value), each value stored
                                             # at every padded position whose source it is, channels-last
    out    = convolve_channels_last(conv, padded, padding)   # cuDNN's convolution and the bias + transpose back,
                                                             # as `ltx_causal_conv3d` runs it (asked with `pending`,
                                                             # once the signature is checked: cuDNN's output and the
                                                             # bias as a `causal_conv_cl.PendingBias`, for
                                                             # `ltx_bias_norm_conv` to read)

Each element of the buffer is the value ``per_channel_rmsnorm_silu`` computes for its source position (the same
operations in the same order, so the same bits), placed where ``causal_pad`` would copy it; the convolution is the one
`ltx_causal_conv3d` runs on the same buffer. So the result is eager's wherever those two ops' are, and the op verifies
itself as they do: the first call of each signature (the norm's `per_channel_rmsnorm._signature` and the
convolution's `ltx_causal_conv._signature`) is compared with the eager chain, the norm's proofs (r and the SiLU on
every value of the dtype) run with it, and a mismatch disables the op for the process (one warning).

What the guard admits: what both ops' guards admit for x (the norm: a registered ``PerChannelRMSNorm`` of
``channel_dim`` 1, x's trailing dims contiguous; the convolution: a registered ``LTX2VideoCausalConv3d``, its inner
``nn.Conv3d`` without hooks, x a shape it takes), the activation exactly ``nn.SiLU``, the norm's mean in an order
`mean_order` reproduces (else the separate ops run: aten's mean), and the convolution's channels-last path (bf16 /
fp16, a bias, a contiguous weight); the three modules without hooks (their calls are what this stands for). Anything
else runs the module calls as written (`diffusers_fastpath.models.vae_ltx2_chain`: the norm -> SiLU pair's own site,
then the convolution's).
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from . import _nvrtc
from . import ltx_causal_conv as _conv
from ._build import LazyLauncher
from ._policy import FLOAT_DTYPES, FusedOp, Site, wide_probe
from .causal_conv_cl import convolve_channels_last

# the norm's module (the package binds the name `per_channel_rmsnorm` to its op function); read through it, so that
# what tests replace there is what runs here
_norm = importlib.import_module(f"{__package__}.per_channel_rmsnorm")


def ltx_norm_conv_ref(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor, causal: bool,
                      pending: bool = False) -> torch.Tensor:
    """The eager chain: diffusers' norm, ``F.silu`` (an ``nn.SiLU`` module's forward), diffusers' convolution
    (`pending`: see `ltx_norm_conv`; the tensor here)."""
    return _conv.ltx_causal_conv3d_ref(conv, _norm.per_channel_rmsnorm_silu_ref(norm, x), causal)


def _fallback(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor, causal: bool,
              pending: bool = False) -> torch.Tensor:
    """The module calls, as the block's statements make them."""
    return conv(act(norm(x)), causal=causal)


def _guard(norm, act, conv, x: torch.Tensor, causal, pending: bool = False, check_pointers: bool = True) -> str | None:
    """``None`` when the one-buffer chain takes these inputs, else the reason it does not (counted at the site)."""
    if type(act) is not nn.SiLU:
        return f"{type(act).__name__} is not nn.SiLU"
    if not isinstance(causal, bool):
        return "causal not a bool"
    reason = _norm._guard(norm, x)
    if reason is not None and not reason.startswith("device "):
        return reason
    device_reason = reason  # (the norm's last check: given after the convolution's own, as causal_conv_cl does)
    reason = _conv._guard(conv, x, causal)
    if reason is not None and not reason.startswith("device "):
        return reason
    if not _conv._channels_last(conv.conv, x):
        return "the convolution's channels-first path"
    order = _mean_order(x)
    if type(order) is not _norm.MeanOrder:
        return f"aten's mean: {order}"
    return device_reason or reason


def _mean_order(x: torch.Tensor):
    """aten's order of the norm's mean of x on x's device (`per_channel_rmsnorm.mean_order`), or why none is
    reproduced (on a CPU: "not on a CUDA device"; the tests' emulated kernels take a CPU for a GPU here)."""
    return _norm.mean_order(x)


def _signature(norm, act, conv, x: torch.Tensor, causal, pending: bool = False):
    """What one first-call check vouches for: the norm's signature (dtype, vectors, eps, the mean's order) and the
    convolution's (what cuDNN picks its engine by); a call asking for a `PendingBias` is the same signature (its
    result differs only in the bias add and the transpose left to the reader, exact by construction)."""
    return _norm._signature(norm, x), _conv._signature(conv, x, causal)


def _prove(norm, act, conv, x: torch.Tensor, causal, pending: bool = False) -> bool:
    """The norm's proofs: r and the SiLU on every value of the dtype (the kernel shares their device functions)."""
    return _norm._prove_rms_silu(norm, x)


def _kernel(norm, act, conv, x: torch.Tensor, causal, pending: bool = False):
    padding, conv_padding, reflect = _conv._plan(conv, causal)
    order = _mean_order(x)
    batch, channels = x.shape[:2]
    padded = _launch(x.reshape(batch, channels, -1), _norm.eps_as_added(norm.eps, x.dtype, x.device), True,
                     order.rows, order.ctas, order.factor, list(x.shape[2:]), padding, reflect)
    # (a `PendingBias` only once this signature's tensor matched eager: the first call returns the tensor it checks)
    pending = pending and _signature(norm, act, conv, x, causal) in LTX_NORM_CONV.verified
    return convolve_channels_last(conv.conv, padded, conv_padding, pending)


# The NVRTC way (ops/_nvrtc.py): csrc/per_channel_rmsnorm_pad.cu's pad kernel, launched as its launch_pad_cl and
# bindings_vae.cpp's per_channel_rmsnorm_pad_cl do: the NormPadArgs fields (fastpath.h), the channels-last output, the
# fused kernel's shape (`per_channel_rmsnorm.fused_shape`), vectors where x's sizes, strides and pointer allow.
_PAD_ARGS = _nvrtc.Params("NormPadArgs", ("frames", "q"), ("height", "q"), ("width", "q"), ("pad_t0", "q"),
                          ("pad_t1", "q"), ("pad_h0", "q"), ("pad_h1", "q"), ("pad_w0", "q"), ("pad_w1", "q"),
                          ("reflect_hw", "i"))
_NVRTC_PAD = _nvrtc.Kernel("per_channel_rmsnorm_pad.cu", "diffusers_fastpath::per_channel_rmsnorm_pad_cl_kernel",
                           {(dtype, vector): f"{_nvrtc.STORAGE_TYPE[dtype]}, {str(vector).lower()}"
                            for dtype in FLOAT_DTYPES for vector in (True, False)},
                           _nvrtc.Params("per_channel_rmsnorm_pad_cl_kernel", ("a", _norm._ARGS), ("g", _PAD_ARGS),
                                         ("rows", "i"), ("ctas", "i"), ("factor", "f")))


def _raw_guard(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw):
    if x.dim() != 3 or x.dtype not in FLOAT_DTYPES or (x.shape[2] > 1 and x.stride(2) != 1):
        return "x"
    if not (1 <= rows <= 512 and rows & (rows - 1) == 0 and 1 <= ctas <= 65536):
        return "order"
    if len(dims) != 3 or min(dims) < 1 or dims[0] * dims[1] * dims[2] != x.shape[2]:
        return "dims"
    if len(padding) != 6 or min(padding) < 0 or not (
            max(padding[:2]) < dims[2] and max(padding[2:4]) < dims[1] if reflect_hw else not any(padding[:4])):
        return "padding"
    if not x.is_cuda:
        return "device"
    return None


def pad_launch(kernel: _nvrtc.Kernel, what: str, x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw,
               probe: int = 0, out=None):
    """A pad kernel's launch as the .cu's launch_pad_cl makes it (this op's; `ltx_vae_rmsnorm_conv`'s kLtx one):
    `out` (default the channels-last padded buffer), vectors where x's sizes, strides and pointer allow (the key
    ``(dtype, vector)``), `fused_shape`, the args struct, NormPadArgs and the order; `what` names the op in the
    error where the partial sums do not fit."""
    batch, channels, spatial = x.shape
    frames, height, width = dims
    pw0, pw1, ph0, ph1, pt0, pt1 = padding
    if out is None:
        out = torch.empty(batch, channels, pt0 + frames + pt1, ph0 + height + ph1, pw0 + width + pw1, dtype=x.dtype,
                          device=x.device, memory_format=torch.channels_last_3d)
    vec = _norm._VEC_BYTES // x.element_size()
    vector = (spatial % vec == 0 and x.stride(1) % vec == 0 and x.stride(0) % vec == 0
              and x.data_ptr() % _norm._VEC_BYTES == 0)
    device = x.device.index
    shape = _norm.fused_shape(batch, spatial, _norm.MeanOrder(rows, ctas, factor), vec if vector else 1,
                              _nvrtc.num_sms(device))
    if shape is None:
        raise ValueError(f"{what}: aten's partial sums do not fit the kernel's scratch")
    if x.numel() == 0:
        return out
    kernel.launch(device, (x.dtype, vector), *shape, out.data_ptr(), x.data_ptr(), 0, batch, channels, spatial,
                  x.stride(0), x.stride(1), eps, int(silu), probe, _nvrtc.DTYPE_CODE[x.dtype], frames, height, width,
                  pt0, pt1, ph0, ph1, pw0, pw1, int(reflect_hw), rows, ctas, factor)
    return out


def _nvrtc_pad(x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw):
    return pad_launch(_NVRTC_PAD, "per_channel_rmsnorm_pad_cl", x, eps, silu, rows, ctas, factor, dims, padding,
                      reflect_hw)


_nvrtc.raw_op("_per_channel_rmsnorm_pad_cl_cuda",
              "(Tensor x, float eps, bool silu, int rows, int ctas, float factor, int[] dims, int[] padding, "
              "bool reflect_hw) -> Tensor", _raw_guard, _nvrtc_pad)

# (x, eps, silu, rows, ctas, factor, dims, padding, reflect_hw)
_launch = LazyLauncher(_nvrtc_pad, "_per_channel_rmsnorm_pad_cl_cuda")


def norm_pad_arithmetic(x: torch.Tensor, mean: torch.Tensor, eps: float, silu: bool, dims, padding,
                        reflect_hw: bool) -> torch.Tensor:
    """What the pad kernel writes, in torch, for x ``[B, C, S]`` and its ``[B, S]`` mean (the tests' emulation, and
    the kernel's documentation in code): the norm's arithmetic (`per_channel_rmsnorm_arithmetic`), then
    ``causal_pad``'s buffer of it (`causal_conv_pad.pad_arithmetic`: the repeated frames, the reflected border),
    channels-last."""
    from .causal_conv_pad import pad_arithmetic

    y = _norm.per_channel_rmsnorm_arithmetic(x, mean.view(x.shape[0], 1, -1), eps, silu)
    return pad_arithmetic(y.reshape(*x.shape[:2], *dims), None, list(padding), True, True, reflect_hw)


LTX_NORM_CONV = FusedOp("ltx_norm_conv", ref=ltx_norm_conv_ref, guard=_guard, kernel=_kernel, custom_op=ltx_norm_conv_ref,
                        verify_key=_signature, prove=_prove, fallback=_fallback, probe=wide_probe(3, 5),
                        modules=(0, 1, 2))  # the norm, the SiLU and the convolution: their calls are what this stands for


def ltx_norm_conv(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor, causal: bool = True,
                  site: Site | None = None, pending: bool = False):
    """``conv(act(norm(x)), causal=causal)`` for LTX-2's VAE norm, its ``nn.SiLU`` and the causal convolution that
    reads them, the norm written into the convolution's padded channels-last input (see the module doc),
    bit-identical to eager (checked on the first call of each signature). With `pending`, where the kernel runs and
    this signature was checked already, the convolution's channels-last output and its bias as a
    `causal_conv_cl.PendingBias` instead of the tensor (for a reader that adds the bias itself:
    `diffusers_fastpath.ops.ltx_bias_norm_conv`; elsewhere the tensor).

    Args:
        norm: the ``PerChannelRMSNorm`` (registered by the VAE adapter).
        act: the ``nn.SiLU`` after it.
        conv: the ``LTX2VideoCausalConv3d`` that reads the SiLU's result.
        x: ``[B, C, T, H, W]`` activations.
        causal: the convolution's ``causal`` argument.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        pending: ask for a `PendingBias` (above).
    """
    return LTX_NORM_CONV(site, norm, act, conv, x, causal, pending)
