"""LTX-Video's and LTX-2's causal 3D convolutions (diffusers' ``LTXVideoCausalConv3d``, ``LTX2VideoCausalConv3d``):
their padded input built in one buffer, channels-last, and cuDNN's layout transposes folded into the passes around the
convolution; bit-identical to eager, checked per convolution signature.

The module's forward (checked by source digest by `diffusers_fastpath.models.vae_ltx_conv`) runs, for x
``[B, C, T, H, W]`` and the time kernel size ``k = self.kernel_size[0]``::

    if causal:                      # LTX-2's argument; LTX-Video's ``self.is_causal``
        x = torch.concatenate([x[:, :, :1].repeat((1, 1, k - 1, 1, 1)), x], dim=2)
    else:
        x = torch.concatenate([x[:, :, :1].repeat((1, 1, (k - 1) // 2, 1, 1)), x,
                               x[:, :, -1:].repeat((1, 1, (k - 1) // 2, 1, 1))], dim=2)
    return self.conv(x)             # an nn.Conv3d: padding (0, kh // 2, kw // 2), padding_mode "zeros" or "reflect"

and ``nn.Conv3d`` runs ``F.conv3d(x, w, b, stride, padding, dilation, groups)`` ("zeros"), or ``F.conv3d(F.pad(x,
(pw, pw, ph, ph, 0, 0), mode="reflect"), w, b, stride, 0, dilation, groups)`` ("reflect": LTX-2's decoder, its
default). Eager writes the repeated frames, copies them and x into the concatenation, for "reflect" copies that again
inside a reflected border; cuDNN then transposes its input to channels-last (``nchwToNhwc``), runs its engine and
transposes the result back (``nhwcToNchw``), and aten adds the bias. Here::

    padded = causal_pad(x, replicate_t, reflect_hw)   # csrc/causal_pad.cu: the tensor eager's F.conv3d reads (the
                                                      # frames repeated; for "reflect" the border reflected too),
                                                      # written channels-last in one pass
    out    = F.conv3d(padded, w, None, stride, p, dilation, groups)  # p the module's padding ("zeros") or 0
                                                      # ("reflect"): the convolution eager asks of cuDNN
    out    = bias_contiguous(out, bias)               # the bias add and the transpose back in one pass

Each element of the buffer is one element of x copied as its bits (a repeated frame: the first or the last frame, the
kernel's frame index clamped; the reflected border: F.pad's reflected row and column), and only its layout differs
from eager's tensor (contiguous: the concatenation of a contiguous repetition with x is contiguous whatever x's
layout, and the reflection keeps it). The stride, dilation and groups do not enter the buffer (the forward pads ``k -
1`` frames whatever the dilation) and reach the convolution as eager passes them; the bias add is aten's (one fp32 add,
rounded). So the result is eager's wherever cuDNN's channels-last engine computes what it computes after its own
transposes, which `tools/conv_layout_probe.py` found for every convolution of the Wan 2.1, FLUX.1 and LTX-Video decodes
on an H100 (`diffusers_fastpath.ops.causal_conv_cl`) but no document promises: the op verifies itself, the first call
of each convolution signature (`_signature`: what cuDNN picks its engine by) compared with the module's eager forward
(`FusedOp`); a mismatch disables it for the process (one warning) and eager runs.

Where the channels-last path does not apply (fp32: cuDNN's channels-last TF32 engine gave other bits than the
channels-first one on an H100; no bias, or one of another dtype; a channels-last weight, for which eager's result is
channels-last) the channels-first one buffer runs: the frames repeated around x in one contiguous buffer (eager's
concatenation: values and layout), then the module's own ``self.conv`` called on it (`conv_bias` where the adapter made
it `FastpathConv3d`; for "reflect" torch's padding and convolution). Exact by construction; its first call per dtype is
compared with eager all the same.

What the guard admits (anything else runs the module's forward as diffusers wrote it, counted with the reason): a
module of a class registered here (`add_conv_class`: diffusers' two after the adapter's digest check, this package's
subclasses), ``causal`` a bool or ``None`` (LTX-Video's forward: ``self.is_causal``), the time kernel size a positive
int; ``self.conv`` torch's ``nn.Conv3d`` or this package's `FastpathConv3d` with torch's forward and no hooks (the
channels-last path does not call it), integer padding, "zeros" or "reflect" (then none in time, each spatial one below
its axis' size, as F.pad requires); x of 5 dims, of the weight's dtype, fp16 / bf16 / fp32, its W of unit stride (the
kernel's reads), a shape the convolution takes (a shape eager refuses raises eager's own error, not one inside the
kernel); on CUDA with the parameters; no autograd; not ``cudnn.benchmark`` (the engine is then timed per call, not
chosen by shape: one check vouches for nothing), not under ``torch.compile`` (the custom op is the module's forward).
"""

from __future__ import annotations

import torch
from torch import nn

from . import causal_conv_pad as _pad
from ._policy import (FLOAT_DTYPES, HALF_DTYPES, REASON_FORWARD_REPLACED, EagerClasses, FusedOp, Site,
                      autograd_device_reason, forward_replaced, hooks_on, probe_seeds, wide_like)
from .causal_conv_cl import convolve_channels_last, engine_key

_BASES = EagerClasses()  # the classes the op takes, each with the diffusers class whose forward is the eager one
_CONVS: tuple[type, ...] = (nn.Conv3d,)  # the inner convolutions' classes (`add_inner_conv_class`: FastpathConv3d)


def add_conv_class(cls: type, base: type | None = None) -> None:
    """Let the guard take modules of `cls`: diffusers' class (`base` None) once its ``forward`` was checked to be the
    one documented above, or this package's subclass of `base` that adds no state and whose forward runs this op."""
    _BASES.add(cls, base)


def add_inner_conv_class(cls: type) -> None:
    """Let ``self.conv`` be of `cls` too: a subclass of ``nn.Conv3d`` that adds no state and computes what torch's
    forward computes (this package's `FastpathConv3d`, whose forward is `conv_bias`)."""
    global _CONVS
    if cls not in _CONVS:
        _CONVS = (*_CONVS, cls)


def ltx_causal_conv3d_ref(module: nn.Module, x: torch.Tensor, causal: bool | None = None) -> torch.Tensor:
    """The eager forward: the diffusers class's (so that this package's subclass falls back to diffusers' code);
    ``causal`` None for LTX-Video's, which takes no such argument."""
    forward = _BASES.eager(module).forward
    return forward(module, x) if causal is None else forward(module, x, causal)


def _time_padding(module: nn.Module, causal: bool | None) -> tuple[int, int]:
    """The frames the forward repeats before x (the first) and after it (the last)."""
    repeats = module.kernel_size[0] - 1
    if module.is_causal if causal is None else causal:
        return repeats, 0
    return repeats // 2, repeats // 2


def _plan(module: nn.Module, causal: bool | None) -> tuple[list[int], tuple[int, ...], bool]:
    """The buffer's padding (``F.pad``'s order: w0, w1, h0, h1, t0, t1), the padding the convolution is called with,
    and whether the spatial border is reflected: "zeros" leaves the spatial padding to the convolution (cuDNN's, as
    eager), "reflect" writes it into the buffer and convolves without padding (as ``nn.Conv3d._conv_forward``)."""
    conv = module.conv
    t0, t1 = _time_padding(module, causal)
    if conv.padding_mode == "reflect":
        return [*conv._reversed_padding_repeated_twice[:4], t0, t1], (0, 0, 0), True
    return [0, 0, 0, 0, t0, t1], tuple(conv.padding), False


def _ints(values, length: int, least: int) -> bool:
    return isinstance(values, tuple) and len(values) == length and all(
        type(v) is int and v >= least for v in values)


def _guard(module, x: torch.Tensor, causal: bool | None = None, check_pointers: bool = True,
           channels_last: bool = False) -> str | None:
    """``None`` when the one-buffer forward takes these inputs, else the reason it does not (counted at the site).
    `channels_last`: x is laid out channels-last (a caller's kernel reads it, not causal_pad: its W stride is not
    asked for)."""
    reason = _BASES.refusal(module, "LTX causal convolution")
    if reason is not None:
        return reason
    if not (causal is None or isinstance(causal, bool)) or (causal is None and not isinstance(
            getattr(module, "is_causal", None), bool)):
        return "causal not a bool"
    conv = getattr(module, "conv", None)
    if type(conv) not in _CONVS:
        return f"the convolution is a {type(conv).__name__}, not torch's nn.Conv3d"
    if hooks_on(conv):  # (its own, a forward replaced on it, global ones: the channels-last path does not call it)
        return "the convolution has hooks"
    if forward_replaced(conv):
        return REASON_FORWARD_REPLACED.format(type(conv).__name__)
    kernel_size = getattr(module, "kernel_size", None)
    if not (isinstance(kernel_size, tuple) and len(kernel_size) == 3 and type(kernel_size[0]) is int
            and kernel_size[0] >= 1):
        return "time kernel size"
    if conv.padding_mode not in ("zeros", "reflect") or not _ints(conv.padding, 3, 0):
        return "padding"
    if conv.padding_mode == "reflect" and conv.padding[0]:
        return "padding reflected in time"
    if not (_ints(conv.stride, 3, 1) and _ints(conv.dilation, 3, 1) and type(conv.groups) is int and conv.groups >= 1):
        return "stride, dilation or groups not positive ints"
    if not isinstance(x, torch.Tensor) or x.dim() != 5:
        return "x not [B, C, T, H, W]"
    weight, bias = conv.weight, conv.bias
    if x.dtype not in FLOAT_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if weight.dtype is not x.dtype or (bias is not None and bias.dtype is not x.dtype):
        return "mixed dtypes"
    if x.shape[4] > 1 and x.stride(4) != 1 and not channels_last:
        return "x of a channels-last layout"
    # a convolution eager refuses (another channel count, a padded input smaller than the kernel's extent, a reflected
    # padding not below its axis' size): eager raises its error. Refused here, it does not come from inside the kernel,
    # which `FusedOp` would take for a kernel failure and disable this op for the process.
    padding, _, reflect = _plan(module, causal)
    padded = (x.shape[2] + padding[4] + padding[5], x.shape[3] + 2 * conv.padding[1],
              x.shape[4] + 2 * conv.padding[2])  # (in the buffer or inside cuDNN: the extent the kernel slides over)
    if (x.numel() == 0 or weight.dim() != 5 or x.shape[1] != weight.shape[1] * conv.groups
            or any(size < d * (k - 1) + 1 for size, k, d in zip(padded, weight.shape[2:], conv.dilation))
            or reflect and not (max(padding[:2]) < x.shape[4] and max(padding[2:4]) < x.shape[3])):
        return "shape"
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark on"
    if torch.compiler.is_compiling():
        return "compiling"
    # (the device last: the CPU tests' emulation takes "device cpu" for a pass, and every check above runs there too)
    return autograd_device_reason(x, *conv.parameters(recurse=False))


def _channels_last(conv: nn.Module, x: torch.Tensor) -> bool:
    """Whether the channels-last path runs these inputs (the guard passed: the weight and bias of x's dtype): a
    half-precision x, a bias, a contiguous weight (eager's result is then contiguous, as bias_contiguous's)."""
    return x.dtype in HALF_DTYPES and conv.bias is not None and conv.weight.is_contiguous()


def _signature(module, x: torch.Tensor, causal: bool | None = None):
    """What one first-call check vouches for. Channels-last: what cuDNN picks its engine by
    (`causal_conv_cl.engine_key`: the buffer's shape and the convolution as called). Channels-first: the dtype (exact
    by construction)."""
    conv = module.conv
    if not _channels_last(conv, x):
        return ("channels-first", str(x.dtype).removeprefix("torch."))
    padding, conv_padding, _ = _plan(module, causal)
    return ("channels-last", *engine_key(x, _pad.padded_shape(x, padding), conv, conv_padding))


def _kernel(module: nn.Module, x: torch.Tensor, causal: bool | None = None) -> torch.Tensor:
    conv = module.conv
    padding, conv_padding, reflect = _plan(module, causal)
    if not _channels_last(conv, x):
        # the channels-first one buffer: eager's concatenation, then the convolution module's own call
        return conv(_pad._launch(x, None, [0, 0, 0, 0, *padding[4:]], False, True, False))
    return convolve_channels_last(conv, _pad._launch(x, None, padding, True, True, reflect), conv_padding)


def _probe(module, x: torch.Tensor, causal: bool | None = None):
    """The signature's check on more inputs (`FusedOp`'s probe: cuDNN's channels-last engine, where it is not eager's,
    may round alike on some values only); none on the channels-first path (exact by construction)."""
    if not _channels_last(module.conv, x):
        return
    for seed in probe_seeds(x):
        yield module, wide_like(x, seed), causal


LTX_CAUSAL_CONV3D = FusedOp("ltx_causal_conv3d", ref=ltx_causal_conv3d_ref, guard=_guard, kernel=_kernel,
                            custom_op=ltx_causal_conv3d_ref, verify_key=_signature, probe=_probe)


def ltx_causal_conv3d(module: nn.Module, x: torch.Tensor, causal: bool | None = None,
                      site: Site | None = None) -> torch.Tensor:
    """``module(x, causal)`` (LTX-2) or ``module(x)`` (LTX-Video, `causal` None) for their causal convolutions: the
    padded input in one buffer, channels-last where it applies (see the module doc), bit-identical to eager (checked
    on the first call of each convolution signature).

    Args:
        module: the module (``LTXVideoCausalConv3d`` or ``LTX2VideoCausalConv3d``, registered by the VAE adapter).
        x: ``[B, C, T, H, W]`` activations.
        causal: LTX-2's ``causal`` argument; ``None`` for LTX-Video's module, which reads ``self.is_causal``.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return LTX_CAUSAL_CONV3D(site, module, x, causal)
