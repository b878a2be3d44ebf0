"""A causal convolution's channels-last result, its bias not yet added, read by the residual add after it (LTX-2's
resnets: ``hidden_states = conv2(...)``, then ``hidden_states = hidden_states + inputs``); bit-identical to eager,
checked per signature.

Eager runs, for the convolution's padded input ``p`` and the block's input ``inputs`` (or its shortcut's result)::

    h   = F.conv3d(p, w, b)        # cuDNN without the bias, then aten's output.add_(b): one fp32 add rounded to T
                                   # (Convolution.cpp, ConvBackend::Cudnn); h contiguous
    out = h + inputs               # aten's add of two T tensors: one fp32 add (``a + alpha * b``, alpha 1) rounded to T

The patched chain before this op wrote ``h`` with ``bias_contiguous`` (csrc/conv_bias.cu: ``round(raw + b[c])``
written contiguous, the transpose of cuDNN's channels-last ``raw`` back in the same pass) and then aten's add read
``h`` and ``inputs`` and wrote ``out`` (``CUDAFunctor_add``: 24 calls, 8.5 ms of the 768x512x121 decode on an H100,
20 of them the resnets'). Here the convolution's chain leaves ``raw`` and ``b`` as a `causal_conv_cl.PendingBias`
(`ltx_norm_conv` or `ltx_bias_norm_conv` with ``pending``), and::

    out = bias_residual_contiguous(raw, b, inputs)   # conv_bias.cu's bias_contiguous, kResidual: per element
                                                     # round(round(raw + b[c]) + inputs), written contiguous

Why it is eager's: the first rounding is ``bias_contiguous``'s (aten's bias add: h's value), the second aten's add of
that value and the residual's (one fp32 add, rounded to T; IEEE addition commutes, so ``inputs + h`` is the same
word). Exact by construction; the first call of each signature (the dtype, the dims, the channels) is still compared
with the eager chain on ``PendingBias.settle()`` (bias_contiguous's tensor, eager's ``h``) plus the residual
(`FusedOp` verification), which disables the op on a mismatch (one warning).

Who may hold a `PendingBias`: `diffusers_fastpath.models.vae_ltx2_chain` asks the convolution's chain for one only
where the block's rewritten forward proves that the value reaches this op's call (``V = <ns>.pending_add(self, V,
W)``, the statement ``V = V + W`` rewritten) or a settle before any other reader; `diffusers_fastpath.models.vae_wan`
asks Wan's and Qwen-Image's causal convolution for one (`causal_conv_cl.pending_result`) only where the residual
block's forward ends ``return V + E`` and V's last binding on every path is that convolution's call (``return
<ns>.pending_add(self, V, E)``). Both adds run `add_pending`. This op stands for no module call
(the add is an operator; the convolution's hooks refused its chain already, which then returned the tensor).

What the guard admits (anything else: the caller settles the value and runs the add as written, counted on the
block's site with the reason): a `PendingBias` whose ``raw`` is a bf16/fp16 ``[B, C, T, H, W]`` (or 4-D) laid out
channels-last and whose ``bias`` is a contiguous ``[C]`` of its dtype; a residual that is a plain ``torch.Tensor``
(a subclass's ``__add__`` is its own) of raw's dtype (eager would promote another), shape (eager would broadcast
another) and device, contiguous, or time-major (``[B, C, T, H, W]`` laid out as ``[B, T, C, H, W]``: a Wan resnet's
identity shortcut right after an upsampler, whose result is time-major) where the convolution's value is the add's
first operand (`add_pending`: eager's sum is contiguous in both cases, as this op writes it; a time-major first operand
lays it out time-major); no autograd, on CUDA.
"""

from __future__ import annotations

import torch

from ._policy import HALF_DTYPES, FusedOp, Site, autograd_device_reason
from .causal_conv_cl import PendingBias, settled
from .conv_bias import bias_residual_contiguous, residual_plane


def conv_bias_residual_ref(x: PendingBias, residual: torch.Tensor) -> torch.Tensor:
    """The eager chain: the convolution's tensor (``x.settle()``) plus the residual, aten's add."""
    return x.settle() + residual


def _guard(x, residual, check_pointers: bool = True) -> str | None:
    """``None`` when the kernel takes these inputs, else the reason it does not (counted at the block's site)."""
    if type(x) is not PendingBias:
        return "x not a convolution's pending result"
    raw, bias = x.raw, x.bias
    if not isinstance(raw, torch.Tensor) or raw.dtype not in HALF_DTYPES:
        return f"dtype {str(getattr(raw, 'dtype', None)).removeprefix('torch.')}"
    if raw.dim() not in (4, 5) or not raw.is_contiguous(
            memory_format=torch.channels_last if raw.dim() == 4 else torch.channels_last_3d):
        return "x not channels-last [B, C, *]"
    if not (isinstance(bias, torch.Tensor) and bias.dtype is raw.dtype and bias.dim() == 1
            and bias.shape[0] == raw.shape[1] and bias.is_contiguous()):
        return "bias"
    if type(residual) is not torch.Tensor:
        return "residual not a tensor"
    if residual.dtype is not raw.dtype:
        return "mixed dtypes"
    if residual.shape != raw.shape:
        return "residual's shape (broadcast)"
    if residual_plane(residual) is None:  # (contiguous, or time-major: the kernel reads either)
        return "residual not contiguous"
    return autograd_device_reason(raw, bias, residual)


def _signature(x: PendingBias, residual: torch.Tensor):
    """What one first-call check vouches for: the dtype, the dims, the channels (the tiles' edges) and whether the
    residual is time-major."""
    raw = x.raw
    return str(raw.dtype).removeprefix("torch."), raw.dim(), raw.shape[1], bool(residual_plane(residual))


def _kernel(x: PendingBias, residual: torch.Tensor) -> torch.Tensor:
    return bias_residual_contiguous(x.raw, x.bias, residual)


CONV_BIAS_RESIDUAL = FusedOp("conv_bias_residual", ref=conv_bias_residual_ref, guard=_guard, kernel=_kernel,
                             custom_op=conv_bias_residual_ref, verify_key=_signature)


def add_pending(site: Site | None, left, right):
    """``left + right`` as a block wrote it, where one operand may be a convolution's `PendingBias`: this op where
    `site` (the block's) is given and it takes them (counted there), else that value settled (eager's tensor) and the
    add as written, the operands in their order. Neither pending: the add itself (both, which no rewrite makes: each
    settled). The residual add of the rewritten blocks (`diffusers_fastpath.models.vae_ltx2_chain`'s and
    `diffusers_fastpath.models.vae_wan`'s ``pending_add``)."""
    if type(left) is PendingBias and type(right) is not PendingBias:
        x, residual = left, right
    elif type(right) is PendingBias and type(left) is not PendingBias:
        x, residual = right, left
    else:
        return settled(left) + settled(right)
    # (the op's tensor is contiguous: eager's sum is too where the convolution's contiguous tensor is the first operand
    # or both are; a time-major residual first lays eager's sum out time-major, TensorIterator's order)
    if site is not None and (x is left or type(residual) is not torch.Tensor or residual.is_contiguous()):
        out = CONV_BIAS_RESIDUAL.try_fast(site, x, residual)
        if out is not None:
            return out
    return x.settle() + right if x is left else left + x.settle()


def conv_bias_residual(x: PendingBias, residual: torch.Tensor, site: Site | None = None) -> torch.Tensor:
    """``x.settle() + residual`` for a convolution's pending result `x` (`ltx_norm_conv` or `ltx_bias_norm_conv` with
    ``pending``): the bias, the transpose back and the residual add in one pass (see the module doc), bit-identical to
    eager (checked on the first call of each signature).

    Args:
        x: the convolution's `causal_conv_cl.PendingBias`.
        residual: the tensor eager adds to the convolution's (a contiguous one of its shape and dtype).
        site: the call site's counters, shown by `diffusers_fastpath.report`.
    """
    return CONV_BIAS_RESIDUAL(site, x, residual)
