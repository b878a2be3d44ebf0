"""LTX-2's VAE: a causal convolution's channels-last result, its bias not yet added, read by the norm -> SiLU -> causal
convolution after it (the resnets' ``conv1 -> norm2 -> nonlinearity -> dropout -> conv2``); bit-identical to eager,
checked per signature.

Eager runs, for the first convolution's padded input ``p1`` and the second's module ``conv2``::

    h   = F.conv3d(p1, w1, b1)                         # cuDNN without the bias, then aten's output.add_(b1): one fp32
                                                       # add rounded to T (Convolution.cpp, ConvBackend::Cudnn)
    out = conv2(F.silu(norm2(h)), causal=causal)       # the norm (x / sqrt(mean(x**2, dim=1) + eps)), its SiLU, the
                                                       # causal convolution: `ltx_norm_conv`'s chain

Before this op, the patched chain ran ``h`` through three passes: cuDNN's channels-last output ``raw``, then
``bias_contiguous`` (csrc/conv_bias.cu: ``round(raw + b1[c])`` written contiguous, the transpose back; 24.1 ms in 46
calls of the 768x512x121 decode on an H100), then `ltx_norm_conv`'s pad kernel reading ``h``. Here the first
convolution leaves ``raw`` and ``b1`` as a `causal_conv_cl.PendingBias` (`ltx_norm_conv` with ``pending``), and::

    padded = per_channel_rmsnorm_cl_pad_cl(raw, b1)    # per_channel_rmsnorm_pad.cu's channels-last kernel: each value
                                                       # round(raw + b1[c]) where it is loaded (bias_contiguous's
                                                       # arithmetic: h's value), the fused norm's statistics on those
                                                       # values (the same chains, in aten's order, read along the
                                                       # channels), the pad kernel's values and padded stores
    out    = convolve_channels_last(conv2.conv, padded, padding)   # as `ltx_norm_conv` runs it

Why it is eager's: each value the kernel reads is ``h``'s (the same fp32 add rounded to T that bias_contiguous does,
which is aten's add: exact by construction); the norm's statistics add the same squares in the same order as the
fused kernel's (chain rho of the 4 P chains, the units of `per_channel_rmsnorm`'s fused kernel: channels c = rho
modulo 4 P in channel order; a thread reads one position's 16-byte vectors of channels, whose element i is chain
rho = i of its range; then the fused kernel's own combine, `position_mean`); r, the division and the SiLU are the
pad kernel's code, each value stored where the pad kernel stores it. The first call of each signature (the dtype,
the channels, the eps and the mean's order, and the second convolution's `ltx_causal_conv._signature`) is compared
with the eager chain on ``PendingBias.settle()`` (bias_contiguous's tensor, eager's ``h``), the norm's proofs (r
and the SiLU on every value of the dtype) run with it, and a mismatch disables the op for the process (one warning).

Who may hold a `PendingBias`: `diffusers_fastpath.models.vae_ltx2_chain` asks the first convolution for one only
where the block's rewritten forward proves that the value reaches this op's call or ``settle`` before any other
reader (see there); this op's refusals settle it and run `ltx_norm_conv`'s path on the tensor, as before. Asked
with ``pending`` (the resnet's ``conv2``, whose result only the residual add reads), this op leaves the second
convolution's result pending in turn, once its signature is checked (`diffusers_fastpath.ops.conv_bias_residual`
reads it).

What the guard admits (anything else: the caller settles and runs the chain as before): a `PendingBias` whose ``raw``
is a bf16/fp16 ``[B, C, T, H, W]`` laid out channels_last_3d with C a multiple of 8 and ``bias`` a contiguous ``[C]``
of its dtype, both 16-byte aligned; the norm, the SiLU and the convolution as `ltx_norm_conv`'s guard admits them
(modules registered, no hooks, the convolution's channels-last path, a shape it takes) and the mean's order one
`per_channel_rmsnorm.mean_order` reproduces whose 4 P chains map onto the 16-byte vectors (4 P a multiple of 8, or
4) and fit the kernel's scratch (`cl_shape`); no autocast, no autograd, on CUDA.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from . import _nvrtc
from . import ltx_causal_conv as _conv
from ._aten_reduce import div_up
from ._build import LazyLauncher
from ._policy import (FLOAT_DTYPES, HALF_DTYPES, REASON_AUTOCAST, FusedOp, Site, autocast_on, autograd_device_reason,
                      probe_seeds, wide_like)
from .causal_conv_cl import PendingBias, convolve_channels_last
from .conv_bias import bias_contiguous_arithmetic

# the modules of the norm and of the chain (the package binds their names to the op functions); read through them,
# so that what tests replace there is what runs here
_norm = importlib.import_module(f"{__package__}.per_channel_rmsnorm")
_norm_conv = importlib.import_module(f"{__package__}.ltx_norm_conv")

_VEC_BYTES = 16


def ltx_bias_norm_conv_ref(norm: nn.Module, act: nn.Module, conv: nn.Module, x: PendingBias, causal: bool,
                           pending: bool = False) -> torch.Tensor:
    """The eager chain on the first convolution's tensor: `ltx_norm_conv`'s reference on ``x.settle()`` (`pending`:
    see `ltx_bias_norm_conv`; the tensor here)."""
    return _norm_conv.ltx_norm_conv_ref(norm, act, conv, x.settle(), causal)


def _fallback(norm: nn.Module, act: nn.Module, conv: nn.Module, x: PendingBias, causal: bool,
              pending: bool = False) -> torch.Tensor:
    """The module calls on the first convolution's tensor."""
    return _norm_conv._fallback(norm, act, conv, x.settle(), causal)


def _guard(norm, act, conv, x, causal, pending: bool = False, check_pointers: bool = True) -> str | None:
    """``None`` when the channels-last kernel takes these inputs, else the reason it does not (counted at the site)."""
    if type(x) is not PendingBias:
        return "x not a convolution's pending result"
    raw, bias = x.raw, x.bias
    if type(act) is not nn.SiLU:
        return f"{type(act).__name__} is not nn.SiLU"
    if not isinstance(causal, bool):
        return "causal not a bool"
    reason = _norm.module_reason(norm)
    if reason is not None:
        return reason
    if not isinstance(raw, torch.Tensor) or raw.dtype not in HALF_DTYPES:
        return f"dtype {str(getattr(raw, 'dtype', None)).removeprefix('torch.')}"
    if autocast_on((raw,)):  # (the op's arguments hold no tensor for `FusedOp`'s own check to find)
        return REASON_AUTOCAST
    if raw.dim() != 5 or not raw.is_contiguous(memory_format=torch.channels_last_3d):
        return "x not channels-last [B, C, T, H, W]"
    if not (isinstance(bias, torch.Tensor) and bias.dtype is raw.dtype and bias.dim() == 1
            and bias.shape[0] == raw.shape[1] and bias.is_contiguous()):
        return "bias"
    vec = _VEC_BYTES // raw.element_size()
    if raw.shape[1] % vec:
        return "channels not a multiple of 16 bytes"
    if check_pointers and (raw.data_ptr() % _VEC_BYTES or bias.data_ptr() % _VEC_BYTES):
        return "pointers not 16-byte aligned"
    reason = _conv._guard(conv, raw, causal, check_pointers, channels_last=True)
    if reason is not None and not reason.startswith("device "):
        return reason
    device_reason = reason  # (the convolution's last check: given after this guard's own, as ltx_norm_conv does)
    if not _conv._channels_last(conv.conv, raw):
        return "the convolution's channels-first path"
    order = _norm_conv._mean_order(raw)
    if type(order) is not _norm.MeanOrder:
        return f"aten's mean: {order}"
    batch, channels = raw.shape[:2]
    if cl_shape(batch, raw.numel() // max(batch * channels, 1), channels, order, vec, 1) is None:
        # (the device's SMs only halve the tile: one SM asks everything else cl_shape asks)
        return "the mean's partial sums do not map onto the kernel's vectors"
    return device_reason or autograd_device_reason(raw, bias)


def _signature(norm, act, conv, x: PendingBias, causal, pending: bool = False):
    """What one first-call check vouches for: the dtype, the channels, the eps and the mean's order (the kernel's
    statistics), and the second convolution's signature (what cuDNN picks its engine by); a call asking for a
    `PendingBias` is the same signature (as `ltx_norm_conv`'s)."""
    raw = x.raw
    order = _norm_conv._mean_order(raw)
    return (("channels-last", str(raw.dtype).removeprefix("torch."), raw.shape[1], float(norm.eps), order.rows,
             order.ctas), _conv._signature(conv, raw, causal))


def _prove(norm, act, conv, x: PendingBias, causal, pending: bool = False) -> bool:
    """The norm's proofs: r and the SiLU on every value of the dtype (the kernel shares their device functions)."""
    return _norm._prove_rms_silu(norm, x.raw)


def _kernel(norm, act, conv, x: PendingBias, causal, pending: bool = False):
    padding, conv_padding, reflect = _conv._plan(conv, causal)
    raw = x.raw
    order = _norm_conv._mean_order(raw)
    padded = _launch(raw, x.bias, _norm.eps_as_added(norm.eps, raw.dtype, raw.device), True, order.rows, order.ctas,
                     order.factor, padding, reflect)
    # (a `PendingBias` only once this signature's tensor matched eager: the first call returns the tensor it checks)
    pending = pending and _signature(norm, act, conv, x, causal) in LTX_BIAS_NORM_CONV.verified
    return convolve_channels_last(conv.conv, padded, conv_padding, pending)


def cl_shape(batch: int, spatial: int, channels: int, order, vec: int, sms: int):
    """The channels-last kernel's launch, ``((tiles, batch, 1), (threads, 1, 1), tile)``, as the .cu's cl_shape
    computes it; ``None`` where the chains do not map onto the vectors or one position's scratch does not fit."""
    chains = 4 * order.rows * order.ctas
    if channels % vec or (chains % vec and chains != 4):
        return None
    per_position = 1 if chains < vec else chains // vec
    entries = chains + (order.rows if order.ctas > 1 else 0) + 1
    if per_position > _norm._FUSED_THREADS or entries > _norm._SHARED_FLOATS:
        return None
    tile = 1
    while 2 * tile * per_position <= _norm._FUSED_THREADS and 2 * tile * entries <= _norm._SHARED_FLOATS:
        tile *= 2
    while tile > 1 and batch * div_up(spatial, tile) < _norm._MIN_BLOCKS_PER_SM * sms:
        tile //= 2
    tiles = div_up(spatial, tile)
    if tiles > 2**31 - 1 or batch > 65535:
        return None
    return (tiles, batch, 1), (_norm._FUSED_THREADS, 1, 1), tile


# The NVRTC way (ops/_nvrtc.py): per_channel_rmsnorm_pad.cu's channels-last kernel, launched as its launch_cl_pad_cl
# and bindings_vae.cpp's per_channel_rmsnorm_cl_pad_cl do: the PerChannelRmsNormArgs and NormPadArgs fields
# (fastpath.h), the bias pointer, the order, the tile (`cl_shape`); the channels-last padded output.
_NVRTC_CL = _nvrtc.Kernel("per_channel_rmsnorm_pad.cu", "diffusers_fastpath::per_channel_rmsnorm_cl_pad_cl_kernel",
                          {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in FLOAT_DTYPES},
                          _nvrtc.Params("per_channel_rmsnorm_cl_pad_cl_kernel", ("a", _norm._ARGS),
                                        ("g", _norm_conv._PAD_ARGS), ("bias", "P"), ("rows", "i"), ("ctas", "i"),
                                        ("factor", "f"), ("tile", "i")))


def _raw_guard(x, bias, eps, silu, rows, ctas, factor, padding, reflect_hw):
    if x.dim() != 5 or x.dtype not in FLOAT_DTYPES or not x.is_contiguous(memory_format=torch.channels_last_3d):
        return "x"
    if (bias.dim() != 1 or bias.shape[0] != x.shape[1] or bias.dtype != x.dtype or not bias.is_contiguous()
            or bias.device != x.device):
        return "bias"
    if (x.shape[1] * x.element_size()) % _VEC_BYTES or x.data_ptr() % _VEC_BYTES or bias.data_ptr() % _VEC_BYTES:
        return "alignment"
    if not (1 <= rows <= 512 and rows & (rows - 1) == 0 and 1 <= ctas <= 65536):
        return "order"
    if len(padding) != 6 or min(padding) < 0 or not (
            max(padding[:2]) < x.shape[4] and max(padding[2:4]) < x.shape[3] if reflect_hw else not any(padding[:4])):
        return "padding"
    if not x.is_cuda:
        return "device"
    return None


def _nvrtc_cl_pad(x, bias, eps, silu, rows, ctas, factor, padding, reflect_hw):
    batch, channels, frames, height, width = x.shape
    pw0, pw1, ph0, ph1, pt0, pt1 = padding
    out = torch.empty(batch, channels, pt0 + frames + pt1, ph0 + height + ph1, pw0 + width + pw1, dtype=x.dtype,
                      device=x.device, memory_format=torch.channels_last_3d)
    if x.numel() == 0:
        return out
    device = x.device.index
    spatial = frames * height * width
    shape = cl_shape(batch, spatial, channels, _norm.MeanOrder(rows, ctas, factor), _VEC_BYTES // x.element_size(),
                     _nvrtc.num_sms(device))
    if shape is None:
        raise ValueError("per_channel_rmsnorm_cl_pad_cl: aten's partial sums do not fit the kernel")
    grid, block, tile = shape
    _NVRTC_CL.launch(device, x.dtype, grid, block, out.data_ptr(), x.data_ptr(), 0, batch, channels, spatial,
                     x.stride(0), 1, eps, int(silu), 0, _nvrtc.DTYPE_CODE[x.dtype], frames, height, width, pt0, pt1,
                     ph0, ph1, pw0, pw1, int(reflect_hw), bias.data_ptr(), rows, ctas, factor, tile)
    return out


_nvrtc.raw_op("_per_channel_rmsnorm_cl_pad_cl_cuda",
              "(Tensor x, Tensor bias, float eps, bool silu, int rows, int ctas, float factor, int[] padding, "
              "bool reflect_hw) -> Tensor", _raw_guard, _nvrtc_cl_pad)

# (x, bias, eps, silu, rows, ctas, factor, padding, reflect_hw)
_launch = LazyLauncher(_nvrtc_cl_pad, "_per_channel_rmsnorm_cl_pad_cl_cuda")


def bias_norm_pad_arithmetic(raw: torch.Tensor, bias: torch.Tensor, eps: float, silu: bool, padding,
                             reflect_hw: bool, biased=bias_contiguous_arithmetic) -> torch.Tensor:
    """What the channels-last kernel writes, in torch, for `raw` ``[B, C, T, H, W]`` and its `bias` (the tests'
    emulation, and the kernel's documentation in code): eager's tensor ``biased(raw, bias)`` (aten's add, rounded:
    `conv_bias.bias_contiguous_arithmetic`), its mean of squares as aten computes it on raw's device (the kernel: aten's
    CUDA order, `per_channel_rmsnorm.channel_mean_arithmetic`), then the pad kernel's values and buffer
    (`ltx_norm_conv.norm_pad_arithmetic`)."""
    h = biased(raw, bias)
    batch, channels = h.shape[:2]
    h3 = h.reshape(batch, channels, -1)
    return _norm_conv.norm_pad_arithmetic(h3, torch.mean(h3**2, dim=1), eps, silu, list(h.shape[2:]), padding,
                                          reflect_hw)


def _probe(norm, act, conv, x: PendingBias, causal, pending: bool = False):
    """The signature's check on more inputs (`FusedOp`'s probe: cuDNN's channels-last engine, where it is not eager's,
    may round alike on some values only): the first convolution's raw result wide-ranged, its layout and bias kept."""
    for seed in probe_seeds(x.raw):
        yield norm, act, conv, PendingBias(wide_like(x.raw, seed), x.bias), causal


LTX_BIAS_NORM_CONV = FusedOp("ltx_bias_norm_conv", ref=ltx_bias_norm_conv_ref, guard=_guard, kernel=_kernel,
                             custom_op=ltx_bias_norm_conv_ref, verify_key=_signature, prove=_prove, fallback=_fallback,
                             probe=_probe,
                             modules=(0, 1, 2))  # the norm, the SiLU and the second convolution: their calls


def ltx_bias_norm_conv(norm: nn.Module, act: nn.Module, conv: nn.Module, x: PendingBias, causal: bool = True,
                       site: Site | None = None, pending: bool = False):
    """``conv(act(norm(x.settle())), causal=causal)`` for a convolution's pending result `x` (`ltx_norm_conv` with
    ``pending``), LTX-2's VAE norm, its ``nn.SiLU`` and the causal convolution that reads them: the bias added and the
    norm computed where the kernel reads `x`'s channels-last values, written into the convolution's padded
    channels-last input (see the module doc), bit-identical to eager (checked on the first call of each signature).
    With `pending`, where this signature was checked already, the second convolution's result is left pending in
    turn (a `causal_conv_cl.PendingBias`, as `ltx_norm_conv` leaves it: for `conv_bias_residual`, the resnet's
    residual add; elsewhere the tensor).

    Args:
        norm: the ``PerChannelRMSNorm`` (registered by the VAE adapter).
        act: the ``nn.SiLU`` after it.
        conv: the ``LTX2VideoCausalConv3d`` that reads the SiLU's result.
        x: the first convolution's `causal_conv_cl.PendingBias`.
        causal: the convolution's ``causal`` argument.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        pending: ask for a `PendingBias` (above).
    """
    return LTX_BIAS_NORM_CONV(site, norm, act, conv, x, causal, pending)
