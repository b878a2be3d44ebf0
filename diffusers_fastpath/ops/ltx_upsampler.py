"""LTX-Video's and LTX-2's residual upsamplers (diffusers' ``LTXVideoUpsampler3d``, ``LTX2VideoUpsampler3d`` with
``stride (2, 2, 2)``, ``residual`` and ``upscale_factor 2``: the LTX-2 decoder's three, LTX-Video 0.9.5's), written in
one pass from their causal convolution's channels-last output; bit-identical to eager, checked per signature.

The module's forward (checked by source digest by `diffusers_fastpath.models.vae_ltx_upsampler`) runs, for x
``[B, C, T, H, W]`` (contiguous) and its convolution's ``4 C`` output channels::

    residual = x.reshape(B, C / 8, 2, 2, 2, T, H, W).permute(0, 1, 5, 2, 6, 3, 7, 4).flatten(...)  # a copy
    residual = residual.repeat(1, 4, 1, 1, 1)[:, :, 1:]                                            # a copy
    h = self.conv(x, causal=causal)     # the padded input, cuDNN's convolution, aten's bias add (rounded to T)
    h = h.reshape(B, C / 2, 2, 2, 2, T, H, W).permute(...).flatten(...)[:, :, 1:]                  # a copy
    return h + residual                 # aten's add: one fp32 add rounded to T, a contiguous result

so output channel c' at frame ``2 t + dt - 1``, row ``2 h + dh``, column ``2 w + dw`` is h's channel ``8 c' + j``
(``j = 4 dt + 2 dh + dw``) at ``(t, h, w)`` plus x's channel ``(c' mod C / 8) * 8 + j`` there. The patched
convolution (`ltx_causal_conv3d`) already ran cuDNN on a channels-last buffer and added the bias in the pass that
transposes its result back; the copies and the add were four more passes (the decode at 768x512x121: about 10 ms on an
H100). Here::

    padded = causal_pad(x, ...)                       # the convolution's buffer, channels-last (`ltx_causal_conv3d`'s)
    raw    = F.conv3d(padded, w, None, ...)           # cuDNN's channels-last output, the bias not added
    out    = bias_depth_to_space(raw, b, x)           # csrc/conv_bias.cu: per output element
                                                      # round(round(raw + b) + x), read and written where the moves
                                                      # put them, contiguous

The first rounding is the bias add's (h's value), the second the add's (IEEE addition commutes: ``h + residual`` is
the same word); the moves copy values. So the result is eager's wherever the convolution is `ltx_causal_conv3d`'s
(cuDNN's channels-last engine against the engine eager's channels-first call runs): the op verifies itself as that op
does, the first call of each convolution signature compared with the module's eager forward (diffusers' class's, its
``self.conv`` called as written); a mismatch disables the op for the process (one warning). Where the convolution does
not leave cuDNN's channels-last output (not a cuDNN convolution for this shape: never seen), the convolution's tensor
takes eager's moves and add instead (aten's, the same values).

What the guard admits (anything else runs the module's forward as diffusers wrote it, counted with the reason): a
module of a class registered here (`add_upsampler_class`: diffusers' two after the adapter's digest check, this
package's subclasses), ``stride (2, 2, 2)``, ``residual`` True, ``upscale_factor`` 2; its ``conv`` what
`ltx_causal_conv3d`'s guard admits for x, on its channels-last path (bf16 / fp16, a bias, a contiguous weight), without
hooks of its own (its call is what this stands for); x contiguous, its channels a multiple of 8 and a quarter of the
convolution's, which keeps x's frames, rows and columns (eager's reshape of its result reads them).
"""

from __future__ import annotations

import torch
from torch import nn

from . import causal_conv_pad as _pad
from . import ltx_causal_conv as _conv
from ._policy import EagerClasses, FusedOp, Site, hooks_on
from .causal_conv_cl import PendingBias, convolve_channels_last
from .conv_bias import bias_depth_to_space, depth_to_space_residual_arithmetic

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one


def add_upsampler_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' class (`base` None) once its ``forward`` was checked to be the
    one documented above, or this package's subclass of `base` that adds no state and whose forward runs this op."""
    _BASES.add(cls, base)


def ltx_upsampler3d_ref(module: nn.Module, x: torch.Tensor, causal: bool | None = None) -> torch.Tensor:
    """The eager forward: the diffusers class's; ``causal`` None for LTX-Video's, which takes no such argument."""
    forward = _BASES.eager(module).forward
    return forward(module, x) if causal is None else forward(module, x, causal)


def _keeps_dims(conv: nn.Module, x: torch.Tensor, causal: bool | None) -> bool:
    """Whether the causal convolution's output has x's frames, rows and columns."""
    padding, conv_padding, _ = _conv._plan(conv, causal)
    inner = conv.conv
    return all((padded + 2 * p - d * (k - 1) - 1) // s + 1 == size for size, padded, p, k, s, d in zip(
        x.shape[2:], _pad.padded_shape(x, padding)[2:], conv_padding, inner.weight.shape[2:], inner.stride,
        inner.dilation))


def _guard(module, x: torch.Tensor, causal: bool | None = None, check_pointers: bool = True) -> str | None:
    """``None`` when the one-pass upsampler takes these inputs, else the reason it does not (counted at the site)."""
    reason = _BASES.refusal(module, "LTX upsampler")
    if reason is not None:
        return reason
    stride = getattr(module, "stride", None)
    if not (isinstance(stride, tuple) and len(stride) == 3 and all(type(s) is int and s == 2 for s in stride)):
        return "stride not (2, 2, 2)"
    if getattr(module, "residual", None) is not True:
        return "not residual"
    if type(getattr(module, "upscale_factor", None)) is not int or module.upscale_factor != 2:
        return "upscale factor not 2"
    conv = getattr(module, "conv", None)
    reason = _conv._guard(conv, x, causal, check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    # (a device reason, the convolution guard's last, is given after this guard's own: the CPU tests' emulation,
    # which takes a "device cpu" for a pass, then runs them too)
    device_reason = reason
    if hooks_on(conv):  # (its class's forward replaced: refused by the convolution's guard above)
        return "the convolution has hooks"
    if not _conv._channels_last(conv.conv, x):
        return "the convolution's channels-first path (fp32, no bias, a channels-last weight)"
    if not x.is_contiguous():
        return "x not contiguous"
    if x.shape[1] % 8 or conv.conv.weight.shape[0] != 4 * x.shape[1]:
        return "channels"  # (eager's reshape raises, or its add broadcasts)
    if not _keeps_dims(conv, x, causal):
        return "the convolution changes the frames, rows or columns"
    return device_reason


def _signature(module, x: torch.Tensor, causal: bool | None = None):
    """What one first-call check vouches for: the convolution's (`ltx_causal_conv._signature`: what cuDNN picks its
    engine by); the moves and the two roundings are exact by construction."""
    return ("upsampler", *_conv._signature(module.conv, x, causal))


def _kernel(module: nn.Module, x: torch.Tensor, causal: bool | None = None) -> torch.Tensor:
    conv = module.conv
    padding, conv_padding, reflect = _conv._plan(conv, causal)
    h = convolve_channels_last(conv.conv, _pad._launch(x, None, padding, True, True, reflect), conv_padding,
                               pending=True)
    if type(h) is PendingBias and h.raw.data_ptr() % 16 == 0:
        return bias_depth_to_space(h.raw, h.bias, x)
    # (not cuDNN's channels-last output: the convolution's tensor, eager's value, then eager's moves and add)
    return depth_to_space_residual_arithmetic(h.settle() if type(h) is PendingBias else h, None, x,
                                              biased=lambda t, _: t)


LTX_UPSAMPLER3D = FusedOp("ltx_upsampler3d", ref=ltx_upsampler3d_ref, guard=_guard, kernel=_kernel,
                          custom_op=ltx_upsampler3d_ref, verify_key=_signature)


def ltx_upsampler3d(module: nn.Module, x: torch.Tensor, causal: bool | None = None,
                    site: Site | None = None) -> torch.Tensor:
    """``module(x, causal=causal)`` (LTX-2) or ``module(x)`` (LTX-Video, `causal` None) for their residual
    upsamplers: the convolution's channels-last output, its bias, the depth-to-space moves and the residual add in one
    pass (see the module doc), bit-identical to eager (checked on the first call of each convolution signature).

    Args:
        module: the upsampler (``LTXVideoUpsampler3d`` or ``LTX2VideoUpsampler3d``, registered by the VAE adapter).
        x: ``[B, C, T, H, W]`` activations.
        causal: LTX-2's ``causal`` argument; ``None`` for LTX-Video's module, whose convolution reads
            ``self.is_causal``.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LTX_UPSAMPLER3D(site, module, x, causal)
