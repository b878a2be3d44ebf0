"""diffusers' ``RMSNorm`` followed by the adaLN modulate in the storage dtype, in one pass, bit-identical to the eager
chain of LTX-Video's ``LTXVideoTransformerBlock`` (T = bf16 or fp16, every tensor T)::

    norm_hidden_states = self.norm1(hidden_states)                 # RMSNorm(dim, elementwise_affine=False)
    norm_hidden_states = norm_hidden_states * (1 + scale_msa) + shift_msa
    norm_hidden_states = self.norm2(hidden_states) * (1 + scale_mlp) + shift_mlp

where the scale and shift are per-token rows (``[B, T, D]`` views of the ``[B, T, 6, D]`` adaLN table plus the
timestep embedding; ``[B, 1, D]`` rows broadcast over the sequence are taken too). Rounding points::

    y   = round_T(x * rsqrt(mean(x.float() ** 2) + eps))           # weightless: diffusers casts back to x's dtype
          (with a weight: round_T(round_T(x * rstd) * weight), as every other op of this kernel)
    out = round_T(round_T(y * round_T(1 + scale)) + shift)           # three eager kernels, each rounding to T

The kernel is ``csrc/rmsnorm_scale_shift.cu`` with the ``kModulate`` epilogue: the norm sums in aten's reduction
order (see `diffusers_fastpath.ops.rmsnorm_scale_shift`), so the op verifies itself on its first call per (dtype,
D), and a mismatch disables it for the process with one warning. Ten eager kernels (seven of the norm over fp32
copies, three of the modulate) become one that reads x, scale and shift once and writes once.

The guard admits what the shared kernel reproduces: three-dimensional contiguous ``x`` whose row length D is a
multiple of 128 with 512 < D < 8192 (LTX-Video: 2048), at least 16 rows, fp16/bf16 throughout, diffusers' ``RMSNorm``
(or ``FastpathRMSNorm``) without bias (with a ``[D]`` weight of x's dtype, or none), scale and shift tensor rows with
unit innermost stride, no autograd.
"""

from __future__ import annotations

import torch

from . import _nvrtc
from ._build import LazyLauncher
from ._policy import FusedOp, Site
from .rmsnorm_scale_shift import (MODULATE, _broadcast_rows, _guard_rows, _Norm, _nvrtc_launch, _rms_norm,
                                  broadcast_guard)


def rmsnorm_modulate_ref(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """The eager chain as LTX-Video writes it: ``norm(x) * (1 + scale) + shift``, through the ``RMSNorm`` module's
    call (so its hooks run where the kernel refused for them)."""
    return norm(x) * (1 + scale) + shift


def _guard(norm, x, scale, shift, check_pointers: bool = True) -> str | None:
    if x.dim() != 3:
        return "shape"
    return broadcast_guard(norm, x, (scale, shift), check_pointers, weightless=True)


# The NVRTC way: the shared launcher with the kModulate epilogue (bindings_norms.cpp's rmsnorm_modulate: the
# allocation).
def _nvrtc_kernel(x, weight, scale, shift, eps: float, out=None) -> torch.Tensor:
    out = x.new_empty(x.shape) if out is None else out
    _nvrtc_launch(out, None, x, weight, eps, MODULATE, scale=scale, shift=shift)
    return out


def _raw_guard(x, weight, scale, shift, eps):
    return _guard_rows(_Norm(weight, eps), x, (scale, shift), True, weightless=True)  # operands of x's shape only


_nvrtc.raw_op("_rmsnorm_modulate_cuda", "(Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps) -> Tensor",
              _raw_guard, _nvrtc_kernel)
_nvrtc.raw_op("_rmsnorm_modulate_cuda_out",
              "(Tensor(a!) out, Tensor x, Tensor? weight, Tensor scale, Tensor shift, float eps) -> ()",
              _raw_guard, _nvrtc_kernel, outs=1)

_launch = LazyLauncher(_nvrtc_kernel, "_rmsnorm_modulate_cuda")


def _kernel(norm, x, scale, shift):
    return _launch(x, norm.weight, _broadcast_rows(scale, x), _broadcast_rows(shift, x), norm.eps)


@torch.library.custom_op("diffusers_fastpath::rmsnorm_modulate", mutates_args=())
def _rmsnorm_modulate_op(x: torch.Tensor, weight: torch.Tensor | None, scale: torch.Tensor, shift: torch.Tensor,
                         eps: float) -> torch.Tensor:
    norm = _Norm(weight, eps)
    if _guard(norm, x, scale, shift) is None:
        return _kernel(norm, x, scale, shift)
    return (_rms_norm(x, weight, eps) * (1 + scale) + shift).contiguous()


@_rmsnorm_modulate_op.register_fake
def _(x, weight, scale, shift, eps):
    torch._check(x.dim() == 3, lambda: "rmsnorm_modulate: x must be three-dimensional")
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _signature(norm, x, *rest):
    return (str(x.dtype).removeprefix("torch."), x.shape[-1], norm.weight is None)


RMSNORM_MODULATE = FusedOp(
    "rmsnorm_modulate",
    ref=rmsnorm_modulate_ref,
    guard=_guard,
    kernel=_kernel,
    custom_op=lambda norm, x, scale, shift: torch.ops.diffusers_fastpath.rmsnorm_modulate.default(
        x, norm.weight, scale, shift, norm.eps),
    verify_key=_signature,
    modules=(0,),  # the norm whose call the kernel stands for: its hooks refuse the call
)


def rmsnorm_modulate(norm, x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                     site: Site | None = None) -> torch.Tensor:
    """``norm(x) * (1 + scale) + shift``, fused and bit-identical (LTX-Video's adaLN sites).

    Args:
        norm: the diffusers ``RMSNorm`` module (with or without a weight; it runs itself on fallback).
        x: ``[batch, seq, dim]`` activations, contiguous.
        scale, shift: ``[batch, seq, dim]`` per-token rows (any row strides, unit innermost stride) or ``[batch, 1,
            dim]`` rows broadcast over the sequence.
        site: the call site's counters, shown by `diffusers_fastpath.report`.

    Example:
        >>> import torch
        >>> from diffusers.models.normalization import RMSNorm
        >>> from diffusers_fastpath.ops import rmsnorm_modulate, rmsnorm_modulate_ref
        >>> norm, (x, s, h) = RMSNorm(1024, eps=1e-6, elementwise_affine=False), torch.randn(3, 2, 16, 1024)
        >>> torch.equal(rmsnorm_modulate(norm, x, s, h), rmsnorm_modulate_ref(norm, x, s, h))
        True
    """
    return RMSNORM_MODULATE(site, norm, x, scale, shift)
