"""A GroupNorm VAE's ``norm -> SiLU -> convolution`` (FLUX.1's and FLUX.2's ``AutoencoderKL``: ``norm1 ->
nonlinearity -> conv1`` and ``norm2 -> nonlinearity -> dropout -> conv2`` of every ``ResnetBlock2D``, ``conv_norm_out
-> conv_act -> conv_out`` of the encoder and the decoder; HunyuanImage-2.1's the same way) with the norm's result
written channels-last, the layout cuDNN runs the convolution in; bit-identical to eager, checked per signature. Asked
for a pending result (``pending``: a resnet's ``conv2`` before its residual add), cuDNN's channels-last output and the
bias as a `causal_conv_cl.PendingBias`, which `conv_bias_residual` adds with the residual in one pass.

Eager runs, for x ``[B, C, H, W]`` contiguous (the statements of the block's forward, which
`diffusers_fastpath.models.vae_ltx2_chain.ChainPairCalls` joins where nothing else reads the values between them)::

    y   = F.silu(F.group_norm(x, G, gamma, beta, eps))      # `group_norm_silu`'s two kernels here
    out = F.conv2d(y, w, b, ...)                            # cuDNN: nchwToNhwc of y (and of w), its channels-last
                                                            # engine, nhwcToNchw of the result, then aten's bias add

Per FLUX.1 decode at 1024x1024 cuDNN's layout transposes take 8.0 ms of 41 patched (H200, `vae_kl`'s doc). Here::

    y   = group_norm_silu's statistics, then csrc/group_norm_silu.cu's group_norm_apply_cl_kernel: each value the
          apply kernel computes for it (the same device functions), moved channels-last through a shared tile of 64
          channels x 64 positions (16-byte loads along the positions, 16-byte stores along the channels)
    out = conv._conv_forward(y, w, None)                    # cuDNN on a channels-last input: no input transpose
    out = bias_contiguous(out, b)                           # aten's bias add and the transpose back, one pass

The values of y are `group_norm_silu`'s (exact by its own construction, the SiLU proven on every value of the dtype);
the bias add is aten's; so the result is eager's wherever cuDNN's channels-last engine computes what it computes after
its own transposes, which `tools/conv_layout_probe.py` found for every convolution of the FLUX.1 decode (35 of 35 on
an H100, cuDNN 9.19) but no document promises. So the op verifies itself: the first call of each signature (the
norm's `group_norm_silu._signature` and what cuDNN picks its engine by, `causal_conv_cl.engine_key`) is compared with
the eager chain, on its own input and on wide-ranged others (`FusedOp`'s probe, `wide_probe`: another engine's order of
summation rounds to other bits on some inputs only), and a mismatch disables the op for the process (one warning); the pair and the
convolution then run as their own sites do.

What the guard admits: what `group_norm_silu`'s guard admits for the norm and a 4-D x of at least 32 channels (cuDNN
chose another engine channels-last for 8 on an H100; the per-signature check caught it), a multiple of 8 (16-byte
stores along the channels), the activation exactly
``nn.SiLU``, a convolution `conv_bias`'s guard admits (this package's ``FastpathConv2d``, a bias, zero padding, a
cuDNN convolution) with a contiguous weight (eager's output is channels-last for a channels-last one), bf16 / fp16 (an
fp32 convolution under TF32 gave other bits channels-last on an H100: `causal_conv_cl`), ``cudnn.benchmark`` off
(the engine is then timed per call, not chosen by shape); the three modules without hooks (their calls are what this
stands for). Under ``torch.compile`` the joined call runs the statements as written (`ChainPairCalls`), and a direct
call the eager chain (`FusedOp`). Anything else runs the module calls as the block writes them.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

from ._policy import HALF_DTYPES, FusedOp, Site, wide_probe
from .causal_conv_cl import PendingBias, engine_key

# cuDNN's channels-last engine was eager's for every convolution of 32 channels and more tried (32 .. 512 in, 3 .. 512
# out, H100, cuDNN 9.19, bf16 and fp16) and another for 8 (docs/results/gpu_session39.txt): below, no attempt
_MIN_CHANNELS = 32
_MAX_CHANNELS = 65535 * 64

# the norm's and the bias add's modules (the package binds their names to the op functions); read through them, so
# that what tests replace there is what runs here
_norm = importlib.import_module(f"{__package__}.group_norm_silu")
_conv = importlib.import_module(f"{__package__}.conv_bias")


def takes_channels(channels: int) -> bool:
    """Whether a convolution of `channels` input channels can ever run this op: 32 and more, a multiple of 8 (the
    adapters give a joined call's site only there, `vae_conv.joins_group_norm`; a tiny test VAE's 8-channel
    convolutions run their pair and their own call, unmarked)."""
    return channels >= _MIN_CHANNELS and channels % 8 == 0


def group_norm_silu_conv_ref(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor, causal=None,
                             pending: bool = False) -> torch.Tensor:
    """The eager chain: ``F.group_norm``, ``F.silu`` (an ``nn.SiLU`` module's forward), ``nn.Conv2d.forward``
    (`pending`: see `group_norm_silu_conv`; the tensor here)."""
    return _conv.conv_bias_ref(conv, _norm.group_norm_silu_ref(norm, x))


def _fallback(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor, causal=None,
              pending: bool = False) -> torch.Tensor:
    """The module calls, as the block's statements make them."""
    return conv(act(norm(x)))


def _guard(norm, act, conv, x: torch.Tensor, causal=None, pending: bool = False,
           check_pointers: bool = True) -> str | None:
    """``None`` when the channels-last chain takes these inputs, else the reason it does not (counted at the site)."""
    if type(act) is not nn.SiLU:
        return f"{type(act).__name__} is not nn.SiLU"
    if causal is not None:
        return "arguments"
    if not isinstance(x, torch.Tensor) or x.dim() != 4:
        return "x not 4-D"
    reason = _norm._guard(norm, x, check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    device_reason = reason  # (the norm's last check: given after the convolution's own, as causal_conv_cl does)
    if x.dtype not in HALF_DTYPES:
        return f"dtype {str(x.dtype).removeprefix('torch.')}"
    if x.shape[1] < _MIN_CHANNELS:
        return f"fewer than {_MIN_CHANNELS} channels"
    if x.shape[1] % 8:
        return "channels not a multiple of 8"  # (the kernel stores 8 channels of a position as one 16-byte vector)
    if x.shape[1] > _MAX_CHANNELS or x.shape[0] > 65535:
        return "shape"  # (the kernel's grid: 65535 channel tiles of 64, 65535 samples)
    reason = _conv._guard(conv, x, check_pointers)
    if reason is not None and not reason.startswith("device "):
        return reason
    device_reason = device_reason or reason
    if not isinstance(conv, nn.Conv2d) or not conv.weight.is_contiguous():
        return "weight layout"
    if torch.backends.cudnn.benchmark:
        return "cudnn.benchmark"
    return device_reason


def _signature(norm, act, conv, x: torch.Tensor, causal=None, pending: bool = False):
    """What one first-call check vouches for: the norm's signature (dtype, channels, groups, aten's block) and what
    cuDNN picks the convolution's engine by; a call asking for a `PendingBias` is the same signature (its result
    differs only in the bias add and the transpose left to the reader, exact by construction)."""
    return _norm._signature(norm, x), engine_key(x, tuple(x.shape), conv, conv.padding)


def _prove(norm, act, conv, x: torch.Tensor, causal=None, pending: bool = False) -> bool:
    """The SiLU on every value of the dtype, through the channels-last kernel itself (`_prove_silu_channels_last`)."""
    return _prove_silu_channels_last(norm, x)


def _prove_silu_channels_last(norm, x: torch.Tensor) -> bool:
    """The channels-last kernel's SiLU equals eager's on every value of the dtype: its identity-affine probe mode
    (``y = fma(1, x, -0) = x``) over all 65536 bit patterns as ``[1, 8, 64, 128]`` (8 groups of one channel)."""
    values = _norm.every_value(x.dtype, x.device).reshape(1, 8, 64, 128)
    ones = torch.ones(8, dtype=x.dtype, device=x.device)
    variant = _norm.IDENTITY_AFFINE | _norm._platform_variant(x.device, x.dtype)
    out = _norm.raw_channels_last(values, ones, ones, 8, 1e-6, True, variant)
    return torch.equal(_norm.bits(out.contiguous()), _norm.bits(torch.nn.functional.silu(values)))


def _norm_channels_last(norm, x: torch.Tensor) -> torch.Tensor:
    """``F.silu(F.group_norm(x, ...))`` laid out channels-last (csrc/group_norm_silu.cu)."""
    variant = _norm._platform_variant(x.device, x.dtype)
    return _norm.raw_channels_last(x, norm.weight, norm.bias, norm.num_groups, norm.eps, True, variant)


def _convolution(conv: nn.Module, y: torch.Tensor) -> torch.Tensor:
    """The convolution without its bias, as ``nn.Conv2d`` calls it (cuDNN, given a channels-last input, returns a
    channels-last result)."""
    return conv._conv_forward(y, conv.weight, None)


def _kernel(norm, act, conv, x: torch.Tensor, causal=None, pending: bool = False):
    out = _convolution(conv, _norm_channels_last(norm, x))
    bias = conv.bias
    if not out.is_contiguous(memory_format=torch.channels_last) or not bias.is_contiguous():
        return out.add_(bias.reshape(1, -1, 1, 1)).contiguous()  # (not what cuDNN writes: aten's own add)
    # (a `PendingBias` only once this signature's tensor matched eager: the first call returns the tensor it checks)
    if pending and _signature(norm, act, conv, x) in GROUP_NORM_SILU_CONV.verified:
        return PendingBias(out, bias)
    return _conv.bias_contiguous(out, bias)


GROUP_NORM_SILU_CONV = FusedOp("group_norm_silu_conv", ref=group_norm_silu_conv_ref, guard=_guard, kernel=_kernel,
                               custom_op=group_norm_silu_conv_ref, verify_key=_signature, prove=_prove,
                               fallback=_fallback, modules=(0, 1, 2),  # the norm, the SiLU, the convolution
                               probe=wide_probe(3, 5))


def group_norm_silu_conv(norm: nn.Module, act: nn.Module, conv: nn.Module, x: torch.Tensor,
                         site: Site | None = None, pending: bool = False):
    """``conv(act(norm(x)))`` for a VAE's ``nn.GroupNorm``, its ``nn.SiLU`` and the ``nn.Conv2d`` that reads them, the
    norm written channels-last for the convolution (see the module doc), bit-identical to eager (checked on the first
    call of each signature). With `pending`, where the kernel runs and this signature was checked already, cuDNN's
    channels-last output and the bias as a `causal_conv_cl.PendingBias` instead of the tensor (for the residual add
    that reads it: `diffusers_fastpath.ops.conv_bias_residual`; elsewhere the tensor).

    Args:
        norm: the GroupNorm (a module `group_norm_silu` takes).
        act: the ``nn.SiLU`` after it.
        conv: the convolution that reads the SiLU's result (this package's ``FastpathConv2d``).
        x: ``[B, C, H, W]`` activations.
        site: the call site's counters, shown by `diffusers_fastpath.report`.
        pending: ask for a `PendingBias` (above).
    """
    return GROUP_NORM_SILU_CONV(site, norm, act, conv, x, None, pending)
