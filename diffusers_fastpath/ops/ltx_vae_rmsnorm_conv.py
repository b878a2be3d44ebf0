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
wrote the padded buffer channels-last); here::

    r      = reciprocal(x)                          # as ltx_vae_rmsnorm_silu: the kernel's squares, aten's mean, rsqrt
    padded = ltx_rmsnorm_pad_cl(x, r)               # csrc/causal_pad.cu's ltx_rmsnorm_pad_cl_kernel: causal_pad's
                                                    # channels-last copy, each value of x replaced as it is read by
                                                    # the pair kernel's epilogue (elementwise.cuh's ltx_rmsnorm_value:
                                                    # one IEEE product rounded, the SiLU of it rounded)
    out    = convolve_channels_last(conv, padded)   # cuDNN's convolution and the bias + transpose back, as
                                                    # `ltx_causal_conv3d` runs it

Each element of the buffer is the value ``ltx_vae_rmsnorm_silu`` computes for its source position (the same device
function on the same operands, so the same bits), placed where ``causal_pad`` would copy it; the convolution is the one
`ltx_causal_conv3d` runs on the same buffer. So the result is eager's wherever those two ops' are, and the op verifies
itself as they do: the first call of each signature (the norm's `ltx_vae_rmsnorm._signature` and the convolution's
`ltx_causal_conv._signature`) is compared with the eager chain, and the kernel's own tail is proven on every value of
the dtype with the reciprocal 1 (`_prove`: its multiply, rounding and SiLU against eager's ``F.silu((v.float() *
1).to(T))``, all 65536 values); a mismatch disables the op for the process (one warning).

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

import torch
import torch.nn.functional as F
from torch import nn

from . import _nvrtc
from . import causal_conv_pad as _pad
from . import ltx_causal_conv as _conv
from ._build import LazyLauncher
from ._policy import HALF_DTYPES, FusedOp, Site
from ._unary_proof import mismatches
from .causal_conv_cl import convolve_channels_last
from .gelu_cat import every_value

# the norm's module (the package binds the name `ltx_vae_rmsnorm` to its op function); read through it, so that what
# tests replace there is what runs here
_norm = importlib.import_module(f"{__package__}.ltx_vae_rmsnorm")


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
    where the squares come from) and the convolution's (what cuDNN picks its engine by)."""
    return _norm._signature(norm, x.movedim(1, -1)), _conv._signature(conv, x, causal)


def tail_probe(row: torch.Tensor) -> torch.Tensor:
    """The kernel on a ``[1, 1, n]`` row as x ``[1, 1, 1, 1, n]`` with the reciprocal 1.0 everywhere and nothing
    padded: ``round(silu(round(v * 1.0)))`` of each value, for `_unary_proof.mismatches`."""
    ones = torch.ones(1, row.shape[-1], dtype=torch.float32, device=row.device)
    return _launch(row.reshape(1, 1, 1, 1, -1), ones, [0] * 6, False).reshape(row.shape)


def tail_ref(values: torch.Tensor) -> torch.Tensor:
    """Eager's chain of the norm's tail and the SiLU with the reciprocal 1.0: the mixed-dtype multiply (a float32
    tensor of ones), ``.to(T)``, ``F.silu``."""
    return F.silu((values.to(torch.float32) * torch.ones_like(values, dtype=torch.float32)).to(values.dtype))


def _prove(norm, act, conv, x: torch.Tensor, causal=None) -> bool:
    """The kernel's tail (multiply, rounding, SiLU) equals eager's on every value of x's dtype, on x's device."""
    return int(mismatches(every_value(x.dtype, x.device).flatten(), tail_probe, tail_ref)) == 0


def _kernel(norm, act, conv, x: torch.Tensor, causal=None) -> torch.Tensor:
    padding, conv_padding, reflect = _conv._plan(conv, causal)
    # (aten's [B, T, H, W, 1], one per position, contiguous as the pair kernel takes it: `ltx_vae_rmsnorm._fused`)
    r = _norm.reciprocal(x.movedim(1, -1), norm.eps, _norm._square).contiguous()
    padded = _launch(x, r.view(x.shape[0], -1), padding, reflect)
    return convolve_channels_last(conv.conv, padded, conv_padding)


# The NVRTC way (ops/_nvrtc.py): csrc/causal_pad.cu's norm kernel, launched as its launch_norm and bindings_vae.cpp's
# ltx_rmsnorm_pad_cl do: causal_pad's arguments and output (`causal_conv_pad.launch_fields`: channels-last, the frames
# repeated, no cache), the grid of its channels-last kernel, then the reciprocal.
_NVRTC = _nvrtc.Kernel("causal_pad.cu", "diffusers_fastpath::ltx_rmsnorm_pad_cl_kernel",
                       {dtype: _nvrtc.STORAGE_TYPE[dtype] for dtype in HALF_DTYPES},
                       _nvrtc.Params("ltx_rmsnorm_pad_cl_kernel", ("a", _pad._ARGS), ("rsqrt", "P")))


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
    out, fields, grid = _pad.launch_fields(x, None, padding, True, True, reflect_hw)
    if out.numel():
        _NVRTC.launch(x.device.index, x.dtype, grid, (_pad._TILE, _pad._TILE_ROWS, 1), *fields, rsqrt.data_ptr())
    return out


_nvrtc.raw_op("_ltx_rmsnorm_pad_cl_cuda", "(Tensor x, Tensor rsqrt, int[] padding, bool reflect_hw) -> Tensor",
              _raw_guard, _nvrtc_kernel)

_launch = LazyLauncher(_nvrtc_kernel, "_ltx_rmsnorm_pad_cl_cuda")  # (x, rsqrt, padding, reflect_hw)


def norm_pad_arithmetic(x: torch.Tensor, rsqrt: torch.Tensor, padding, reflect_hw: bool) -> torch.Tensor:
    """What the kernel writes, in torch, for x ``[B, C, T, H, W]`` and its ``[B, T * H * W]`` reciprocal (the tests'
    emulation, and the kernel's documentation in code): the pair's arithmetic (`ltx_rmsnorm_arithmetic` with the SiLU),
    then ``causal_pad``'s buffer of it (`causal_conv_pad.pad_arithmetic`: the repeated frames, the reflected border),
    channels-last."""
    view = x.movedim(1, -1)
    y = _norm.ltx_rmsnorm_arithmetic(view, rsqrt.reshape(*view.shape[:-1], 1), silu=True).movedim(-1, 1)
    return _pad.pad_arithmetic(y, None, list(padding), True, True, reflect_hw)


LTX_VAE_RMSNORM_CONV = FusedOp("ltx_vae_rmsnorm_conv", ref=ltx_vae_rmsnorm_conv_ref, guard=_guard, kernel=_kernel,
                               custom_op=ltx_vae_rmsnorm_conv_ref, verify_key=_signature, prove=_prove,
                               fallback=_fallback,
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
