"""Wan's and Qwen-Image's causal 3D convolutions run channels-last, cuDNN's layout transposes folded into the passes
around the convolution that exist anyway; bit-identical to eager, checked per convolution shape.

cuDNN runs its engines on channels-last tensors. Given eager's channels-first input, it transposes the input (and
the weight) to channels-last, runs the engine, and transposes the result back (``nchwToNhwcKernel``,
``nhwcToNchwKernel``: 214 ms of the Wan 2.1 decode at 832x480x81 on an H100, of 1.58 s; 19 ms of the Qwen-Image
decode at 1328x1328, of 115), and aten then adds the bias. Here, for a causal convolution that pads (the one-buffer
input of `diffusers_fastpath.ops.causal_conv_pad`)::

    padded = causal_pad(x, cache_x)            # the one buffer, written channels-last: the transpose in the copy
    out    = conv._conv_forward(padded, w)     # cuDNN on a channels-last input: no input transpose (aten makes the
                                               # weight channels-last, as cuDNN did), a channels-last result
    out    = bias_contiguous(out, bias)        # the bias add and the transpose back in one pass, contiguous

The values of the padded input only move; the bias add is aten's (one fp32 add, rounded); so the result is eager's
exactly where cuDNN's channels-last engine computes what it computes after its own transposes: the same engine on the
same operands, which `tools/conv_layout_probe.py` found for every convolution of the Wan 2.1, FLUX.1 and LTX-Video
decodes on an H100 (cuDNN 9.19, ``cudnn.benchmark`` off, eager's default), but which no document promises. So the op
verifies itself: the first call of each convolution signature (dtype, padded input shape, weight shape, stride,
dilation, groups: what cuDNN picks its engine by) is compared with the module's eager forward (`FusedOp`), a
mismatch disables it for the process (one warning), and the channels-first path runs.

What the guard admits: what `causal_conv_pad`'s guard admits, where the convolution pads (a buffer is built) and has
a bias of x's dtype, a contiguous weight (eager's result is channels-last for a channels-last one), ``padding_mode`` "zeros", a 3-D convolution torch runs with cuDNN (asked of torch on the padded
input, with and without the bias); not under ``torch.compile`` (its custom op is the module's own forward) nor
with ``torch.backends.cudnn.benchmark`` on (the engine is then timed per call, not chosen by shape), nor in fp32:
an fp32 VAE's convolutions (TF32, as eager's) gave other bits channels-last than channels-first on an H100 (the Wan
encoder's first convolution, 3 input channels; the self-check caught it and turned the op off), so they keep the
channels-first path, its buffer and bias add fused. Anything
else runs the channels-first path (the one buffer and `conv_bias`), counted on this op's site with the reason.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .._logging import warn_once
from . import causal_conv_pad as _pad
from ._build import KernelsUnavailable
from ._policy import (HALF_DTYPES, FusedOp, Site, forward_replaced, fp32_precision_state, hooks_on, probe_seeds,
                      wide_like)
from .conv_bias import _backend, bias_contiguous

NAMED_SITE = "_fastpath_site_causal_conv3d_cl"  # (`_state.site_attr`: the convolution's named site of this op)


def _guard(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None, pending: bool = False,
           check_pointers: bool = True) -> str | None:
    """``None`` when the channels-last path takes these inputs, else the reason it does not (`pending`: see
    `pending_result`; the same inputs either way)."""
    reason = _pad._guard(conv, x, cache_x, check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    # (a device reason, the one-buffer guard's last, is given after this guard's own: the CPU tests' emulation,
    # which takes a "device cpu" for a pass, then runs them too)
    device_reason = reason
    if not _pad._pads(conv, cache_x):
        return "nothing padded"
    if NAMED_SITE not in conv.__dict__:
        return "not patched"
    weight, bias = getattr(conv, "weight", None), getattr(conv, "bias", None)
    if not isinstance(bias, torch.Tensor) or not isinstance(weight, torch.Tensor) or weight.dim() != 5:
        return "no bias"
    if bias.dtype is not x.dtype or weight.dtype is not x.dtype:
        return "mixed dtypes"
    if x.dtype not in HALF_DTYPES:  # (fp32: cuDNN's channels-last TF32 engine gave other bits on an H100)
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if not weight.is_contiguous():
        # (a channels-last weight, e.g. the VAE moved to channels_last_3d: eager's convolution of the contiguous
        # buffer then returns a channels-last result, which bias_contiguous's contiguous one is not)
        return "weight not contiguous"
    if getattr(conv, "padding_mode", None) != "zeros":
        return "padding mode"
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark on"
    if torch.compiler.is_compiling():
        return "compiling"
    return device_reason


def engine_key(x: torch.Tensor, padded_shape: tuple, conv: nn.Module, padding) -> tuple:
    """What cuDNN picks its engine by, for `conv`'s convolution with `padding` of a buffer of `padded_shape` built
    from x: the dtype, the shapes, the geometry, the device (its heuristics are per GPU), deterministic mode (which
    leaves cuDNN the deterministic engines only) and TF32 (an fp32 VAE's convolutions)."""
    return (str(x.dtype).removeprefix("torch."), padded_shape, tuple(conv.weight.shape), tuple(conv.stride),
            tuple(padding), tuple(conv.dilation), conv.groups, x.device.type, x.device.index,
            torch.are_deterministic_algorithms_enabled() or torch.backends.cudnn.deterministic,
            fp32_precision_state())


def _signature(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None, pending: bool = False):
    """What one first-call check vouches for: `engine_key` of the padded buffer, and whether the buffer was made
    before the call (x its `interior_of` view: the cache's frames written into it here)."""
    return (*engine_key(x, _pad.padded_shape(x, conv._padding), conv, conv.padding),
            _pad.interior_of(x, conv) is not None)


def _convolution(conv: nn.Module, padded: torch.Tensor, padding) -> torch.Tensor:
    """The convolution without its bias, as ``nn.Conv3d`` calls it with `padding` (cuDNN, given a channels-last input,
    returns a channels-last result)."""
    return F.conv3d(padded, conv.weight, None, conv.stride, padding, conv.dilation, conv.groups)


class PendingBias:
    """A convolution's result whose bias is still to be added: cuDNN's channels-last output `raw` of
    `convolve_channels_last` (``[B, C, T, H, W]`` laid out channels_last_3d) and the `bias` eager adds to it. Not a
    tensor: only the code that asked for it (`diffusers_fastpath.models.vae_ltx2_chain`, which proves from the block's
    forward that the value goes to a reader taking it, `diffusers_fastpath.ops.ltx_bias_norm_conv` or
    `diffusers_fastpath.ops.conv_bias_residual`, or through `settle` first) ever holds it; anything else that read it
    would fail loudly, never read other values."""

    __slots__ = ("raw", "bias")

    def __init__(self, raw: torch.Tensor, bias: torch.Tensor) -> None:
        self.raw, self.bias = raw, bias

    def settle(self) -> torch.Tensor:
        """The tensor eager's convolution returns: `bias_contiguous` (aten's bias add, the transpose back); where its
        kernel fails (one warning; none where no kernels load at all: the loader said so), aten's add and copy, the
        same values (a `PendingBias` is settled outside the fused ops that would fall back for it)."""
        raw, bias = self.raw, self.bias
        try:
            return bias_contiguous(raw, bias)
        except Exception as exc:  # noqa: BLE001 - a kernel failure falls back, loudly, as the fused ops do
            if not isinstance(exc, KernelsUnavailable):
                warn_once(f"diffusers_fastpath: bias_contiguous failed ({type(exc).__name__}: {exc}); a convolution's "
                          "pending result is settled by aten's add and copy (same numbers, slower)")
        return raw.add(bias.reshape(1, -1, *([1] * (raw.dim() - 2)))).contiguous()


def settled(x):
    """x, or the tensor of a `PendingBias` (its bias added, contiguous: eager's)."""
    return x.settle() if type(x) is PendingBias else x


def convolve_channels_last(conv: nn.Module, padded: torch.Tensor, padding, pending: bool = False,
                           vectors: bool = True):
    """``F.conv3d(padded, conv.weight, conv.bias, conv.stride, padding, ...)`` (eager's convolution of its buffer) of
    the channels-last buffer `padded`: cuDNN's convolution without the bias, then `bias_contiguous` (the bias add and
    the transpose back in one pass), the result contiguous as eager's. Wan's causal convolutions and LTX's
    (`ltx_causal_conv`) run it. With `pending`, where it would run `bias_contiguous`, cuDNN's output and the bias as a
    `PendingBias` instead (for a reader that adds the bias itself), where the channels make whole 16-byte vectors
    (what one of its readers, `ltx_bias_norm_conv`, loads) or `vectors` is off (the other, `conv_bias_residual`,
    takes any); elsewhere the tensor."""
    cudnn = torch._C._ConvBackend.Cudnn
    if _backend(conv, padded, conv.bias, padding) != cudnn or _backend(conv, padded, None, padding) != cudnn:
        # (not cuDNN for this shape: eager's convolution on eager's buffer, the same values channels-first)
        return F.conv3d(padded.contiguous(), conv.weight, conv.bias, conv.stride, padding, conv.dilation, conv.groups)
    out = _convolution(conv, padded, padding)
    if not out.is_contiguous(memory_format=torch.channels_last_3d) or not conv.bias.is_contiguous():
        return out.add_(conv.bias.reshape(1, -1, 1, 1, 1)).contiguous()  # (not what cuDNN writes: aten's own add)
    if pending and (not vectors or out.shape[1] * out.element_size() % 16 == 0):
        return PendingBias(out, conv.bias)
    return bias_contiguous(out, conv.bias)


def _ref(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None, pending: bool = False) -> torch.Tensor:
    """The module's eager forward (a tensor, whatever `pending` asked)."""
    return _pad.causal_conv3d_ref(conv, x, cache_x)


def _kernel(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None, pending: bool = False):
    # (a PendingBias only on a signature already checked: a first call's result is compared with eager's tensor;
    # any channels: its one reader, `conv_bias_residual`, takes them)
    pending = pending and _signature(conv, x, cache_x) in CAUSAL_CONV3D_CL.verified
    buf = _pad.interior_of(x, conv)
    padded = (_pad.fill_front(buf, conv._padding, cache_x) if buf is not None  # (made before: its cache's frames)
              else _pad.padded_input(conv, x, cache_x, channels_last=True))
    return convolve_channels_last(conv, padded, conv.padding, pending, vectors=False)


def takes_interior(conv: nn.Module, x: torch.Tensor) -> bool:
    """Whether a buffer made before the call for `conv` (`causal_conv_pad.interior_view`, from a contiguous x of this
    shape, dtype and device) would go to its channels-last path now: this op and the one-buffer op on (neither
    disabled), the convolution without hooks (they would see the view) and the guard's other conditions met. What a
    producer asks before it makes one (`diffusers_fastpath.ops.channel_rmsnorm_silu`); anything it misses costs a
    copy to contiguous at the convolution, never a number (`causal_conv_pad.as_eager`)."""
    return _plain_call(conv) and CAUSAL_CONV3D_CL.guard(conv, x, None) is None


def _plain_call(conv: nn.Module) -> bool:
    """Whether this op and the one-buffer op are on (neither disabled, nor by the environment) and `conv`'s call runs
    its class's forward alone (no hooks, no forward replaced): what `takes_interior` and `pending_result` ask of the
    convolution before anything stands in for its call's input or its result."""
    for op in (_pad.CAUSAL_CONV3D, CAUSAL_CONV3D_CL):
        if op.disabled is not None or op.env_disabled:
            return False
    return not (hooks_on(conv) or forward_replaced(conv))


def _probe(conv, x: torch.Tensor, cache_x: torch.Tensor | None = None, pending: bool = False):
    """The signature's check on more inputs (`FusedOp`'s probe): cuDNN's channels-last engine, where it is not
    eager's, may round alike on some values only. For a buffer made before the call, a buffer like it (zeros, its
    view filled with the probe's values): the same signature."""
    inside = _pad.interior_of(x, conv) is not None
    for seed in probe_seeds(x):
        cache = None if cache_x is None else wide_like(cache_x, seed + 1000)
        if not inside:
            yield conv, wide_like(x, seed), cache
            continue
        buf = torch.empty(_pad.padded_shape(x, conv._padding), dtype=x.dtype, device=x.device,
                          memory_format=torch.channels_last_3d)
        view = _pad.interior_view(buf.zero_(), conv._padding)
        yield conv, view.copy_(wide_like(x.contiguous(), seed)), cache


CAUSAL_CONV3D_CL = FusedOp("causal_conv3d_cl", ref=_ref, guard=_guard, kernel=_kernel, custom_op=_ref,
                           verify_key=_signature, probe=_probe)
_pad.register_channels_last(CAUSAL_CONV3D_CL, NAMED_SITE)  # (tried first by `causal_conv_pad`'s kernel)


def pending_result(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None):
    """``conv(x, cache_x)`` standing for the module's call, its result a `PendingBias` where the channels-last kernel
    runs on a checked signature (any channels; a tensor where it runs otherwise: a first call, checked against
    eager's as every other); ``None`` where the module's call would do more than its class's forward (hooks, a
    replaced forward), either op is off (`_plain_call`), under ``torch.compile``, or this op does not take the call
    (nothing run, nothing counted: the caller calls the module, whose ops count it). For a reader that adds the bias
    with its own operand, which the caller proves is the value's only reader (`diffusers_fastpath.models.vae_wan`:
    a residual block's ``x + h``, `conv_bias_residual`). The caller counts a result on the module's sites."""
    if torch.compiler.is_compiling() or NAMED_SITE not in conv.__dict__ or not _plain_call(conv):
        return None
    return CAUSAL_CONV3D_CL.try_fast(None, conv, x, cache_x, True)


def causal_conv3d_cl(conv: nn.Module, x: torch.Tensor, cache_x: torch.Tensor | None = None,
                     site: Site | None = None) -> torch.Tensor:
    """``conv(x, cache_x)`` for Wan's / Qwen-Image's causal convolution run channels-last (see the module doc),
    bit-identical to eager (checked on the first call of each convolution signature).

    Args:
        conv: the module (registered by the VAE adapter with `causal_conv_pad.add_conv_class`).
        x: ``[B, C, T, H, W]`` activations.
        cache_x: the previous chunk's last frames (``None`` for none), as the module takes them.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return CAUSAL_CONV3D_CL(site, conv, x, cache_x)
